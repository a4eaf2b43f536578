// Copyright 2025 The jaxmem Authors.
//
// Offline DSA solver (see dsa.h); its Python bindings are in
// bindings/dsa_bindings.cc.

#include "dsa.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace jaxmem {
namespace dsa {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Indices of the buffers with a non-zero size, largest first. Ties: longer
// lifetime first, then earlier start, then input order, so that results are
// deterministic. This is both the greedy order of SmartPool (Zhang et al.,
// *Efficient Memory Management for GPU-based Deep Learning Systems*, §III-C)
// and the rank used to break symmetries in the exact search.
std::vector<int> DecreasingSizeOrder(const Problem& p) {
  std::vector<int> order;
  order.reserve(p.size.size());
  for (size_t i = 0; i < p.size.size(); ++i) {
    if (p.size[i] > 0) order.push_back(static_cast<int>(i));
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (p.size[a] != p.size[b]) return p.size[a] > p.size[b];
    const int64_t la = p.upper[a] - p.lower[a], lb = p.upper[b] - p.lower[b];
    if (la != lb) return la > lb;
    if (p.lower[a] != p.lower[b]) return p.lower[a] < p.lower[b];
    return a < b;
  });
  return order;
}

bool Overlap(const Problem& p, int a, int b) {
  return p.lower[a] < p.upper[b] && p.lower[b] < p.upper[a];
}

int64_t FootprintOf(const Problem& p, const std::vector<int64_t>& offsets) {
  int64_t top = 0;
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (p.size[i] > 0) top = std::max(top, offsets[i] + p.size[i]);
  }
  return top;
}

// Fills the bound fields of a finished result.
void Finish(Result* r, int64_t max_load, bool proven, Clock::time_point t0) {
  r->max_load = max_load;
  // Reaching the max load proves optimality whatever produced the solution.
  r->proven_optimal = proven || r->footprint == max_load;
  r->lower_bound = r->proven_optimal ? r->footprint : max_load;
  r->seconds = SecondsSince(t0);
}

// -- Exact search --------------------------------------------------------------

// Branch orderings of the exact search (static "preorders"): the rank used to
// break ties between candidates and between equal offsets. Different orders
// lead the depth-first search to different regions; they are run round-robin
// with growing node limits (restarts) so that one unlucky order does not eat
// the whole time budget.
enum class Preorder { kSize, kArea, kLength, kStart };
constexpr Preorder kPreorders[] = {Preorder::kSize, Preorder::kArea,
                                   Preorder::kLength, Preorder::kStart};

std::vector<int> PreorderOf(const Problem& p, Preorder how) {
  std::vector<int> order = DecreasingSizeOrder(p);  // ties as in the greedy
  auto len = [&](int i) { return p.upper[i] - p.lower[i]; };
  auto area = [&](int i) {
    return static_cast<long double>(p.size[i]) * static_cast<long double>(len(i));
  };
  switch (how) {
    case Preorder::kSize:
      break;
    case Preorder::kArea:
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return area(a) > area(b); });
      break;
    case Preorder::kLength:
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return len(a) > len(b); });
      break;
    case Preorder::kStart:
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return p.lower[a] < p.lower[b];
      });
      break;
  }
  return order;
}

// Above this many buffers the exact search skips Search::FloorBound.
constexpr int kFloorBoundMaxBuffers = 2000;

// The best solution known, shared by the searches of all preorders.
struct Incumbent {
  int64_t footprint = 0;
  std::vector<int64_t> offsets;
  bool improved = false;  // found by the search (not a greedy seed)
};

enum class Outcome {
  kExhausted,  // the whole tree was searched: the incumbent is optimal
  kOptimal,    // the incumbent reached the lower bound
  kNodeLimit,  // this run's node limit was hit
  kTimeOut,    // the time limit or the global node limit was hit
};

// Exact search. Canonical solutions: push every buffer of a valid solution
// down as far as it goes ("gravity"); the footprint does not grow, and every
// buffer then rests at offset 0 or on the top of a buffer that overlaps it in
// time. Sort the buffers by (offset, rank). Two time-overlapping buffers a
// below b satisfy top(a) <= offset(b), so when b's turn comes every buffer it
// rests on has been placed and offset(b) = lo(b) := max(0, tops of the placed
// buffers that overlap b). So an optimal solution is reached by choosing, at
// each node, the next buffer b and putting it at lo(b), with offsets visited
// in non-decreasing order: lo(b) > F, or lo(b) == F and rank(b) > rank(last),
// where F and `last` are the offset and the buffer of the previous placement
// (buffers at equal offsets never overlap in time, so ordering them by rank
// loses nothing and removes the permutations of each such group).
//
// Bounds, over elementary time sections t (between consecutive distinct
// endpoints): H(t) = highest top of the placed buffers live at t, R(t) = summed
// size of the unplaced buffers live at t. Every unplaced buffer live at t will
// sit at or above max(F, H(t)) (above F by the ordering, above H(t) because it
// overlaps every placed buffer live at t), disjoint from the others, so
//   footprint >= max_t [R(t) > 0 ? max(F, H(t)) + R(t) : H(t)]
// (the cross-section bound; at the root it is the max load). A node is pruned
// when this reaches the incumbent. A buffer that cannot be placed next
// (lo(b) below the ordering) must later be lifted by a time-overlapping buffer
// placed after it; if no unplaced buffer overlaps it the node is a dead end.
// Plus one dominance rule (see Candidates) and sharper section floors (see
// FloorBound). The project papers give only the greedy (SmartPool §III-C);
// canonical bottom-up placement, this dominance rule, section floors and
// round-robin restarts are the ideas of MiniMalloc (M. D. Moffitt, ASPLOS
// 2023), reimplemented here for minimising the footprint rather than for
// feasibility under a fixed capacity.
class Search {
 public:
  Search(const Problem& p, Preorder preorder) : p_(p) {
    order_ = PreorderOf(p, preorder);
    m_ = static_cast<int>(order_.size());
    // Work in rank space: buffer k is order_[k] (so rank(k) == k).
    std::vector<int64_t> coords;
    coords.reserve(2 * m_);
    for (int id : order_) {
      coords.push_back(p_.lower[id]);
      coords.push_back(p_.upper[id]);
    }
    std::sort(coords.begin(), coords.end());
    coords.erase(std::unique(coords.begin(), coords.end()), coords.end());
    const int nsec = coords.empty() ? 0 : static_cast<int>(coords.size()) - 1;
    auto index = [&](int64_t x) {
      return static_cast<int>(
          std::lower_bound(coords.begin(), coords.end(), x) - coords.begin());
    };
    sl_.resize(m_);
    su_.resize(m_);
    sz_.resize(m_);
    for (int k = 0; k < m_; ++k) {
      sl_[k] = index(p_.lower[order_[k]]);
      su_[k] = index(p_.upper[order_[k]]);
      sz_[k] = p_.size[order_[k]];
    }
    h_.assign(nsec, 0);
    r_.assign(nsec, 0);
    for (int k = 0; k < m_; ++k) {
      for (int t = sl_[k]; t < su_[k]; ++t) r_[t] += sz_[k];
    }
    lo_.assign(m_, 0);
    off_.assign(m_, 0);
    placed_.assign(m_, 0);
    ends_before_.assign(nsec + 2, 0);
    starts_after_.assign(nsec + 2, 0);
    // A node costs O(m + T): read the clock about every 2**18 such steps.
    check_every_ = std::clamp<int64_t>((int64_t{1} << 18) / (m_ + nsec + 1), 1, 256);
  }

  // Depth-first branch-and-bound from the root, improving `inc`. Stops after
  // `run_nodes` nodes (0: no limit), at the deadline, or when `*total_nodes`
  // reaches `total_limit` (0: no limit). The state is restored on return.
  Outcome Run(Incumbent* inc, int64_t max_load, int64_t run_nodes,
              Clock::time_point deadline, bool has_deadline,
              int64_t* total_nodes, int64_t total_limit) {
    inc_ = inc;
    Outcome out = Dfs(max_load, run_nodes, deadline, has_deadline, total_nodes,
                      total_limit);
    // Unwind whatever the early exit left placed.
    while (!stack_.empty()) {
      if (stack_.back().placed >= 0) Unplace(stack_.back().placed, stack_.back());
      stack_.pop_back();
    }
    cands_.clear();
    return out;
  }

 private:
  struct Frame {
    size_t cbegin, cend, cnext;  // this node's candidates in cands_
    int placed = -1;             // buffer placed by the current branch
    size_t lo_mark = 0, h_mark = 0;
    int64_t prev_f = 0, prev_foot = 0;
    int prev_last = -1;
  };

  void Place(int a, Frame* f) {
    const int64_t off = lo_[a];
    const int64_t top = off + sz_[a];
    f->lo_mark = lo_log_.size();
    f->h_mark = h_log_.size();
    f->prev_f = f_;
    f->prev_last = last_;
    f->prev_foot = foot_;
    for (int b = 0; b < m_; ++b) {
      if (placed_[b] || b == a) continue;
      if (sl_[a] < su_[b] && sl_[b] < su_[a] && lo_[b] < top) {
        lo_log_.emplace_back(b, lo_[b]);
        lo_[b] = top;
      }
    }
    for (int t = sl_[a]; t < su_[a]; ++t) {
      h_log_.emplace_back(t, h_[t]);
      h_[t] = top;  // off = lo(a) >= h_[t], so this only raises h_
      r_[t] -= sz_[a];
    }
    off_[a] = off;
    placed_[a] = 1;
    ++num_placed_;
    f_ = off;
    last_ = a;
    foot_ = std::max(foot_, top);
  }

  void Unplace(int a, const Frame& f) {
    for (int t = sl_[a]; t < su_[a]; ++t) r_[t] += sz_[a];
    while (h_log_.size() > f.h_mark) {
      h_[h_log_.back().first] = h_log_.back().second;
      h_log_.pop_back();
    }
    while (lo_log_.size() > f.lo_mark) {
      lo_[lo_log_.back().first] = lo_log_.back().second;
      lo_log_.pop_back();
    }
    placed_[a] = 0;
    --num_placed_;
    f_ = f.prev_f;
    last_ = f.prev_last;
    foot_ = f.prev_foot;
  }

  // The cross-section bound of the current node.
  int64_t Bound() const {
    int64_t lb = foot_;
    for (size_t t = 0; t < h_.size(); ++t) {
      const int64_t v = r_[t] > 0 ? std::max(f_, h_[t]) + r_[t] : h_[t];
      lb = std::max(lb, v);
    }
    return lb;
  }

  // A sharper cross-section bound: the unplaced buffers live at t sit at or
  // above the lowest lo() among them, which can exceed H(t) (a gap the
  // placed buffers left in section t that none of them can use). Sections are
  // given that floor in increasing order of lo(), each section once (a
  // "next unpainted section" union-find); O(m log m + T) per node, so it is
  // used only up to kFloorBoundMaxBuffers buffers: beyond that a node costs
  // several times more than the pruning saves (measured on random instances:
  // 5000 buffers, 30x fewer nodes per second and no better solutions).
  int64_t FloorBound() {
    by_lo_.clear();
    for (int b = 0; b < m_; ++b) {
      if (!placed_[b]) by_lo_.emplace_back(lo_[b], b);
    }
    std::sort(by_lo_.begin(), by_lo_.end());
    const int nsec = static_cast<int>(h_.size());
    next_.resize(nsec + 1);
    std::iota(next_.begin(), next_.end(), 0);
    auto find = [&](int x) {
      while (next_[x] != x) {
        next_[x] = next_[next_[x]];
        x = next_[x];
      }
      return x;
    };
    int64_t lb = 0;
    for (const auto& [lo, b] : by_lo_) {
      for (int t = find(sl_[b]); t < su_[b]; t = find(t + 1)) {
        lb = std::max(lb, std::max(f_, lo) + r_[t]);
        next_[t] = t + 1;
      }
    }
    return lb;
  }

  // Appends the buffers that may be placed next to cands_, best first.
  // Returns false when the node cannot lead to a solution better than the
  // incumbent.
  bool Candidates() {
    // Counts of unplaced buffers ending at or before / starting at or after
    // each section boundary, to test "does any other unplaced buffer overlap
    // b" in O(1).
    const int nb = static_cast<int>(ends_before_.size());
    std::fill(ends_before_.begin(), ends_before_.end(), 0);
    std::fill(starts_after_.begin(), starts_after_.end(), 0);
    int unplaced = 0;
    for (int b = 0; b < m_; ++b) {
      if (placed_[b]) continue;
      ++unplaced;
      ++ends_before_[su_[b]];
      ++starts_after_[sl_[b]];
    }
    for (int x = 1; x < nb; ++x) ends_before_[x] += ends_before_[x - 1];
    for (int x = nb - 2; x >= 0; --x) starts_after_[x] += starts_after_[x + 1];
    const size_t begin = cands_.size();
    int64_t min_top = std::numeric_limits<int64_t>::max();
    for (int b = 0; b < m_; ++b) {
      if (placed_[b]) continue;
      const int64_t top = lo_[b] + sz_[b];
      if (top >= inc_->footprint) return false;  // lo only grows
      min_top = std::min(min_top, top);
      if (lo_[b] > f_ || (lo_[b] == f_ && b > last_)) {
        cands_.push_back(b);
        continue;
      }
      // b must be lifted by a later, time-overlapping placement.
      const int others = unplaced - ends_before_[sl_[b]] -
                         starts_after_[su_[b]] - 1;  // minus b itself
      if (others <= 0) return false;
    }
    // Dominance: placing anything at x >= lo(c) + size(c) for an unplaced c
    // leaves c's lowest slot [lo(c), lo(c) + size(c)) empty below every later
    // placement, so c could be moved down into it (smaller sum of offsets, no
    // larger footprint). Solutions with minimal sum of offsets never do this,
    // and one of them is optimal, so such branches are skipped.
    if (min_top <= f_) return false;
    cands_.erase(std::remove_if(cands_.begin() + begin, cands_.end(),
                                [&](int b) { return lo_[b] >= min_top; }),
                 cands_.end());
    // Lowest first (bottom-up, like a skyline packing), then by rank.
    std::sort(cands_.begin() + begin, cands_.end(), [&](int a, int b) {
      if (lo_[a] != lo_[b]) return lo_[a] < lo_[b];
      return a < b;
    });
    return cands_.size() > begin;
  }

  // Depth-first search with an explicit stack (depth = #buffers).
  Outcome Dfs(int64_t max_load, int64_t run_nodes, Clock::time_point deadline,
              bool has_deadline, int64_t* total_nodes, int64_t total_limit) {
    int64_t nodes = 0;
    stack_.reserve(m_ + 1);
    if (!Candidates()) return Outcome::kExhausted;
    stack_.push_back(Frame{0, cands_.size(), 0});
    while (!stack_.empty()) {
      Frame& f = stack_.back();
      if (f.placed >= 0) {
        Unplace(f.placed, f);
        f.placed = -1;
      }
      if (f.cnext == f.cend) {
        cands_.resize(f.cbegin);
        stack_.pop_back();
        continue;
      }
      const int a = cands_[f.cnext++];
      // The incumbent may have improved since the candidates were listed.
      if (lo_[a] + sz_[a] >= inc_->footprint) continue;
      Place(a, &f);
      f.placed = a;
      ++nodes;
      ++*total_nodes;
      if (run_nodes > 0 && nodes >= run_nodes) return Outcome::kNodeLimit;
      if (total_limit > 0 && *total_nodes >= total_limit) return Outcome::kTimeOut;
      if (nodes % check_every_ == 0 && has_deadline && Clock::now() >= deadline) {
        return Outcome::kTimeOut;
      }
      if (num_placed_ == m_) {
        if (foot_ < inc_->footprint) {
          inc_->footprint = foot_;
          for (int k = 0; k < m_; ++k) inc_->offsets[order_[k]] = off_[k];
          inc_->improved = true;
          if (foot_ <= max_load) return Outcome::kOptimal;
        }
        continue;
      }
      if (Bound() >= inc_->footprint) continue;
      const size_t begin = cands_.size();
      if (!Candidates() || (m_ <= kFloorBoundMaxBuffers &&
                            FloorBound() >= inc_->footprint)) {
        cands_.resize(begin);
        continue;
      }
      stack_.push_back(Frame{begin, cands_.size(), begin});
    }
    return Outcome::kExhausted;
  }

  const Problem& p_;
  Incumbent* inc_ = nullptr;
  std::vector<int> order_;
  int m_ = 0;
  std::vector<int> sl_, su_;
  std::vector<int64_t> sz_;
  std::vector<int64_t> h_, r_, lo_;
  std::vector<int64_t> off_;  // offset of each placed buffer
  std::vector<char> placed_;
  std::vector<int> ends_before_, starts_after_;
  std::vector<std::pair<int, int64_t>> lo_log_, h_log_;
  std::vector<int> cands_;
  std::vector<Frame> stack_;
  std::vector<std::pair<int64_t, int>> by_lo_;  // FloorBound scratch
  std::vector<int> next_;                       // FloorBound scratch
  int num_placed_ = 0;
  int64_t f_ = 0, foot_ = 0;
  int last_ = -1;
  int64_t check_every_ = 256;
};

// Runs the searches of all preorders round-robin, each restarted from the
// root with a node limit that doubles every round, until one exhausts its
// tree (a proof), the incumbent reaches the max load (a proof), or time runs
// out. Returns true when proven; fills nodes/timed_out of `r`.
bool RoundRobin(const Problem& p, const Options& options, Clock::time_point t0,
                int64_t max_load, Result* r) {
  Incumbent inc{r->footprint, r->offsets, false};
  const bool has_deadline = std::isfinite(options.time_limit_s);
  const Clock::time_point deadline =
      has_deadline ? t0 + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(
                                  std::min(options.time_limit_s, 1e9)))
                   : t0;
  std::vector<Search> searches;
  for (Preorder how : kPreorders) searches.emplace_back(p, how);
  int64_t total = 0;
  int64_t limit = std::max<int64_t>(1024, 4 * static_cast<int64_t>(r->offsets.size()));
  Outcome out = has_deadline && Clock::now() >= deadline ? Outcome::kTimeOut
                                                         : Outcome::kNodeLimit;
  while (out == Outcome::kNodeLimit) {
    for (Search& s : searches) {
      out = s.Run(&inc, max_load, limit, deadline, has_deadline, &total,
                  options.node_limit);
      if (out != Outcome::kNodeLimit) break;
      if (has_deadline && Clock::now() >= deadline) {
        out = Outcome::kTimeOut;
        break;
      }
    }
    limit = limit > std::numeric_limits<int64_t>::max() / 2 ? 0 : 2 * limit;
  }
  r->nodes += total;
  if (inc.improved) {
    r->offsets = std::move(inc.offsets);
    r->footprint = inc.footprint;
    r->method = "exact";
  }
  r->timed_out = out == Outcome::kTimeOut;
  return out == Outcome::kExhausted || out == Outcome::kOptimal;
}

}  // namespace

// Largest supported sum of all sizes (see Validate).
constexpr int64_t kMaxTotalSize = int64_t{1} << 62;

void Validate(const Problem& p) {
  const size_t n = p.lower.size();
  if (p.upper.size() != n || p.size.size() != n) {
    throw std::invalid_argument(
        "lower, upper and size must have the same length (got " +
        std::to_string(n) + ", " + std::to_string(p.upper.size()) + ", " +
        std::to_string(p.size.size()) + ")");
  }
  if (n > static_cast<size_t>(std::numeric_limits<int>::max() / 2)) {
    throw std::invalid_argument("too many buffers: " + std::to_string(n));
  }
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    if (p.lower[i] >= p.upper[i]) {
      throw std::invalid_argument(
          "buffer " + std::to_string(i) + ": lower (" +
          std::to_string(p.lower[i]) + ") must be < upper (" +
          std::to_string(p.upper[i]) +
          "); intervals are half-open [lower, upper)");
    }
    int64_t length;
    if (__builtin_sub_overflow(p.upper[i], p.lower[i], &length)) {
      throw std::invalid_argument("buffer " + std::to_string(i) +
                                  ": upper - lower overflows int64");
    }
    if (p.size[i] < 0) {
      throw std::invalid_argument("buffer " + std::to_string(i) +
                                  ": size must be >= 0 (got " +
                                  std::to_string(p.size[i]) + ")");
    }
    // Offsets never exceed the total size, and the search adds two such
    // quantities (a floor and a section's remaining bytes): keep both in range.
    if (p.size[i] > kMaxTotalSize - total) {  // total <= kMaxTotalSize here
      throw std::invalid_argument(
          "the sizes sum to more than 2**62 bytes; offsets could overflow");
    }
    total += p.size[i];
  }
}

int64_t MaxLoad(const Problem& p) {
  // Sweep over (time, delta) with frees before allocations at equal times
  // (half-open intervals: a buffer ending at t is not live at t).
  std::vector<std::pair<int64_t, int64_t>> events;
  events.reserve(2 * p.size.size());
  for (size_t i = 0; i < p.size.size(); ++i) {
    if (p.size[i] == 0) continue;
    events.emplace_back(p.lower[i], p.size[i]);
    events.emplace_back(p.upper[i], -p.size[i]);
  }
  std::sort(events.begin(), events.end());  // negative deltas first
  int64_t live = 0, peak = 0;
  for (const auto& e : events) {
    live += e.second;
    peak = std::max(peak, live);
  }
  return peak;
}

Result Greedy(const Problem& p, Fit fit) {
  const Clock::time_point t0 = Clock::now();
  Validate(p);
  Result r;
  r.method = fit == Fit::kBest ? "best-fit" : "first-fit";
  r.offsets.assign(p.size.size(), 0);
  // SmartPool §III-C: largest buffer first; each buffer goes into
  // a hole between the memory blocks of its already placed *time neighbours*
  // (buffers whose lifetimes overlap its own), or on top of all of them when
  // no hole is large enough ("the memory pool will be extended"). Variant
  // implemented: holes are the gaps between the merged [offset, offset+size)
  // ranges of the placed neighbours, below the highest of them; kBest takes
  // the smallest hole that fits (the paper's default; ties: lowest), kFirst
  // the lowest hole that fits. A buffer is put at the bottom of its hole.
  std::vector<int> placed;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (offset, top)
  for (int b : DecreasingSizeOrder(p)) {
    blocks.clear();
    for (int a : placed) {
      if (Overlap(p, a, b)) blocks.emplace_back(r.offsets[a], r.offsets[a] + p.size[a]);
    }
    std::sort(blocks.begin(), blocks.end());
    int64_t cursor = 0;  // top of the merged blocks so far
    int64_t chosen = -1, chosen_hole = std::numeric_limits<int64_t>::max();
    for (const auto& blk : blocks) {
      const int64_t hole = blk.first - cursor;
      if (hole >= p.size[b] && hole < chosen_hole) {
        chosen = cursor;
        chosen_hole = hole;
        if (fit == Fit::kFirst) break;
      }
      cursor = std::max(cursor, blk.second);
    }
    r.offsets[b] = chosen >= 0 ? chosen : cursor;
    placed.push_back(b);
  }
  r.footprint = FootprintOf(p, r.offsets);
  Finish(&r, MaxLoad(p), false, t0);
  return r;
}

Result Exact(const Problem& p, const Options& options) {
  const Clock::time_point t0 = Clock::now();
  Validate(p);
  Result best = Greedy(p, Fit::kBest);
  Result first = Greedy(p, Fit::kFirst);
  if (first.footprint < best.footprint) best = std::move(first);
  const int64_t max_load = best.max_load;
  int64_t lower_bound = max_load;
  bool proven = best.footprint <= max_load;
  const bool hopeless = options.capacity >= 0 && max_load > options.capacity;
  const bool has_deadline = std::isfinite(options.time_limit_s);
  auto left = [&]() {
    return has_deadline ? std::max(0.0, options.time_limit_s - SecondsSince(t0))
                        : std::numeric_limits<double>::infinity();
  };
  // 0: no node limit; -1: the limit is used up.
  auto nodes_left = [&]() -> int64_t {
    if (options.node_limit <= 0) return 0;
    return best.nodes < options.node_limit ? options.node_limit - best.nodes : -1;
  };
  auto out_of_budget = [&]() {
    return (has_deadline && left() <= 0) || nodes_left() < 0;
  };
  // Decision searches (MiniMalloc's, dsa_pack.cc) at fixed capacities.
  auto pack = [&](int64_t capacity, double seconds) {
    if (out_of_budget()) {
      best.timed_out = true;
      return PackStatus::kLimit;
    }
    PackResult pr = Pack(p, capacity, seconds, nodes_left());
    best.nodes += pr.nodes;
    if (pr.status == PackStatus::kFound) {
      const int64_t footprint = FootprintOf(p, pr.offsets);
      if (footprint < best.footprint) {
        best.offsets = std::move(pr.offsets);
        best.footprint = footprint;
        best.method = "pack";
      }
    } else if (pr.status == PackStatus::kInfeasible) {
      lower_bound = std::max(lower_bound, capacity + 1);
    } else {
      best.timed_out = true;
    }
    return pr.status;
  };
  // 1. The capacity asked for: a placement within it is what the caller
  //    needs first (with `stop_at_capacity`, all it needs).
  if (!proven && !hopeless && options.capacity >= 0 && best.footprint > options.capacity) {
    pack(options.capacity, left());
  }
  const bool done = options.stop_at_capacity && options.capacity >= 0 &&
                    best.footprint <= options.capacity;
  // 2. The max load (a placement there is optimal) with a third of the time
  //    left, then bisection on the capacity between the best lower bound and
  //    the best footprint, each probe with a third of the time left, while
  //    more than a quarter of the time limit remains; the rest goes to the
  //    branch-and-bound below. A probe that runs out of time counts as a
  //    failure (unproven); without a time limit every probe finishes and the
  //    bisection ends with the optimum.
  if (best.footprint <= max_load) proven = true;
  if (!proven && !hopeless && !done) {
    auto slice = [&]() {
      return has_deadline ? left() / 3 : std::numeric_limits<double>::infinity();
    };
    PackStatus st = pack(max_load, slice());
    int64_t lo = max_load + 1, hi = best.footprint - 1;
    while (st != PackStatus::kFound && lo <= hi && !out_of_budget() &&
           (!has_deadline || left() > options.time_limit_s / 4)) {
      const int64_t mid = lo + (hi - lo) / 2;
      const int64_t nodes_before = best.nodes;
      st = pack(mid, slice());
      if (st == PackStatus::kFound) {
        hi = best.footprint - 1;
        st = PackStatus::kLimit;  // keep bisecting below the new footprint
      } else {
        lo = mid + 1;
        // Too large for the decision search: no probe will do better.
        if (st == PackStatus::kLimit && best.nodes == nodes_before) break;
      }
    }
  }
  // 3. Branch-and-bound on the footprint from the best placement so far.
  if (!proven && !hopeless && !done && lower_bound < best.footprint) {
    if (out_of_budget()) {
      best.timed_out = true;
    } else {
      Options rest = options;
      rest.node_limit = nodes_left();
      best.timed_out = false;
      proven = RoundRobin(p, rest, t0, lower_bound, &best);
    }
  }
  if (lower_bound >= best.footprint) proven = true;
  Finish(&best, max_load, proven, t0);
  if (!best.proven_optimal) best.lower_bound = lower_bound;
  return best;
}

Result Solve(const Problem& p, const std::string& method,
             const Options& options) {
  Result r;
  if (method == "best-fit") {
    r = Greedy(p, Fit::kBest);
  } else if (method == "first-fit") {
    r = Greedy(p, Fit::kFirst);
  } else if (method == "exact" || method == "auto") {
    r = Exact(p, options);
  } else {
    throw std::invalid_argument(
        "unknown method '" + method +
        "'; use 'best-fit', 'first-fit', 'exact' or 'auto'");
  }
  r.feasible = options.capacity < 0 || r.footprint <= options.capacity;
  return r;
}

CheckResult Check(const Problem& p, const std::vector<int64_t>& offsets) {
  Validate(p);
  const size_t n = p.size.size();
  if (offsets.size() != n) {
    throw std::invalid_argument("offsets must have one entry per buffer (got " +
                                std::to_string(offsets.size()) + " for " +
                                std::to_string(n) + " buffers)");
  }
  CheckResult c;
  for (size_t i = 0; i < n; ++i) {
    int64_t top;
    if (offsets[i] < 0 || __builtin_add_overflow(offsets[i], p.size[i], &top)) {
      c.valid = false;
      c.first = static_cast<int64_t>(i);
      c.reason = "offset " + std::to_string(offsets[i]) +
                 (offsets[i] < 0 ? " is negative" : " + size overflows int64");
      return c;
    }
    if (p.size[i] > 0) c.footprint = std::max(c.footprint, top);
  }
  // Sweep over time, frees before allocations at equal times; the live
  // buffers are kept ordered by offset and are pairwise disjoint, so a new
  // buffer overlaps one of them iff it overlaps its neighbour on either side.
  struct Event {
    int64_t time;
    int kind;  // 0 = free, 1 = allocate
    int id;
  };
  std::vector<Event> events;
  events.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    if (p.size[i] == 0) continue;  // occupies no byte
    events.push_back({p.lower[i], 1, static_cast<int>(i)});
    events.push_back({p.upper[i], 0, static_cast<int>(i)});
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    if (a.time != b.time) return a.time < b.time;
    if (a.kind != b.kind) return a.kind < b.kind;
    return a.id < b.id;
  });
  std::set<std::pair<int64_t, int>> live;  // (offset, id)
  for (const Event& e : events) {
    const int64_t off = offsets[e.id];
    if (e.kind == 0) {
      live.erase({off, e.id});
      continue;
    }
    const int64_t top = off + p.size[e.id];
    auto it = live.lower_bound({off, std::numeric_limits<int>::min()});
    int other = -1;
    if (it != live.end() && it->first < top) {
      other = it->second;
    } else if (it != live.begin()) {
      auto prev = std::prev(it);
      if (prev->first + p.size[prev->second] > off) other = prev->second;
    }
    if (other >= 0) {
      c.valid = false;
      c.first = std::min(other, e.id);
      c.second = std::max(other, e.id);
      const int a = static_cast<int>(c.first), b = static_cast<int>(c.second);
      c.reason = "both are live at time " +
                 std::to_string(std::max(p.lower[a], p.lower[b])) +
                 " and their bytes [" + std::to_string(offsets[a]) + ", " +
                 std::to_string(offsets[a] + p.size[a]) + ") and [" +
                 std::to_string(offsets[b]) + ", " +
                 std::to_string(offsets[b] + p.size[b]) + ") overlap";
      return c;
    }
    live.emplace(off, e.id);
  }
  return c;
}

}  // namespace dsa

}  // namespace jaxmem
