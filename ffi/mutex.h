// Copyright 2025 The jaxmem Authors.
//
// `Mutex`, `MutexLock` and `CondVar`: std::mutex and
// std::condition_variable with the thread-safety annotations of
// thread_annotations.h, so that clang can check the GUARDED_BY / REQUIRES
// contracts of the code that uses them. No behaviour of their own.

#ifndef JAXMEM_FFI_MUTEX_H_
#define JAXMEM_FFI_MUTEX_H_

#include <condition_variable>
#include <mutex>

#include "thread_annotations.h"

namespace jaxmem {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `*mu` from construction to destruction.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class CondVar {
 public:
  // Atomically releases `*mu` and blocks until notified (or woken
  // spuriously), then takes `*mu` again before returning. To the analysis
  // `*mu` stays held throughout, so callers loop on their condition:
  //   while (!ready_) cv_.Wait(&mu_);
  void Wait(Mutex* mu) REQUIRES(*mu) {
    // Adopts the lock the caller holds and gives it back held.
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_MUTEX_H_
