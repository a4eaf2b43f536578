// Copyright 2025 The jaxmem Authors.
//
// The lifetime estimate's XLA model (jaxmem/_src/estimate/lifetimes.py,
// `_lifetimes`) in C++: which values XLA fuses away and how long each stored
// value lives, for a flow whose common subexpressions are already merged.
// The Python function is the reference; tests/estimate/test_native_lifetimes.py
// checks that both give the same lifetimes for every flow of the test models
// and of random programs. A planner estimates hundreds of schedules per plan
// (ResNet-50: 6,000 steps each), which is why the rule set exists twice.

#ifndef JAXMEM_FFI_LIFETIMES_H_
#define JAXMEM_FFI_LIFETIMES_H_

#include <array>
#include <cstdint>
#include <vector>

namespace jaxmem::lifetimes {

// `Fusion` (jaxmem/_src/ir/primitives.py) as the Python side encodes it.
enum Kind : int8_t {
  kCheap = 0,
  kExpensive = 1,
  kView = 2,
  kReduce = 3,
  kMaterialized = 4,
};

// xla_model.INDEX_* and FUSES_*.
constexpr int kIndexSame = 0;
constexpr int kIndexNew = 1;
constexpr int kIndexBranches = 2;
constexpr int kIndexBroadcast = 3;
constexpr int kFusesAny = 1;
constexpr int kFusesSole = 2;

// A per-step list of ints (step inputs, outputs) in compressed rows:
// row s is idx[ptr[s] .. ptr[s + 1]).
struct Rows {
  std::vector<int64_t> ptr;
  std::vector<int64_t> idx;
  int64_t size(int64_t s) const { return ptr[s + 1] - ptr[s]; }
  const int64_t* begin(int64_t s) const { return idx.data() + ptr[s]; }
  const int64_t* end(int64_t s) const { return idx.data() + ptr[s + 1]; }
};

// The flow (`Flow`) after `merge_common_subexpressions`. Optional per-step
// columns are empty where the Python flow has none.
struct Flow {
  int64_t num_steps = 0;
  std::vector<int8_t> kind;             // per step
  Rows inputs, outputs;                 // per step
  std::vector<int64_t> start, end;      // per value: step index or -1
  std::vector<int64_t> nbytes;          // per value
  std::vector<uint8_t> materialized;    // per value
  std::vector<int64_t> hoist_to_start;  // values
  std::vector<uint8_t> merged;          // per value: merged away by CSE
  std::vector<uint8_t> movable;         // per step, or empty
  std::vector<int8_t> fuses_operands;   // per step, or empty
  std::vector<uint8_t> epilogues;       // per step, or empty
  std::vector<int8_t> indexing;         // per step, or empty (no limit)
  std::vector<int64_t> in_place;        // per step, or empty
  // `forwarded`: value -> the values it forwards (rows indexed by value;
  // empty when the flow has none).
  Rows forwarded;
  std::vector<uint8_t> has_forwarded;   // per value, or empty
  // `early_copies`: per step, (value, bytes, layout) triples flattened;
  // `shared_reads`: per step, (value, bytes) pairs flattened; empty when no
  // step has any.
  Rows early_copies, shared_reads;
};

struct Result {
  std::vector<int64_t> pos;                           // per step, and the exit
  std::vector<int64_t> start, end;                    // per value
  std::vector<uint8_t> is_virtual;                    // per value
  std::vector<std::array<int64_t, 3>> copy_last;      // (value, bytes, last)
  std::vector<std::array<int64_t, 4>> stored_broadcasts;  // (value, bytes, first, last)
};

// `_lifetimes`. Throws std::invalid_argument on a malformed flow (an index
// out of range, columns of the wrong length).
Result Estimate(const Flow& flow);

}  // namespace jaxmem::lifetimes

#endif  // JAXMEM_FFI_LIFETIMES_H_
