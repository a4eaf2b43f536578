// Copyright 2025 The jaxmem Authors.
//
// `Pack`: does a DSA instance fit in a given capacity? (see dsa.h). The
// decision search of MiniMalloc (M. D. Moffitt, *MiniMalloc: A Lightweight
// Memory Allocator for Hardware-Accelerated Machine Learning*, ASPLOS 2023),
// reimplemented from the paper's description:
//
//   * canonical solutions (§4.1): buffers are placed bottom-up in
//     non-decreasing offset order, each at its lowest offset, the top of the
//     highest placed buffer it overlaps in time; equal offsets go in the order
//     of a static preordering, so each canonical solution is visited once;
//   * a dynamic ordering (§4.2): at each node the candidates are tried by
//     lowest offset first, then by that preordering;
//   * cross-section inference (§4.3): in every section (a maximal set of
//     buffers live at one time) the buffers not yet placed all sit above the
//     section's floor -- the highest placed top, the offset of the last
//     placement, and the lowest offset any of them can still take -- so the
//     floor plus their summed sizes must fit in the capacity;
//   * dominance (§4.4): a buffer is never placed at or above the top that
//     another unplaced buffer would have at its own lowest offset (that one
//     could drop into the gap left under it);
//   * dynamic temporal decomposition (§4.5): once every buffer spanning the
//     boundary between two adjacent sections is placed, the two sides share
//     nothing more and are solved one after the other, without backtracking
//     between them;
//   * static preorderings (§4.6) run round-robin from the root with a node
//     limit that doubles each round, so that one unlucky order does not eat
//     the time ("WAT", "TAW", "TWA": W the lifetime's width, A the area, T
//     the largest remaining total of a section the buffer spans).
//
// Beyond the paper:
//   * a table of failed states: a node whose subtree was searched to the end
//     without a placement is remembered by a hash of what its subtree depends
//     on (the partition, the last placement, each unplaced buffer with its
//     lowest offset and rank); the same state reached through another order
//     of independent placements fails at once. On the public challenging
//     suite it halves the nodes and the time (bench/results/dsa.md);
//   * a buffer that the canonical order has passed by (its lowest offset is
//     below the last placement's) can only be placed after a later placement
//     lifts it; when no unplaced buffer overlaps it in time nothing can, and
//     the node is a dead end (the same rule as `Exact`'s search);
//   * the section floor is the lowest offset of the section's unplaced
//     buffers, kept exact incrementally (a section is rescanned only when the
//     buffer that held its minimum was raised or placed): the paper's floor
//     (the highest placed top, raised to that minimum) never exceeds it, as
//     every unplaced buffer of a section overlaps every placed one.
// Tried and left out: the exact one-section bound (the unplaced buffers of a
// section stacked with their lowest offsets as release dates, Lawler's
// makespan) instead of the lowest offset plus the remaining sizes: 4% fewer
// nodes on the public suite, 3 to 10 times slower.
// Sizes and offsets are int64 bytes, with no alignment.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "dsa.h"

namespace jaxmem {
namespace dsa {
namespace {

using Clock = std::chrono::steady_clock;

// Above this many time-overlapping pairs the overlap lists would take more
// than about 400 MB, and above this many buffers the search's frames (each
// keeps its ordering of the unplaced buffers) more than about 70 MB: `Pack`
// gives up (kLimit) instead.
constexpr int64_t kMaxOverlapPairs = int64_t{50} * 1000 * 1000;
constexpr int kMaxBuffers = 3000;
// The table of failed states stops growing here (about 100 MB).
constexpr size_t kMaxFailedStates = size_t{3} << 20;

constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

enum class Status { kFound, kNotFound, kAborted, kTimeOut };

class Packer {
 public:
  Packer(const Problem& p, int64_t capacity) : p_(p), capacity_(capacity) {}

  // Builds sections, overlaps and cuts. False when the instance is too large
  // for the overlap lists.
  bool Setup() {
    for (size_t i = 0; i < p_.size.size(); ++i) {
      if (p_.size[i] > 0) ids_.push_back(static_cast<int>(i));
    }
    n_ = static_cast<int>(ids_.size());
    if (n_ > kMaxBuffers) return false;
    size_.resize(n_);
    width_.resize(n_);
    for (int b = 0; b < n_; ++b) {
      size_[b] = p_.size[ids_[b]];
      width_[b] = p_.upper[ids_[b]] - p_.lower[ids_[b]];
    }
    // Elementary sections between distinct endpoints, then only those where
    // some buffer ends: every other section's live set is contained in the
    // next such one (between two ends buffers only start), so these sections
    // carry every constraint (MiniMalloc's sweep makes the same sections).
    std::vector<int64_t> coords;
    coords.reserve(2 * n_);
    for (int b = 0; b < n_; ++b) {
      coords.push_back(p_.lower[ids_[b]]);
      coords.push_back(p_.upper[ids_[b]]);
    }
    std::sort(coords.begin(), coords.end());
    coords.erase(std::unique(coords.begin(), coords.end()), coords.end());
    auto index = [&](int64_t x) {
      return static_cast<int>(std::lower_bound(coords.begin(), coords.end(), x) -
                              coords.begin());
    };
    std::vector<int> el(n_), eu(n_);
    std::vector<int> is_end(coords.size(), 0);
    for (int b = 0; b < n_; ++b) {
      el[b] = index(p_.lower[ids_[b]]);
      eu[b] = index(p_.upper[ids_[b]]);
      is_end[eu[b] - 1] = 1;
    }
    std::vector<int> reduced_before(coords.size() + 1, 0);  // # end sections < x
    for (size_t x = 0; x < coords.size(); ++x) {
      reduced_before[x + 1] = reduced_before[x] + is_end[x];
    }
    num_sections_ = reduced_before[coords.size()];
    rl_.resize(n_);
    ru_.resize(n_);
    for (int b = 0; b < n_; ++b) {
      rl_[b] = reduced_before[el[b]];
      ru_[b] = reduced_before[eu[b]];  // eu - 1 is an end section: rl < ru
    }
    members_.assign(num_sections_, {});
    total_.assign(num_sections_, 0);
    for (int b = 0; b < n_; ++b) {
      for (int s = rl_[b]; s < ru_[b]; ++s) {
        members_[s].push_back(b);
        total_[s] += size_[b];
      }
    }
    // Two buffers overlap in time iff they share a section (the earlier end
    // of the two is an end section inside both).
    std::vector<int> by_start(n_);
    for (int b = 0; b < n_; ++b) by_start[b] = b;
    std::sort(by_start.begin(), by_start.end(),
              [&](int a, int b) { return rl_[a] < rl_[b] || (rl_[a] == rl_[b] && a < b); });
    overlaps_.assign(n_, {});
    int64_t pairs = 0;
    for (int i = 0; i < n_; ++i) {
      const int a = by_start[i];
      for (int j = i + 1; j < n_ && rl_[by_start[j]] < ru_[a]; ++j) {
        const int b = by_start[j];
        overlaps_[a].push_back(b);
        overlaps_[b].push_back(a);
        if (++pairs > kMaxOverlapPairs) return false;
      }
    }
    cut_.assign(std::max(0, num_sections_ - 1), 0);
    for (int b = 0; b < n_; ++b) {
      for (int s = rl_[b]; s + 1 < ru_[b]; ++s) ++cut_[s];
    }
    off_.assign(n_, -1);
    lo_.assign(n_, 0);
    minlo_.assign(num_sections_, 0);
    rem_ = total_;
    mark_.assign(num_sections_, 0);
    solution_.assign(p_.size.size(), 0);
    return true;
  }

  // Round-robin over the preorderings with doubling node limits.
  PackResult Run(Clock::time_point deadline, bool has_deadline) {
    PackResult r;
    deadline_ = deadline;
    has_deadline_ = has_deadline;
    for (int b = 0; b < n_; ++b) {
      if (size_[b] > capacity_) {
        r.status = PackStatus::kInfeasible;
        return r;
      }
    }
    for (int s = 0; s < num_sections_; ++s) {
      if (total_[s] > capacity_) {
        r.status = PackStatus::kInfeasible;
        return r;
      }
    }
    static const char* const kHeuristics[] = {"WAT", "TAW", "TWA"};
    int64_t limit = std::max<int64_t>(n_, 64);
    Status st = Status::kAborted;
    while (st == Status::kAborted) {
      for (uint64_t k = 0; k < std::size(kHeuristics); ++k) {
        heuristic_ = kHeuristics[k];
        heuristic_index_ = k;
        run_limit_ = limit;
        run_nodes_ = 0;
        st = SolveWhole();   // kTimeOut at the deadline or the node limit
        if (st != Status::kAborted) break;
      }
      limit = limit > std::numeric_limits<int64_t>::max() / 2 ? limit : 2 * limit;
    }
    r.nodes = total_nodes_;
    if (st == Status::kFound) {
      r.status = PackStatus::kFound;
      r.offsets = solution_;
    } else if (st == Status::kNotFound) {
      r.status = PackStatus::kInfeasible;
    } else {
      r.status = PackStatus::kLimit;
    }
    return r;
  }

  void set_node_limit(int64_t limit) { node_limit_ = limit; }

 private:
  struct Item {
    int64_t lo;
    int rank;
    int b;
  };

  // The root: one partition per stretch of sections with no buffer across
  // their boundaries.
  Status SolveWhole() {
    int start = 0;
    for (int s = 0; s < num_sections_; ++s) {
      if (s + 1 == num_sections_ || cut_[s] == 0) {
        std::vector<int> part;
        for (int b = 0; b < n_; ++b) {
          if (rl_[b] < s + 1 && ru_[b] > start) part.push_back(b);
        }
        const Status st = SubSolve(part, start, s + 1);
        if (st != Status::kFound) return st;
        start = s + 1;
      }
    }
    return Status::kFound;
  }

  // Preorders the partition's unplaced buffers, then searches.
  Status SubSolve(const std::vector<int>& buffers, int slo, int shi) {
    auto total_of = [&](int b) {
      int64_t t = 0;
      for (int s = rl_[b]; s < ru_[b]; ++s) t = std::max(t, rem_[s]);
      return t;
    };
    std::vector<int64_t> key_total(buffers.size());
    for (size_t i = 0; i < buffers.size(); ++i) key_total[i] = total_of(buffers[i]);
    std::vector<int> idx(buffers.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int>(i);
    const std::string h = heuristic_;
    std::sort(idx.begin(), idx.end(), [&](int x, int y) {
      const int a = buffers[x], b = buffers[y];
      for (char c : h) {
        if (c == 'W' && width_[a] != width_[b]) return width_[a] > width_[b];
        if (c == 'A') {
          const long double aa = static_cast<long double>(size_[a]) * width_[a];
          const long double ab = static_cast<long double>(size_[b]) * width_[b];
          if (aa != ab) return aa > ab;
        }
        if (c == 'T' && key_total[x] != key_total[y]) return key_total[x] > key_total[y];

      }
      return a < b;
    });
    std::vector<Item> items;
    items.reserve(idx.size());
    for (size_t r = 0; r < idx.size(); ++r) {
      items.push_back({0, static_cast<int>(r), buffers[idx[r]]});
    }
    return Search(buffers, slo, shi, items, 0, -1);
  }

  Status Search(const std::vector<int>& part, int slo, int shi,
                const std::vector<Item>& parent, int64_t floor_offset, int last_rank) {
    if (run_nodes_ >= run_limit_) return Status::kAborted;
    ++run_nodes_;
    ++total_nodes_;
    if (node_limit_ > 0 && total_nodes_ >= node_limit_) return Status::kTimeOut;
    if (has_deadline_ && (total_nodes_ & 255) == 1 && Clock::now() >= deadline_) {
      return Status::kTimeOut;
    }
    std::vector<Item> ord;
    ord.reserve(parent.size());
    for (const Item& it : parent) {
      if (off_[it.b] < 0) ord.push_back({lo_[it.b], it.rank, it.b});
    }
    if (ord.empty()) {
      for (int b : part) solution_[ids_[b]] = off_[b];
      return Status::kFound;
    }
    // Nearly sorted already (the parent's order, a few offsets raised).
    for (size_t i = 1; i < ord.size(); ++i) {
      Item x = ord[i];
      size_t j = i;
      while (j > 0 && (ord[j - 1].lo > x.lo || (ord[j - 1].lo == x.lo && ord[j - 1].rank > x.rank))) {
        ord[j] = ord[j - 1];
        --j;
      }
      ord[j] = x;
    }
    int64_t min_height = std::numeric_limits<int64_t>::max();
    for (const Item& it : ord) min_height = std::min(min_height, it.lo + size_[it.b]);
    if (min_height <= floor_offset) return Status::kNotFound;  // see the dominance rule
    const Key key = KeyOf(ord, slo, shi, floor_offset, last_rank);
    if (failed_.count(key)) return Status::kNotFound;
    const Status st = Branch(part, slo, shi, ord, floor_offset, last_rank, min_height);
    if (st == Status::kNotFound && failed_.size() < kMaxFailedStates) failed_.insert(key);
    return st;
  }

  // A node's state, for the table of failed states: what the rest of the
  // search below it depends on (the partition, the last placement, and each
  // unplaced buffer with its lowest offset and rank), hashed twice.
  struct Key {
    uint64_t a, b;
    bool operator==(const Key& o) const { return a == o.a && b == o.b; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return static_cast<size_t>(k.a); }
  };

  static uint64_t Mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
  }

  Key KeyOf(const std::vector<Item>& ord, int slo, int shi, int64_t floor_offset,
            int last_rank) const {
    uint64_t a = Mix(static_cast<uint64_t>(slo) * 0x9E3779B97F4A7C15ull + shi + 1);
    uint64_t b = Mix(static_cast<uint64_t>(floor_offset) ^ (heuristic_index_ << 40)) +
                 static_cast<uint64_t>(last_rank + 1);
    for (const Item& it : ord) {
      const uint64_t v = Mix(static_cast<uint64_t>(it.lo) * 0x9E3779B97F4A7C15ull +
                             (static_cast<uint64_t>(it.b) << 20) + static_cast<uint64_t>(it.rank));
      a = Mix(a ^ v);
      b = b * 0x100000001b3ull + (v ^ (v >> 29));
    }
    return {a, Mix(b)};
  }

  Status Branch(const std::vector<int>& part, int slo, int shi, const std::vector<Item>& ord,
                int64_t floor_offset, int last_rank, int64_t min_height) {
    // A buffer the canonical order passed by must be lifted by a later
    // placement that overlaps it; with none left it never gets placed.
    for (const Item& it : ord) {
      if (it.lo > floor_offset || (it.lo == floor_offset && it.rank > last_rank)) break;
      bool liftable = false;
      for (int c : overlaps_[it.b]) {
        if (off_[c] < 0) {
          liftable = true;
          break;
        }
      }
      if (!liftable) return Status::kNotFound;
    }
    for (const Item& it : ord) {
      if (it.lo < floor_offset || (it.lo == floor_offset && it.rank < last_rank)) continue;
      if (it.lo >= min_height) break;  // dominance; `ord` is sorted by lo
      const int b = it.b;
      if (it.lo + size_[b] > capacity_) continue;
      const size_t lo_mark = lo_log_.size(), minlo_mark = minlo_log_.size();
      Place(b, it.lo);
      Status st = Status::kNotFound;
      if (Fits(slo, shi, it.lo)) st = Decompose(part, slo, shi, ord, it.lo, it.rank, b);
      Unplace(b, lo_mark, minlo_mark);
      if (st != Status::kNotFound) return st;
    }
    return Status::kNotFound;
  }

  // Places b at `offset`: raises the lowest offsets of the unplaced buffers
  // it overlaps to its top, and keeps each section's lowest unplaced offset
  // (`minlo_`) exact, rescanning a section only when a buffer that held its
  // minimum was raised or placed.
  void Place(int b, int64_t offset) {
    off_[b] = offset;
    const int64_t top = offset + size_[b];
    dirty_.clear();
    ++stamp_;
    auto touch = [&](int c, int64_t old_lo) {
      for (int s = rl_[c]; s < ru_[c]; ++s) {
        if (minlo_[s] == old_lo && mark_[s] != stamp_) {
          mark_[s] = stamp_;
          dirty_.push_back(s);
        }
      }
    };
    for (int s = rl_[b]; s < ru_[b]; ++s) rem_[s] -= size_[b];
    touch(b, lo_[b]);
    for (int c : overlaps_[b]) {
      if (off_[c] >= 0 || lo_[c] >= top) continue;
      lo_log_.emplace_back(c, lo_[c]);
      const int64_t old = lo_[c];
      lo_[c] = top;
      touch(c, old);
    }
    for (int s : dirty_) {
      int64_t low = kNone;
      for (int c : members_[s]) {
        if (off_[c] < 0) low = std::min(low, lo_[c]);
      }
      if (low != minlo_[s]) {
        minlo_log_.emplace_back(s, minlo_[s]);
        minlo_[s] = low;
      }
    }
  }

  void Unplace(int b, size_t lo_mark, size_t minlo_mark) {
    while (minlo_log_.size() > minlo_mark) {
      minlo_[minlo_log_.back().first] = minlo_log_.back().second;
      minlo_log_.pop_back();
    }
    while (lo_log_.size() > lo_mark) {
      lo_[lo_log_.back().first] = lo_log_.back().second;
      lo_log_.pop_back();
    }
    for (int s = rl_[b]; s < ru_[b]; ++s) rem_[s] += size_[b];
    off_[b] = -1;
  }

  // Cross-section inference over the partition's sections: the unplaced
  // buffers of a section all sit at or above the last placement's offset
  // (canonical order) and at or above the lowest offset any of them can take
  // -- which is at least the top of every placed buffer of the section, since
  // they all overlap it -- and they are disjoint.
  bool Fits(int slo, int shi, int64_t offset) const {
    for (int s = slo; s < shi; ++s) {
      if (rem_[s] > 0 && std::max(offset, minlo_[s]) + rem_[s] > capacity_) return false;
    }
    return true;
  }

  Status Decompose(const std::vector<int>& part, int slo, int shi, const std::vector<Item>& ord,
                   int64_t offset, int rank, int b) {
    solution_[ids_[b]] = offset;
    std::vector<int> cutpoints = {slo};
    for (int s = rl_[b]; s + 1 < ru_[b]; ++s) {
      if (--cut_[s] == 0 && s + 1 > slo && s + 1 < shi) cutpoints.push_back(s + 1);
    }
    Status st = Status::kFound;
    if (cutpoints.size() == 1) {
      st = Search(part, slo, shi, ord, offset, rank);
    } else {
      std::sort(cutpoints.begin(), cutpoints.end());
      cutpoints.push_back(shi);
      for (size_t c = 1; c < cutpoints.size() && st == Status::kFound; ++c) {
        const int lo = cutpoints[c - 1], hi = cutpoints[c];
        std::vector<int> sub;
        for (int x : part) {
          if (off_[x] < 0 && rl_[x] < hi && ru_[x] > lo) sub.push_back(x);
        }
        if (!sub.empty()) st = SubSolve(sub, lo, hi);
      }
    }
    for (int s = rl_[b]; s + 1 < ru_[b]; ++s) ++cut_[s];
    return st;
  }

  const Problem& p_;
  const int64_t capacity_;
  std::vector<int> ids_;  // problem index of each non-empty buffer
  int n_ = 0;
  std::vector<int64_t> size_, width_;
  int num_sections_ = 0;
  std::vector<int> rl_, ru_;  // section range [rl, ru) of each buffer
  std::vector<std::vector<int>> members_, overlaps_;
  std::vector<int64_t> total_;
  std::vector<int> cut_;  // unplaced buffers across the boundary s | s+1
  std::vector<int64_t> off_, lo_, rem_;
  // Per section, the lowest offset of its unplaced buffers (kNone: none).
  std::vector<int64_t> minlo_;
  std::vector<std::pair<int, int64_t>> lo_log_, minlo_log_;
  std::vector<int> dirty_;      // sections whose minimum may have risen
  std::vector<int64_t> mark_;   // == stamp_: already in dirty_
  int64_t stamp_ = 0;
  std::vector<int64_t> solution_;
  std::string heuristic_;
  uint64_t heuristic_index_ = 0;
  // Hashes of nodes whose subtree was searched to the end without a
  // placement (under the current heuristic's ranks): met again through
  // another order of independent placements, they fail at once.
  std::unordered_set<Key, KeyHash> failed_;

  int64_t run_limit_ = 0, run_nodes_ = 0, total_nodes_ = 0, node_limit_ = 0;
  Clock::time_point deadline_;
  bool has_deadline_ = false;
};

}  // namespace

PackResult Pack(const Problem& p, int64_t capacity, double time_limit_s, int64_t node_limit) {
  const Clock::time_point t0 = Clock::now();
  Validate(p);
  PackResult r;
  if (capacity < 0) {
    throw std::invalid_argument("capacity must be >= 0 bytes (got " + std::to_string(capacity) +
                                ")");
  }
  Packer packer(p, capacity);
  if (!packer.Setup()) {
    r.status = PackStatus::kLimit;
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return r;
  }
  packer.set_node_limit(node_limit);
  const bool has_deadline = std::isfinite(time_limit_s);
  const Clock::time_point deadline =
      has_deadline ? t0 + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(std::min(time_limit_s, 1e9)))
                   : t0;
  r = packer.Run(deadline, has_deadline);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace dsa
}  // namespace jaxmem
