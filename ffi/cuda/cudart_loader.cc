// Copyright 2025 The jaxmem Authors.
//
// cudart_loader.h: dlopen / dlsym of the CUDA runtime.

#include "cuda/cudart_loader.h"

#include <dlfcn.h>
#ifdef __linux__
#include <link.h>
#endif

#include <atomic>
#include <string>
#include <vector>

#include "cuda/cudart_api.h"
#include "mutex.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {
namespace cudart {
namespace {

// The sonames of the runtimes of jax's CUDA 13 and CUDA 12 wheels.
constexpr const char* kSonames[] = {"libcudart.so.13", "libcudart.so.12"};

// The table of the loaded runtime; set once, never cleared.
std::atomic<const Api*> g_loaded{nullptr};

std::string DlError() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown error";
}

// The file the handle was loaded from (a soname resolves to a path), or
// `fallback`.
std::string LoadedPath(void* handle, const std::string& fallback) {
#ifdef __linux__
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr &&
      map->l_name != nullptr && map->l_name[0] != '\0') {
    return map->l_name;
  }
#else
  (void)handle;
#endif
  return fallback;
}

// Opens `path` with `flags` and resolves every function of the table into
// `*api`. Unavailable, naming `path`, when it cannot be opened or lacks a
// function (then it is closed again).
Status Open(const std::string& path, int flags, void** handle, Api* api,
            std::string* description) {
  dlerror();  // clear a stale error
  void* h = dlopen(path.c_str(), flags);
  if (h == nullptr) {
    if (flags & RTLD_NOLOAD) return Unavailable(path + " is not loaded");
    // dlerror() usually names the file already.
    std::string error = DlError();
    return Unavailable(error.find(path) == std::string::npos
                           ? path + ": " + error
                           : error);
  }
  Api table;
#define JAXMEM_CUDART_RESOLVE(name, ret, params, args)                    \
  table.name = reinterpret_cast<decltype(table.name)>(dlsym(h, #name));   \
  if (table.name == nullptr) {                                            \
    std::string where = LoadedPath(h, path);                              \
    dlclose(h);                                                           \
    return Unavailable(where + " is not a CUDA runtime (libcudart): it "  \
                       "has no function " #name);                         \
  }
  JAXMEM_CUDART_FUNCTIONS(JAXMEM_CUDART_RESOLVE)
#undef JAXMEM_CUDART_RESOLVE
  // Pure library call: no driver, no device.
  int version = 0;
  std::string what = LoadedPath(h, path);
  if (table.cudaRuntimeGetVersion(&version) == cudaSuccess && version > 0) {
    what += " (CUDA runtime " + std::to_string(version / 1000) + "." +
            std::to_string(version % 1000 / 10) + ")";
  }
  *handle = h;
  *api = table;
  *description = what;
  return Status::Ok();
}

class Loader {
 public:
  static Loader& Global() {
    static Loader* loader = new Loader();  // leaked: handlers may outlive exit
    return *loader;
  }

  bool Load(const std::vector<std::string>& candidates, bool defaults)
      EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (g_loaded.load(std::memory_order_acquire) != nullptr) return true;
    std::vector<std::string> failures;
    // 1. A runtime already in the process (jax's CUDA plugin loaded it).
    if (defaults) {
      for (const char* soname : kSonames) {
        if (TryLocked(soname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, nullptr)) {
          return true;
        }
      }
    }
    // 2. The candidates (jax's wheels), 3. the linker's search.
    std::vector<std::string> order(candidates);
    if (defaults) {
      order.insert(order.end(), std::begin(kSonames), std::end(kSonames));
    }
    for (const std::string& path : order) {
      if (TryLocked(path, RTLD_NOW | RTLD_LOCAL, &failures)) return true;
    }
    status_ = "not loaded: ";
    if (failures.empty()) status_ += "no candidate to try";
    for (size_t i = 0; i < failures.size(); ++i) {
      status_ += (i > 0 ? "; " : "") + failures[i];
    }
    return false;
  }

  std::string Describe() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return status_;
  }

 private:
  // Installs `path` as the runtime when it opens and resolves; otherwise
  // appends why not to `*failures` (when given).
  bool TryLocked(const std::string& path, int flags,
                 std::vector<std::string>* failures) REQUIRES(mu_) {
    void* handle = nullptr;
    Api api;
    std::string description;
    Status st = Open(path, flags, &handle, &api, &description);
    if (!st.ok()) {
      if (failures != nullptr) failures->push_back(st.message());
      return false;
    }
    status_ = "loaded: " + description;
    g_loaded.store(new Api(api), std::memory_order_release);  // never freed
    return true;
  }

  Mutex mu_;
  std::string status_ GUARDED_BY(mu_) = "not loaded: no load was attempted";
};

}  // namespace

const Api* Loaded() { return g_loaded.load(std::memory_order_acquire); }

bool Load(const std::vector<std::string>& candidates, bool defaults) {
  return Loader::Global().Load(candidates, defaults);
}

std::string LoadStatus() { return Loader::Global().Describe(); }

Status Probe(const std::string& path, std::string* description) {
  void* handle = nullptr;
  Api api;
  // A runtime that opens stays open: unloading libcudart is not safe once
  // anything may have initialized it.
  return Open(path, RTLD_NOW | RTLD_LOCAL, &handle, &api, description);
}

}  // namespace cudart
}  // namespace jaxmem
