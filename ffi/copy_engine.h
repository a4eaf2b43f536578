// Copyright 2025 The jaxmem Authors.
//
// The CPU asynchronous copy engine behind jaxmem's window-scheduled copies
// (docs/design.md, "Native extension"; Hayakawa & Narihira, *Out-of-core
// training for extremely large-scale neural networks with adaptive
// window-based scheduling*, §3).
//
//   offload_start(x)  -> ticket        enqueue x -> new host buffer, return
//   offload_done(x, ticket, dep)       wait for it, publish it in the host
//                      -> handle        store, return the store handle
//   fetch_start(handle, dep)           take the entry out of the store and
//                      -> (buf, ticket) enqueue host buffer -> buf, return
//   fetch_done(buf, ticket, dep) -> buf wait for it
//
// The copies run on worker threads owned by the engine, so XLA keeps
// computing between a start and its done; the planner decides how far apart
// they are (the window). XLA knows nothing of the worker: that the done reads
// the buffer (x, or the fetch destination buf) is what keeps it allocated, and
// unwritten by anything else, until then; the done refuses a buffer whose
// address changed in between (XLA copied it: the worker used the old one).
//
// A done whose copy no worker has started yet runs it itself ("steals" it):
// with every core busy computing, waiting for a worker to be scheduled would
// cost more than the copy. A done therefore never waits longer than its copy
// takes, and asynchronous copies cost at most what synchronous ones do plus
// the bookkeeping.
//
// Tickets are 64-bit ids from a never-reused counter that starts at a random
// value, like host store handles: a done with a stale (already finished),
// foreign or made-up ticket, or a ticket of the other kind, is an
// InvalidArgument status (status.h), never a crash or a wait on the wrong
// copy.
//
// Errors and aborted executions. A failing start or done first drains the
// engine (waits until every copy queued so far has finished) and only then
// returns its error: XLA frees an aborted execution's buffers when it sees
// the error, and no worker is still reading or writing them by then. A start
// whose done never runs (its execution failed elsewhere) leaves a finished,
// unclaimed ticket that holds its host buffer: `Stats().outstanding` counts
// them and `Clear()` (Python: `jaxmem.native.store_clear()`) frees them. An
// execution aborted by an op that is not ours (a failing host callback
// between a start and its done) is not drained: that copy may still read the
// source after XLA released it (only the unclaimed host copy is affected).

#ifndef JAXMEM_FFI_COPY_ENGINE_H_
#define JAXMEM_FFI_COPY_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "host_store.h"
#include "mutex.h"
#include "status.h"
#include "thread_annotations.h"

namespace jaxmem {

enum class CopyKind : uint8_t { kOffload = 0, kFetch = 1 };

// A snapshot of the engine's counters.
struct CopyEngineStats {
  uint64_t threads = 0;         // worker threads (0: copies run inline)
  std::vector<int> cpus;        // CPUs the workers are pinned to (empty: any)
  uint64_t outstanding = 0;     // tickets issued and not yet finished by a done
  uint64_t in_flight = 0;       // copies queued or running
  uint64_t total_started = 0;   // successful starts
  uint64_t total_finished = 0;  // successful dones
  uint64_t total_errors = 0;    // failed starts/dones
  uint64_t stolen = 0;          // copies a done ran itself (no worker got to it)
  uint64_t bytes_copied = 0;    // payload bytes moved by workers
  double copy_seconds = 0;      // time workers spent copying
  double wait_seconds = 0;      // time dones spent blocked on a copy
};

class CopyEngine {
 public:
  // The process-wide engine used by the FFI handlers (leaked on purpose, like
  // the host store: executables may run handlers during interpreter exit).
  static CopyEngine& Global();

  CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Enqueues a copy of `bytes` bytes at `src` into a new host buffer. `src`
  // must stay valid and unmodified until `FinishOffload`. Writes the ticket
  // to `*ticket`; fails like `HostStore::AllocateBuffer`, which takes the
  // host buffer from `where`'s planned slot when there is one.
  Status StartOffload(const void* src, size_t bytes, uint32_t dtype_code,
                      uint64_t* ticket, PlanSlot where = {}) EXCLUDES(mu_);

  // Waits for the offload `ticket` (started from `src`), publishes the host
  // copy in the host store and writes its handle to `*handle`.
  Status FinishOffload(uint64_t ticket, const void* src, uint64_t* handle)
      EXCLUDES(mu_);

  // Takes entry `handle` out of the host store (validating size and dtype)
  // and enqueues a copy of it to `dst`, which must stay allocated until
  // `FinishFetch`.
  Status StartFetch(uint64_t handle, void* dst, size_t bytes,
                    uint32_t dtype_code, uint64_t* ticket) EXCLUDES(mu_);

  // Waits for the fetch `ticket` into `dst`.
  Status FinishFetch(uint64_t ticket, const void* dst) EXCLUDES(mu_);

  // Blocks until every copy queued before the call has finished.
  void Drain() EXCLUDES(mu_);

  // Drains, then drops every ticket (finished or not claimed); returns the
  // host bytes freed. Tickets issued before become stale.
  uint64_t Clear() EXCLUDES(mu_);

  // Number of worker threads; 0 runs each copy inline in its start (the
  // asynchronous ops then cost what the synchronous ones do). Default 1, or
  // $JAXMEM_COPY_THREADS.
  void SetThreads(int n) EXCLUDES(mu_);

  // CPUs the workers may run on (Linux; empty: inherit the process's mask).
  // Default: $JAXMEM_COPY_CPUS, a comma-separated list such as "1" or "2,3".
  // A worker may be given CPUs outside the process's own affinity mask (any
  // CPU of its cpuset): XLA:CPU sizes its compute pool from that mask, so
  // `taskset -c 0 python ...` with JAXMEM_COPY_CPUS=1 gives compute one core
  // and the copies another, as a GPU's copy engines are separate hardware.
  // InvalidArgument for a CPU the system refuses. Applies to workers started
  // afterwards (it restarts running ones).
  Status SetCpus(const std::vector<int>& cpus) EXCLUDES(mu_);

  CopyEngineStats Stats() const EXCLUDES(mu_);

 private:
  struct Job {
    CopyKind kind = CopyKind::kOffload;
    const void* src = nullptr;  // offload: XLA's buffer; fetch: host.data()
    void* dst = nullptr;        // offload: host.data(); fetch: XLA's buffer
    size_t bytes = 0;
    uint32_t dtype_code = 0;
    HostBuffer host;
    uint64_t seq = 0;
    // Guarded by CopyEngine::mu_ (not expressible as GUARDED_BY: a Job does
    // not know its engine).
    bool started = false;  // a worker (or a stealing done) took it
    bool finished = false;
  };

  // Registers `job` under a new ticket and queues it (or runs it inline).
  uint64_t Submit(std::shared_ptr<Job> job) EXCLUDES(mu_);
  // Removes `ticket` of `kind` from the registry and waits for its copy.
  Status Claim(uint64_t ticket, CopyKind kind, const void* xla_buffer,
               std::shared_ptr<Job>* job) EXCLUDES(mu_);
  void RunJob(Job& job) EXCLUDES(mu_);  // the copy itself; no lock held
  // Marks `job` started, runs it with mu_ released (held again on return),
  // then records it as finished in the stats and wakes waiters. Returns the
  // copy's seconds.
  double RunUnlocked(Job& job) REQUIRES(mu_);
  void WorkerLoop(uint64_t generation) EXCLUDES(mu_);
  void EnsureWorkersLocked() REQUIRES(mu_);
  // Waits until every copy queued before the call has finished.
  void DrainLocked() REQUIRES(mu_);
  std::string TicketMessageLocked(uint64_t ticket) const REQUIRES(mu_);
  // Drains, counts the error, returns `status`.
  Status Fail(Status status) EXCLUDES(mu_);

  mutable Mutex mu_;
  CondVar work_cv_;  // a job was queued / threads changed
  CondVar done_cv_;  // a job finished
  std::unordered_map<uint64_t, std::shared_ptr<Job>> tickets_ GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Job>> queue_ GUARDED_BY(mu_);
  std::set<uint64_t> pending_ GUARDED_BY(mu_);  // seq of queued/running jobs
  uint64_t next_seq_ GUARDED_BY(mu_) = 0;
  const uint64_t first_ticket_;
  uint64_t next_ticket_ GUARDED_BY(mu_);
  int desired_threads_ GUARDED_BY(mu_) = 1;
  int running_threads_ GUARDED_BY(mu_) = 0;
  std::vector<int> cpus_ GUARDED_BY(mu_);
  // Bumped by SetCpus: older workers retire.
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  CopyEngineStats stats_ GUARDED_BY(mu_);
};

}  // namespace jaxmem

#endif  // JAXMEM_FFI_COPY_ENGINE_H_
