// Copyright 2025 The jaxmem Authors.
//
// Clang thread-safety annotations
// (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html). Under clang with
// -Wthread-safety (CMake: JAXMEM_THREAD_SAFETY_ANALYSIS, on by default for
// clang) the compiler checks that every member marked GUARDED_BY(mu_) is only
// touched with mu_ held and that every function marked REQUIRES(mu_) (the
// `...Locked` helpers) is only called with it held. Other compilers (gcc,
// nvcc's host pass) see nothing. The capability itself is `Mutex` (mutex.h):
// std::mutex carries no annotations in libstdc++.

#ifndef JAXMEM_FFI_THREAD_ANNOTATIONS_H_
#define JAXMEM_FFI_THREAD_ANNOTATIONS_H_

#if defined(__clang__)
#define JAXMEM_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define JAXMEM_THREAD_ANNOTATION_(x)
#endif

// A class that is a lock (Mutex).
#define CAPABILITY(x) JAXMEM_THREAD_ANNOTATION_(capability(x))
// A RAII class that holds a lock for its lifetime (MutexLock).
#define SCOPED_CAPABILITY JAXMEM_THREAD_ANNOTATION_(scoped_lockable)
// A member read or written only with the lock held.
#define GUARDED_BY(x) JAXMEM_THREAD_ANNOTATION_(guarded_by(x))
// A pointer member whose pointee is read or written only with the lock held.
#define PT_GUARDED_BY(x) JAXMEM_THREAD_ANNOTATION_(pt_guarded_by(x))
// A function that must be called with the lock(s) held.
#define REQUIRES(...) \
  JAXMEM_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
// A function that must be called without the lock(s) (it takes them).
#define EXCLUDES(...) JAXMEM_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
// A function that takes / releases the lock(s).
#define ACQUIRE(...) JAXMEM_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define RELEASE(...) JAXMEM_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
// Opts a function out of the analysis (say why where it is used).
#define NO_THREAD_SAFETY_ANALYSIS \
  JAXMEM_THREAD_ANNOTATION_(no_thread_safety_analysis)

#endif  // JAXMEM_FFI_THREAD_ANNOTATIONS_H_
