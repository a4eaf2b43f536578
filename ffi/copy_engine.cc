// Copyright 2025 The jaxmem Authors.

#include "copy_engine.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include "ids.h"

namespace jaxmem {
namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

int ThreadsFromEnv() {
  const char* env = std::getenv("JAXMEM_COPY_THREADS");
  if (env == nullptr || *env == '\0') return 1;
  char* end = nullptr;
  long n = std::strtol(env, &end, 10);
  if (end == env || n < 0) return 1;
  return n > 64 ? 64 : static_cast<int>(n);
}

std::vector<int> CpusFromEnv() {
  std::vector<int> cpus;
  const char* env = std::getenv("JAXMEM_COPY_CPUS");
  if (env == nullptr) return cpus;
  std::stringstream ss(env);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    long c = std::strtol(item.c_str(), &end, 10);
    if (end != item.c_str() && c >= 0 && c < 4096) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

// Pins the calling thread to `cpus` (nothing to do for none).
Status PinThread(const std::vector<int>& cpus) {
  if (cpus.empty()) return Status::Ok();
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    return InvalidArgument("cannot pin a copy worker to the requested CPUs: " +
                           std::string(std::strerror(rc)));
  }
  return Status::Ok();
#else
  return InvalidArgument("CPU affinity is only supported on Linux");
#endif
}

const char* KindName(CopyKind kind) {
  return kind == CopyKind::kOffload ? "offload" : "fetch";
}

}  // namespace

CopyEngine& CopyEngine::Global() {
  static CopyEngine* engine = new CopyEngine();
  return *engine;
}

CopyEngine::CopyEngine()
    : first_ticket_(RandomFirstId()),
      next_ticket_(first_ticket_),
      desired_threads_(ThreadsFromEnv()),
      cpus_(CpusFromEnv()) {
  stats_.threads = desired_threads_;
}

Status CopyEngine::SetCpus(const std::vector<int>& cpus) {
  // Check the CPUs on a short-lived thread before committing to them.
  Status st;
  std::thread([&] { st = PinThread(cpus); }).join();
  if (!st.ok()) return st;
  MutexLock lock(&mu_);
  cpus_ = cpus;
  ++generation_;  // running workers retire when idle; new ones get the mask
  work_cv_.NotifyAll();
  return Status::Ok();
}

void CopyEngine::SetThreads(int n) {
  MutexLock lock(&mu_);
  desired_threads_ = n < 0 ? 0 : (n > 64 ? 64 : n);
  stats_.threads = desired_threads_;
  // Surplus workers exit when they next wake up; missing ones start with the
  // next submitted copy. Jobs queued while the count drops to 0 are still
  // served: workers only exit on an empty queue.
  work_cv_.NotifyAll();
}

void CopyEngine::EnsureWorkersLocked() {
  while (running_threads_ < desired_threads_) {
    ++running_threads_;
    // Detached: the engine is never destroyed, and a worker blocked on the
    // condition variable must not keep the process from exiting.
    std::thread([this, g = generation_, cpus = cpus_] {
      // Checked by SetCpus; best effort for the env default.
      (void)PinThread(cpus);
      WorkerLoop(g);
    }).detach();
  }
}

void CopyEngine::WorkerLoop(uint64_t generation) {
  MutexLock lock(&mu_);
  for (;;) {
    // Until there is a job, or this worker is surplus or stale.
    while (queue_.empty() && running_threads_ <= desired_threads_ &&
           generation == generation_) {
      work_cv_.Wait(&mu_);
    }
    if (queue_.empty() || generation != generation_) {
      // Surplus (SetThreads lowered the count) or stale (SetCpus): retire,
      // and let a fresh worker with the new mask take over the queue.
      --running_threads_;
      if (!queue_.empty()) EnsureWorkersLocked();
      return;
    }
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    RunUnlocked(*job);
  }
}

double CopyEngine::RunUnlocked(Job& job) {
  job.started = true;
  // The caller's lock on mu_ is released for the copy and held again after.
  mu_.Unlock();
  auto t0 = std::chrono::steady_clock::now();
  RunJob(job);
  double dt = Seconds(t0);
  mu_.Lock();
  job.finished = true;
  pending_.erase(job.seq);
  stats_.bytes_copied += job.bytes;
  stats_.copy_seconds += dt;
  done_cv_.NotifyAll();
  return dt;
}

void CopyEngine::RunJob(Job& job) {
  if (job.bytes > 0) std::memcpy(job.dst, job.src, job.bytes);
  // A fetched entry is consumed: free its host bytes here, on the worker,
  // rather than in the done on XLA's thread.
  if (job.kind == CopyKind::kFetch) job.host.Reset();
}

uint64_t CopyEngine::Submit(std::shared_ptr<Job> job) {
  MutexLock lock(&mu_);
  uint64_t ticket = next_ticket_++;
  job->seq = next_seq_++;
  tickets_.emplace(ticket, job);
  ++stats_.total_started;
  if (job->bytes == 0) {
    job->started = job->finished = true;
    if (job->kind == CopyKind::kFetch) job->host.Reset();
    return ticket;
  }
  if (desired_threads_ == 0) {
    // Inline mode: copy now, on the caller's thread.
    RunUnlocked(*job);
    return ticket;
  }
  pending_.insert(job->seq);
  queue_.push_back(std::move(job));
  EnsureWorkersLocked();
  work_cv_.NotifyOne();
  return ticket;
}

std::string CopyEngine::TicketMessageLocked(uint64_t ticket) const {
  std::string t = FormatHandle(ticket);
  if (ticket - first_ticket_ < next_ticket_ - first_ticket_) {
    return "copy ticket " + t +
           " was issued by this process but is not outstanding: its done "
           "already ran, or the tickets were cleared (a ticket can be "
           "finished once)";
  }
  return "copy ticket " + t +
         " was never issued by this process (a ticket from another process, "
         "a made-up value, or garbage)";
}

void CopyEngine::DrainLocked() {
  const uint64_t target = next_seq_;
  while (!pending_.empty() && *pending_.begin() < target) done_cv_.Wait(&mu_);
}

void CopyEngine::Drain() {
  MutexLock lock(&mu_);
  DrainLocked();
}

Status CopyEngine::Fail(Status status) {
  MutexLock lock(&mu_);
  ++stats_.total_errors;
  // XLA aborts the execution on this error and releases its buffers: let
  // every copy that may still touch them finish first.
  DrainLocked();
  return status;
}

Status CopyEngine::Claim(uint64_t ticket, CopyKind kind, const void* xla_buffer,
                         std::shared_ptr<Job>* out) {
  std::shared_ptr<Job> job;
  Status refused;  // reported by Fail, which takes mu_ itself
  {
    MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) {
      refused = InvalidArgument(TicketMessageLocked(ticket));
    } else if (it->second->kind != kind) {
      refused = InvalidArgument("copy ticket " + FormatHandle(ticket) +
                                " belongs to " + KindName(it->second->kind) +
                                "_start, not " + KindName(kind) +
                                "_start; the ticket is kept");
    } else {
      job = std::move(it->second);
      tickets_.erase(it);
      if (!job->finished && !job->started) {
        // Steal it: no worker has started it, run it on this thread now.
        for (auto q = queue_.begin(); q != queue_.end(); ++q) {
          if (q->get() == job.get()) {
            queue_.erase(q);
            break;
          }
        }
        ++stats_.stolen;
        stats_.wait_seconds += RunUnlocked(*job);
      } else if (!job->finished) {
        auto t0 = std::chrono::steady_clock::now();
        while (!job->finished) done_cv_.Wait(&mu_);
        stats_.wait_seconds += Seconds(t0);
      }
    }
  }
  if (!refused.ok()) return Fail(std::move(refused));
  const void* expected = kind == CopyKind::kOffload ? job->src : job->dst;
  if (job->bytes > 0 && xla_buffer != expected) {
    return Fail(InvalidArgument(
        "the buffer of copy ticket " + FormatHandle(ticket) +
        " moved between the start and the done (XLA copied it while "
        "the copy was in flight, e.g. because the start and the done "
        "ran in different computations); the result is refused"));
  }
  MutexLock lock(&mu_);
  ++stats_.total_finished;
  *out = std::move(job);
  return Status::Ok();
}

Status CopyEngine::StartOffload(const void* src, size_t bytes,
                                uint32_t dtype_code, uint64_t* ticket,
                                PlanSlot where) {
  if (bytes > 0 && src == nullptr) {
    return Fail(
        InvalidArgument("offload_start: source buffer is null but has " +
                        std::to_string(bytes) + " bytes"));
  }
  auto job = std::make_shared<Job>();
  job->kind = CopyKind::kOffload;
  job->bytes = bytes;
  job->dtype_code = dtype_code;
  job->src = src;
  // From the host store's arena (the same allocator as synchronous puts), so
  // the entry that FinishOffload publishes needs no second copy.
  Status st = HostStore::Global().AllocateBuffer(bytes, &job->host, where);
  if (!st.ok()) return Fail(st.Prefixed("offload_start: "));
  job->dst = job->host.data();
  *ticket = Submit(std::move(job));
  return Status::Ok();
}

Status CopyEngine::FinishOffload(uint64_t ticket, const void* src,
                                 uint64_t* handle) {
  std::shared_ptr<Job> job;
  Status st = Claim(ticket, CopyKind::kOffload, src, &job);
  if (!st.ok()) return st;
  return HostStore::Global().Insert(std::move(job->host), job->bytes,
                                    job->dtype_code, handle);
}

Status CopyEngine::StartFetch(uint64_t handle, void* dst, size_t bytes,
                              uint32_t dtype_code, uint64_t* ticket) {
  if (bytes > 0 && dst == nullptr) {
    return Fail(
        InvalidArgument("fetch_start: destination buffer is null but has " +
                        std::to_string(bytes) + " bytes"));
  }
  auto job = std::make_shared<Job>();
  job->kind = CopyKind::kFetch;
  job->bytes = bytes;
  job->dtype_code = dtype_code;
  Status st = HostStore::Global().Remove(handle, bytes, dtype_code, &job->host);
  if (!st.ok()) return Fail(st.Prefixed("fetch_start: "));
  job->src = job->host.data();
  job->dst = dst;
  *ticket = Submit(std::move(job));
  return Status::Ok();
}

Status CopyEngine::FinishFetch(uint64_t ticket, const void* dst) {
  std::shared_ptr<Job> job;
  return Claim(ticket, CopyKind::kFetch, dst, &job);
}

uint64_t CopyEngine::Clear() {
  std::unordered_map<uint64_t, std::shared_ptr<Job>> doomed;
  uint64_t freed = 0;
  {
    MutexLock lock(&mu_);
    DrainLocked();
    doomed.swap(tickets_);
    for (const auto& [ticket, job] : doomed) freed += job->host.bytes();
  }
  return freed;  // `doomed` frees the host buffers outside the lock.
}

CopyEngineStats CopyEngine::Stats() const {
  MutexLock lock(&mu_);
  CopyEngineStats s = stats_;
  s.cpus = cpus_;
  s.outstanding = tickets_.size();
  s.in_flight = pending_.size();
  return s;
}

}  // namespace jaxmem
