// Copyright 2025 The jaxmem Authors.
//
// The part of the CUDA runtime API that the CUDA handlers (cuda/handlers.cc)
// use, declared here so that they compile with the host C++ compiler on a
// machine with no CUDA headers at all; the functions are resolved at run time
// from the libcudart that jax's CUDA wheels bring (cuda/cudart_loader.h).
//
// Every name, value and signature is copied from NVIDIA's CUDA runtime API
// (CUDA Runtime API reference, "Data types used by CUDA Runtime" and the
// Error Handling, Device Management, Stream Management, Event Management,
// Execution Control and Memory Management modules; headers driver_types.h and
// cuda_runtime_api.h), and is identical in CUDA 12 and 13:
//
//   * cudaStream_t, cudaEvent_t: pointers to opaque structs (CUstream_st,
//     CUevent_st); XLA hands the handlers its stream as such a pointer
//     (ffi::PlatformStream<cudaStream_t> only needs a pointer type).
//   * cudaError_t: an enum the size of an int; only the values named below are
//     compared against, every other value is reported by cudaGetErrorString.
//   * cudaMemcpyKind, and the flags cudaHostAllocPortable,
//     cudaEventDisableTiming, cudaStreamNonBlocking.
//   * the functions: JAXMEM_CUDART_FUNCTIONS below.
//
// Everything lives in namespace jaxmem::cudart, so this header and the real
// cuda_runtime_api.h can be included in one translation unit:
// tests/native/test_cuda_handlers.py does that with the headers of the
// nvidia-cuda-runtime-cu12 wheel and static_asserts that each signature in
// JAXMEM_CUDART_FUNCTIONS, expanded at global scope (so with NVIDIA's types),
// is the type of NVIDIA's declaration, and that the types and values below
// match NVIDIA's.
//
// The alternative, compiling against cuda_runtime_api.h where CMake finds it,
// was not taken: a plain `pip install` has no CUDA headers at build time (the
// cu12 runtime wheel ships cuda_runtime_api.h but not the crt/ headers it
// includes), and one set of declarations keeps one build.

#ifndef JAXMEM_FFI_CUDA_CUDART_API_H_
#define JAXMEM_FFI_CUDA_CUDART_API_H_

#include <cstddef>
#include <type_traits>

namespace jaxmem {
namespace cudart {

// driver_types.h: `enum cudaError` (unnamed underlying type, 4 bytes); the
// fixed `int` makes every value the runtime returns a valid value here.
enum cudaError : int {
  cudaSuccess = 0,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
};
using cudaError_t = cudaError;

// driver_types.h: `enum cudaMemcpyKind`.
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

// driver_types.h: opaque handles.
struct CUstream_st;
struct CUevent_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;

// driver_types.h: CUDART_CB is empty outside Windows.
using cudaHostFn_t = void (*)(void* userData);

// driver_types.h: flags.
inline constexpr unsigned int cudaHostAllocPortable = 0x01;
inline constexpr unsigned int cudaEventDisableTiming = 0x02;
inline constexpr unsigned int cudaStreamNonBlocking = 0x01;

// X(name, return type, parameters, arguments): the runtime functions the
// handlers call, with cuda_runtime_api.h's parameter lists (default arguments
// dropped). Types are written unqualified so that an expansion at global scope
// after #include <cuda_runtime_api.h> names NVIDIA's types (the test above).
#define JAXMEM_CUDART_FUNCTIONS(X)                                             \
  X(cudaGetErrorString, const char*, (cudaError_t error), (error))             \
  X(cudaRuntimeGetVersion, cudaError_t, (int* runtimeVersion),                 \
    (runtimeVersion))                                                          \
  X(cudaGetDevice, cudaError_t, (int* device), (device))                       \
  X(cudaStreamCreateWithFlags, cudaError_t,                                    \
    (cudaStream_t * pStream, unsigned int flags), (pStream, flags))            \
  X(cudaStreamWaitEvent, cudaError_t,                                          \
    (cudaStream_t stream, cudaEvent_t event, unsigned int flags),              \
    (stream, event, flags))                                                    \
  X(cudaStreamSynchronize, cudaError_t, (cudaStream_t stream), (stream))       \
  X(cudaEventCreateWithFlags, cudaError_t,                                     \
    (cudaEvent_t * event, unsigned int flags), (event, flags))                 \
  X(cudaEventRecord, cudaError_t, (cudaEvent_t event, cudaStream_t stream),    \
    (event, stream))                                                           \
  X(cudaEventSynchronize, cudaError_t, (cudaEvent_t event), (event))           \
  X(cudaEventDestroy, cudaError_t, (cudaEvent_t event), (event))               \
  X(cudaLaunchHostFunc, cudaError_t,                                           \
    (cudaStream_t stream, cudaHostFn_t fn, void* userData),                    \
    (stream, fn, userData))                                                    \
  X(cudaHostAlloc, cudaError_t,                                                \
    (void** pHost, size_t size, unsigned int flags), (pHost, size, flags))     \
  X(cudaFreeHost, cudaError_t, (void* ptr), (ptr))                             \
  X(cudaMemcpyAsync, cudaError_t,                                              \
    (void* dst, const void* src, size_t count, cudaMemcpyKind kind,            \
     cudaStream_t stream),                                                     \
    (dst, src, count, kind, stream))

// The function table: one pointer per function, resolved with dlsym.
struct Api {
#define JAXMEM_CUDART_API_MEMBER(name, ret, params, args) \
  ret(*name) params = nullptr;
  JAXMEM_CUDART_FUNCTIONS(JAXMEM_CUDART_API_MEMBER)
#undef JAXMEM_CUDART_API_MEMBER
};

// The table of the loaded runtime, or nullptr before a successful Load
// (cudart_loader.h).
const Api* Loaded();

// What a call returns when no runtime is loaded (the handlers are registered
// only after a successful load, so only a misuse gets here).
template <typename R>
R NotLoaded() {
  if constexpr (std::is_same_v<R, const char*>) {
    return "the CUDA runtime (libcudart) is not loaded";
  } else {
    return cudaErrorInitializationError;
  }
}

// The functions themselves, under their CUDA names: each calls through the
// table of the loaded runtime.
#define JAXMEM_CUDART_WRAPPER(name, ret, params, args) \
  inline ret name params {                             \
    const Api* api = Loaded();                         \
    return api != nullptr ? api->name args : NotLoaded<ret>(); \
  }
JAXMEM_CUDART_FUNCTIONS(JAXMEM_CUDART_WRAPPER)
#undef JAXMEM_CUDART_WRAPPER

}  // namespace cudart
}  // namespace jaxmem

#endif  // JAXMEM_FFI_CUDA_CUDART_API_H_
