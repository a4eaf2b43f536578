// Copyright 2025 The jaxmem Authors.

#include "arena/arena_util.h"

#include <unistd.h>

#include <cstring>
#include <limits>

namespace jaxmem {
namespace arena_internal {

size_t PageSize() {
  static const size_t page = [] {
    long p = ::sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return page;
}

bool RoundUp(size_t x, size_t to, size_t* out) {
  if (to == 0) return false;
  size_t r = x % to;
  if (r == 0) {
    *out = x;
    return true;
  }
  if (x > std::numeric_limits<size_t>::max() - (to - r)) return false;
  *out = x + (to - r);
  return true;
}

std::string Bytes(uint64_t n) { return std::to_string(n) + " bytes"; }

std::string ErrnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) +
         ")";
}

}  // namespace arena_internal
}  // namespace jaxmem
