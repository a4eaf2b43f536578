// Copyright 2025 The jaxmem Authors.
//
// Offline Dynamic Storage Allocation (DSA): given buffers with lifetimes
// [lower, upper) (half-open, in any integer time unit) and sizes, choose a byte
// offset for each so that no two buffers that are live at the same time
// overlap in memory, minimising the footprint max(offset + size).
//
// The problem is NP-hard (Stockmeyer; Zhang et al., *Efficient Memory
// Management for GPU-based Deep Learning Systems* (SmartPool), §III-A). A lower bound on any
// footprint is the max load: the maximum over time of the summed sizes of the
// live buffers. This file provides
//
//   * `Greedy`   -- SmartPool's heuristic (its §III-C): buffers by
//                   decreasing size, each into the best (or first) fitting hole
//                   left by the already placed buffers that overlap it in time;
//   * `Pack`     -- MiniMalloc's decision search (dsa_pack.cc): a placement
//                   within a given capacity, or a proof that none exists;
//   * `Exact`    -- `Pack` at the capacity asked for and at the max load
//                   (a placement there is optimal), then
//                   a branch-and-bound over canonical placements (each buffer
//                   at offset 0 or on the top of an already placed buffer that
//                   overlaps it in time, placed bottom-up) with cross-section
//                   lower bounds and a dominance rule, seeded with `Greedy`
//                   and restarted round-robin over four branching orders with
//                   doubling node limits; it proves optimality when a search
//                   finishes and returns the best solution found when its
//                   time or node limit runs out;
//   * `Check`    -- validates a solution (no two simultaneously live buffers
//                   overlap) and returns its footprint;
//   * `MaxLoad`  -- the lower bound above.
//
// Nothing here depends on XLA or Python; the nanobind bindings live in
// bindings/dsa_bindings.cc.

#ifndef JAXMEM_FFI_DSA_H_
#define JAXMEM_FFI_DSA_H_

#include <cstdint>
#include <string>
#include <vector>

namespace jaxmem {
namespace dsa {

// One problem instance. All three vectors have one entry per buffer.
struct Problem {
  std::vector<int64_t> lower;  // first time step the buffer is live
  std::vector<int64_t> upper;  // first time step it is no longer live
  std::vector<int64_t> size;   // bytes (0 is allowed: such a buffer is put at 0)
};

// How `Greedy` picks among the holes a buffer fits in (SmartPool, Fig. 4).
enum class Fit {
  kBest,   // the smallest hole that fits (SmartPool's default)
  kFirst,  // the lowest hole that fits
};

struct Options {
  // Wall-clock budget of the exact search, in seconds; infinity or NaN for no
  // limit. The greedy seeds always run to completion.
  double time_limit_s = 1.0;
  // Maximum number of search nodes (placements tried); 0 for no limit.
  int64_t node_limit = 0;
  // Memory available, in bytes; -1 for none. When the max load already
  // exceeds it no solution can fit and `Solve` skips the exact search.
  // Otherwise the exact search first looks for a placement within it.
  int64_t capacity = -1;
  // With a capacity: stop at the first placement within it instead of
  // minimising the footprint further.
  bool stop_at_capacity = false;
};

struct Result {
  std::vector<int64_t> offsets;  // one per buffer, in input order
  int64_t footprint = 0;         // max(offset + size), 0 for no buffers
  int64_t max_load = 0;          // the lower bound (max summed live size)
  int64_t lower_bound = 0;       // footprint if proven optimal, else the
                                 // max load or a capacity proven too small
  bool proven_optimal = false;   // footprint is the optimum
  bool timed_out = false;        // the exact search hit its time/node limit
  int64_t nodes = 0;             // search nodes visited (0 for the heuristics)
  double seconds = 0.0;          // wall-clock time of the whole solve
  std::string method;            // algorithm that produced `offsets`:
                                 // "best-fit", "first-fit", "pack" (the
                                 // decision search) or "exact" (the
                                 // branch-and-bound)
  bool feasible = true;          // capacity < 0 or footprint <= capacity
};

// Outcome of `Check`.
struct CheckResult {
  bool valid = true;
  int64_t first = -1;   // indices of the first conflicting pair found, or the
  int64_t second = -1;  // offending buffer in `first` (second = -1)
  int64_t footprint = 0;
  std::string reason;   // empty when valid
};

// Throws std::invalid_argument naming the offending buffer when the vectors
// differ in length, an interval is empty (lower >= upper), a size is negative,
// or the sizes sum to more than 2**62.
void Validate(const Problem& p);

// Max over time of the summed sizes of the live buffers (a lower bound on the
// footprint of every valid solution). Assumes a validated problem.
int64_t MaxLoad(const Problem& p);

// SmartPool (§III-C). Validates `p`.
Result Greedy(const Problem& p, Fit fit);

// Seeded with the better of best-fit and first-fit (so never worse than
// either): `Pack` at `options.capacity` when given (and the seeds do not fit
// it), then `Pack` at the max load and in a bisection on the capacity, each
// probe with a third of the time left while more than a quarter of the limit
// remains, then the branch-and-bound from the best placement for the rest.
// Validates `p`. The seeds always run to the end (O(n^2 log n));
// `options.time_limit_s` counts from the start of the call.
Result Exact(const Problem& p, const Options& options);

// Dispatches on `method`: "best-fit", "first-fit", "exact" or "auto" (the
// exact search, which starts from the greedy solutions and so is never worse
// than them). Sets `feasible` from `options.capacity`. Throws
// std::invalid_argument for an unknown method or a bad problem.
Result Solve(const Problem& p, const std::string& method,
             const Options& options);

// Outcome of `Pack`.
enum class PackStatus {
  kFound,       // `offsets` fit in the capacity
  kInfeasible,  // proven: no placement fits in the capacity
  kLimit,       // the time or node limit ran out (or the instance is too
                // large for the search) before either was shown
};

struct PackResult {
  PackStatus status = PackStatus::kLimit;
  std::vector<int64_t> offsets;  // one per buffer when found, else empty
  int64_t nodes = 0;
  double seconds = 0.0;
};

// Does the instance fit in `capacity` bytes? MiniMalloc's decision search
// (Moffitt, ASPLOS 2023; see dsa_pack.cc): canonical bottom-up placements,
// cross-section inference, dominance, dynamic temporal decomposition and
// round-robin static preorderings. `time_limit_s`: infinity for no limit;
// `node_limit`: 0 for none. Validates `p`; throws std::invalid_argument for a
// negative capacity.
PackResult Pack(const Problem& p, int64_t capacity, double time_limit_s,
                int64_t node_limit);

// Validates `offsets` (same length, non-negative, no two buffers that share a
// time step share a byte) in O(n log n). Throws like `Validate` on a bad
// problem.
CheckResult Check(const Problem& p, const std::vector<int64_t>& offsets);

}  // namespace dsa
}  // namespace jaxmem

#endif  // JAXMEM_FFI_DSA_H_
