// Copyright 2025 The jaxmem Authors.
//
// Int64Numpy (bindings.h): a vector handed to Python as a 1-D int64 numpy
// array that owns it, without a copy.

#include <cstdint>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"

namespace jaxmem {

namespace nb = nanobind;

nb::object Int64Numpy(std::vector<int64_t> values) {
  auto* owned = new std::vector<int64_t>(std::move(values));
  nb::capsule owner(owned, [](void* ptr) noexcept {
    delete static_cast<std::vector<int64_t>*>(ptr);
  });
  return nb::cast(nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(
      owned->data(), {owned->size()}, owner));
}

}  // namespace jaxmem
