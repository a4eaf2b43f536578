// Copyright 2025 The jaxmem Authors.
//
// A line-for-line port of `_lifetimes` and its helpers
// (jaxmem/_src/estimate/lifetimes.py): the comments there say why each rule
// is what it is; the ones here say how the Python data maps to C++. Python
// dicts are insertion-ordered, and where the order reaches a result (the
// first user of a fusion group, the order of the layout copies and stored
// broadcasts) the port keeps it with vectors of pairs.

#include "lifetimes.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace jaxmem::lifetimes {
namespace {

constexpr int64_t kAllowedCodeDuplication = 15;  // xla_model.ALLOWED_CODE_DUPLICATION
constexpr int64_t kYnnMinBytes = 4096 * 4;       // lifetimes._YNN_MIN_BYTES

// An insertion-ordered map from small ints (`dict[int, V]`), linear lookup:
// fusion groups have a handful of roots and users.
template <typename V>
struct OrderedMap {
  std::vector<std::pair<int64_t, V>> items;
  V* find(int64_t k) {
    for (auto& kv : items)
      if (kv.first == k) return &kv.second;
    return nullptr;
  }
  const V* find(int64_t k) const {
    for (const auto& kv : items)
      if (kv.first == k) return &kv.second;
    return nullptr;
  }
  V& at_or_insert(int64_t k) {  // setdefault(k, V())
    if (V* v = find(k)) return *v;
    items.emplace_back(k, V());
    return items.back().second;
  }
  void set(int64_t k, V v) {  // d[k] = v (keeps the key's place)
    if (V* found = find(k)) {
      *found = std::move(v);
    } else {
      items.emplace_back(k, std::move(v));
    }
  }
  size_t size() const { return items.size(); }
};

using Users = OrderedMap<int64_t>;        // user step -> times emitted
using RootMap = OrderedMap<Users>;        // fusion root -> its users

int64_t SumOf(const Users& us) {
  int64_t total = 0;
  for (const auto& kv : us.items) total += kv.second;
  return total;
}

// `_Groups`: a (root, user) pair, or a dict of roots; and the most times.
struct Groups {
  bool simple = true;
  int64_t root = -1, user = -1;
  RootMap map;
  int64_t most = 1;
};
using GroupsPtr = std::shared_ptr<const Groups>;

GroupsPtr MakeSimple(int64_t root, int64_t user) {
  auto g = std::make_shared<Groups>();
  g->simple = true;
  g->root = root;
  g->user = user;
  g->most = 1;
  return g;
}

class Estimator {
 public:
  explicit Estimator(const Flow& flow) : f_(flow) {}

  Result Run();

 private:
  bool Virtual(int64_t v) const { return virtual_[v] != 0; }
  bool Materialized(int64_t v) const { return f_.materialized[v] != 0; }
  int8_t KindOf(int64_t s) const { return f_.kind[s]; }
  bool HasIndexing() const { return !f_.indexing.empty(); }

  void Positions();
  std::vector<int64_t> ThroughAliases(int64_t o) const;
  bool EndsInStoredEpilogue(int64_t o) const;
  int64_t BackFromReduction(const std::vector<int64_t>& readers) const;
  bool ReductionsComeBack(const std::vector<int64_t>& readers) const;
  void FusionRoots(int64_t c, std::vector<int64_t>* roots) const;
  std::vector<int64_t> ClosedReaders(const std::vector<int64_t>& readers) const;
  bool EffectivelyUnary(int64_t s) const;
  int64_t Horizon(int64_t c) const;
  GroupsPtr IndexingGroups(const std::vector<int64_t>& readers) const;
  void ShareOperandBuffers();

  const Flow& f_;
  int64_t nvals_ = 0;
  std::vector<int64_t> pos_, start_, end_;
  std::vector<std::vector<int64_t>> consumers_;
  std::vector<uint8_t> virtual_;
  std::vector<uint8_t> fusible_;
  std::vector<GroupsPtr> groups_;
  std::vector<uint8_t> split_;
  std::vector<int64_t> made_at_;     // last defining step (`made_at` of the main loop)
  bool made_at_built_ = false;
  std::vector<uint8_t> closed_roots_, reads_reduction_, ynn_roots_, reads_big_reduction_;
  // Early layout copies: per value, the steps reading it through one.
  std::vector<std::vector<int64_t>> copiers_;
  std::vector<uint8_t> has_copiers_;
  bool any_copiers_ = false;
};

void Estimator::Positions() {
  const int64_t n = f_.num_steps;
  pos_.resize(n + 1);
  for (int64_t i = 0; i <= n; ++i) pos_[i] = i;
  bool any = false;
  for (uint8_t m : f_.movable) any |= (m != 0);
  if (!any) return;
  // Each value's first defining step.
  std::vector<int64_t> first(nvals_, -1);
  for (int64_t s = n - 1; s >= 0; --s)
    for (const int64_t* o = f_.outputs.begin(s); o != f_.outputs.end(s); ++o) first[*o] = s;
  for (int64_t s = 0; s < n; ++s) {
    if (!f_.movable[s]) continue;
    int64_t p = 0;
    bool found = false;
    for (const int64_t* x = f_.inputs.begin(s); x != f_.inputs.end(s); ++x) {
      if (first[*x] >= 0) {
        p = found ? std::max(p, pos_[first[*x]]) : pos_[first[*x]];
        found = true;
      }
    }
    pos_[s] = found ? p : 0;
  }
}

std::vector<int64_t> Estimator::ThroughAliases(int64_t o) const {
  const auto& cs = consumers_[o];
  bool any_view = false;
  for (int64_t c : cs)
    if (KindOf(c) == kView) {
      any_view = true;
      break;
    }
  if (!any_view) return cs;
  std::vector<int64_t> out;
  std::vector<int64_t> stack(cs.begin(), cs.end());
  std::vector<int64_t> seen;
  while (!stack.empty()) {
    int64_t c = stack.back();
    stack.pop_back();
    if (std::find(seen.begin(), seen.end(), c) != seen.end()) continue;
    seen.push_back(c);
    if (KindOf(c) == kView && f_.inputs.size(c) == 1 && f_.outputs.size(c) == 1) {
      int64_t y = *f_.outputs.begin(c);
      if (!consumers_[y].empty() && !Materialized(y)) {
        stack.insert(stack.end(), consumers_[y].begin(), consumers_[y].end());
        continue;
      }
    }
    out.push_back(c);
  }
  return out;
}

int64_t Estimator::BackFromReduction(const std::vector<int64_t>& readers) const {
  for (int pass = 0; pass < 2; ++pass) {
    int64_t red = pass == 0 ? readers[0] : readers[1];
    int64_t other = pass == 0 ? readers[1] : readers[0];
    if (KindOf(red) != kReduce || f_.outputs.size(red) != 1) continue;
    int64_t y = *f_.outputs.begin(red);
    for (int i = 0; i < 8; ++i) {
      const auto& cs = consumers_[y];
      if (cs.size() != 1) break;
      if (cs[0] == other) return other;
      if ((KindOf(cs[0]) != kCheap && KindOf(cs[0]) != kView) || f_.outputs.size(cs[0]) != 1)
        break;
      y = *f_.outputs.begin(cs[0]);
    }
  }
  return -1;
}

// lifetimes._reductions_come_back: every reader but one is in the fusion of
// a reduction (large enough for YNNPACK to grow it) whose result comes back
// to that one reader: all of them are one fusion.
bool Estimator::ReductionsComeBack(const std::vector<int64_t>& readers) const {
  if (readers.size() < 2) return false;
  std::vector<int64_t> reductions;
  int64_t other = -1;
  for (int64_t c : readers) {
    std::vector<int64_t> roots;
    if (KindOf(c) == kReduce) {
      roots.push_back(c);
    } else {
      FusionRoots(c, &roots);
    }
    if (roots.size() == 1 && KindOf(roots[0]) == kReduce) {
      reductions.push_back(roots[0]);
    } else if (other < 0) {
      other = c;
    } else {
      return false;
    }
  }
  if (other < 0) return false;
  for (int64_t r : reductions) {
    if (f_.outputs.size(r) != 1 || f_.nbytes[*f_.outputs.begin(r)] < kYnnMinBytes) return false;
    if (BackFromReduction({r, other}) != other) return false;
  }
  return true;
}

bool Estimator::EndsInStoredEpilogue(int64_t o) const {
  int64_t x = o;
  bool through_reduction = false;
  for (int i = 0; i < 64; ++i) {
    const auto& cs = consumers_[x];
    int64_t c;
    if (cs.size() == 2 && !through_reduction) {
      c = BackFromReduction(cs);
      if (c < 0) return false;
      through_reduction = true;
    } else if (cs.size() != 1) {
      return false;
    } else {
      c = cs[0];
    }
    int8_t kind = KindOf(c);
    if (f_.outputs.size(c) != 1) return false;
    if (kind != kCheap && !(through_reduction && kind == kExpensive)) return false;
    x = *f_.outputs.begin(c);
    if (f_.nbytes[x] != f_.nbytes[o]) return false;
    if (!Virtual(x)) return (!consumers_[x].empty() || Materialized(x)) && !split_[x];
    if (kind != kCheap) return false;
  }
  return false;
}

void Estimator::FusionRoots(int64_t c, std::vector<int64_t>* roots) const {
  auto add = [roots](int64_t r) {
    if (std::find(roots->begin(), roots->end(), r) == roots->end()) roots->push_back(r);
  };
  for (const int64_t* y = f_.outputs.begin(c); y != f_.outputs.end(c); ++y) {
    const GroupsPtr& g = groups_[*y];
    if (!g) {
      add(c);
    } else if (g->simple) {
      add(g->root);
    } else {
      for (const auto& kv : g->map.items) add(kv.first);
    }
  }
}

std::vector<int64_t> Estimator::ClosedReaders(const std::vector<int64_t>& readers) const {
  std::vector<std::vector<int64_t>> per_reader(readers.size());
  std::vector<int64_t> all;
  for (size_t i = 0; i < readers.size(); ++i) {
    FusionRoots(readers[i], &per_reader[i]);
    for (int64_t r : per_reader[i])
      if (std::find(all.begin(), all.end(), r) == all.end()) all.push_back(r);
  }
  std::vector<int64_t> out;
  if (all.size() < 2) return out;
  for (size_t i = 0; i < readers.size(); ++i) {
    bool closed = false;
    for (int64_t r : per_reader[i]) closed |= closed_roots_[r] != 0;
    if (closed) out.push_back(readers[i]);
  }
  return out;
}

bool Estimator::EffectivelyUnary(int64_t s) const {
  if (f_.outputs.size(s) != 1) return false;
  int64_t out_bytes = f_.nbytes[*f_.outputs.begin(s)];
  int64_t full = 0, total = 0;
  for (const int64_t* x = f_.inputs.begin(s); x != f_.inputs.end(s); ++x) {
    total += f_.nbytes[*x];
    int64_t p = made_at_[*x];
    if (p >= 0 && f_.indexing[p] == kIndexBroadcast) continue;
    if (f_.nbytes[*x] * 4 >= out_bytes) ++full;
  }
  return full <= 1 || total <= out_bytes;
}

int64_t Estimator::Horizon(int64_t c) const {
  int64_t last = pos_[c];
  for (const int64_t* y = f_.outputs.begin(c); y != f_.outputs.end(c); ++y)
    if (Virtual(*y)) last = std::max(last, end_[*y]);
  return last;
}

GroupsPtr Estimator::IndexingGroups(const std::vector<int64_t>& readers) const {
  const auto& indexing = f_.indexing;
  if (readers.size() == 1) {
    int64_t c = readers[0];
    if (f_.outputs.size(c) == 1) {
      const GroupsPtr& found = groups_[*f_.outputs.begin(c)];
      if (!found) return MakeSimple(c, c);
      if (indexing[c] == kIndexSame) return found;
      if (found->simple) return MakeSimple(found->root, c);
      auto g = std::make_shared<Groups>();
      g->simple = false;
      int64_t most = 0;
      bool any = false;
      for (const auto& kv : found->map.items) {
        int64_t total = SumOf(kv.second);
        Users us;
        us.set(c, total);
        g->map.set(kv.first, std::move(us));
        most = any ? std::max(most, total) : total;
        any = true;
      }
      g->most = any ? most : 1;
      return g;
    }
  }
  RootMap acc;
  for (int64_t c : readers) {
    if (f_.outputs.size(c) == 1 && indexing[c] == kIndexSame && groups_[*f_.outputs.begin(c)]) {
      const Groups& g = *groups_[*f_.outputs.begin(c)];
      if (g.simple) {
        acc.at_or_insert(g.root).set(g.user, 1);
      } else {
        for (const auto& kv : g.map.items) {
          Users& dst = acc.at_or_insert(kv.first);
          for (const auto& u : kv.second.items) dst.set(u.first, u.second);
        }
      }
      continue;
    }
    OrderedMap<int64_t> per_root;
    for (const int64_t* y = f_.outputs.begin(c); y != f_.outputs.end(c); ++y) {
      const GroupsPtr& gp = groups_[*y];
      if (gp) {
        if (gp->simple) {
          per_root.at_or_insert(gp->root) += 1;
        } else {
          for (const auto& kv : gp->map.items) per_root.at_or_insert(kv.first) += SumOf(kv.second);
        }
      } else {
        per_root.at_or_insert(c) += 1;
      }
    }
    for (const auto& kv : per_root.items) acc.at_or_insert(kv.first).set(c, kv.second);
  }
  int64_t most = 1;
  bool any = false;
  for (const auto& kv : acc.items) {
    int64_t total = SumOf(kv.second);
    most = any ? std::max(most, total) : total;
    any = true;
  }
  if (!any) most = 1;
  if (acc.size() == 1 && most == 1) return MakeSimple(acc.items[0].first, acc.items[0].second.items[0].first);
  auto g = std::make_shared<Groups>();
  g->simple = false;
  g->map = std::move(acc);
  g->most = most;
  return g;
}

void Estimator::ShareOperandBuffers() {
  const int64_t n = f_.num_steps;
  std::vector<int64_t> first(nvals_, -1);  // made_at.setdefault: the first defining step
  for (int64_t s = 0; s < n; ++s)
    for (const int64_t* o = f_.outputs.begin(s); o != f_.outputs.end(s); ++o)
      if (first[*o] < 0) first[*o] = s;
  std::vector<uint8_t> taken(nvals_, 0);
  std::vector<int64_t> stack, seen;
  for (int64_t s = 0; s < n; ++s) {
    int8_t kind = KindOf(s);
    if ((kind != kCheap && kind != kExpensive) || f_.indexing[s] != kIndexSame || ynn_roots_[s])
      continue;
    if (f_.outputs.size(s) != 1) continue;
    int64_t out = *f_.outputs.begin(s);
    if (Virtual(out)) continue;
    int64_t size = f_.nbytes[out];
    int64_t p = pos_[s];
    stack.assign(f_.inputs.begin(s), f_.inputs.end(s));
    seen.clear();
    while (!stack.empty()) {
      int64_t x = stack.back();
      stack.pop_back();
      if (std::find(seen.begin(), seen.end(), x) != seen.end()) continue;
      seen.push_back(x);
      if (Virtual(x)) {
        int64_t m = first[x];
        if (m >= 0 && (KindOf(m) == kCheap || KindOf(m) == kExpensive) &&
            f_.indexing[m] == kIndexSame)
          stack.insert(stack.end(), f_.inputs.begin(m), f_.inputs.end(m));
        continue;
      }
      if (f_.nbytes[x] == size && !Materialized(x) && !taken[x] && end_[x] == p &&
          0 <= start_[x] && start_[x] < p) {
        end_[x] = p - 1;
        taken[x] = 1;
        break;
      }
    }
  }
}

Result Estimator::Run() {
  const int64_t n = f_.num_steps;
  nvals_ = static_cast<int64_t>(f_.nbytes.size());
  Positions();
  start_.resize(nvals_);
  end_.resize(nvals_);
  for (int64_t v = 0; v < nvals_; ++v) {
    start_[v] = f_.start[v] >= 0 ? pos_[f_.start[v]] : f_.start[v];
    end_[v] = f_.end[v] >= 0 ? pos_[f_.end[v]] : f_.end[v];
  }
  consumers_.assign(nvals_, {});
  // Early layout copies.
  copiers_.assign(nvals_, {});
  has_copiers_.assign(nvals_, 0);
  // (x, bytes, layout, last), insertion order: one copy per value, size and
  // layout, however many steps read it (XLA's CSE merges the transposes).
  std::vector<std::array<int64_t, 4>> copy_last;
  if (!f_.early_copies.ptr.empty()) {
    for (int64_t s = 0; s < n; ++s) {
      for (const int64_t* k = f_.early_copies.begin(s); k != f_.early_copies.end(s); k += 3) {
        int64_t x = k[0], b = k[1], layout = k[2];
        if (std::find(copiers_[x].begin(), copiers_[x].end(), s) == copiers_[x].end())
          copiers_[x].push_back(s);
        has_copiers_[x] = 1;
        any_copiers_ = true;
        bool found = false;
        for (auto& e : copy_last) {
          if (e[0] == x && e[1] == b && e[2] == layout) {
            e[3] = std::max(e[3], pos_[s]);
            found = true;
            break;
          }
        }
        if (!found) copy_last.push_back({x, b, layout, pos_[s]});
      }
    }
  }
  auto copier_reads = [this](int64_t x, int64_t s) {
    return has_copiers_[x] &&
           std::find(copiers_[x].begin(), copiers_[x].end(), s) != copiers_[x].end();
  };
  for (int64_t s = 0; s < n; ++s) {
    int64_t p = pos_[s];
    for (const int64_t* xp = f_.inputs.begin(s); xp != f_.inputs.end(s); ++xp) {
      int64_t x = *xp;
      auto& cx = consumers_[x];
      if (cx.empty() || cx.back() != s) {
        cx.push_back(s);
        if (start_[x] >= 0 && end_[x] < p && !(any_copiers_ && copier_reads(x, s))) end_[x] = p;
      }
    }
  }
  virtual_.assign(nvals_, 0);
  const bool has_fuses = !f_.fuses_operands.empty();
  fusible_.resize(n);
  for (int64_t c = 0; c < n; ++c) {
    int8_t k = KindOf(c);
    fusible_[c] = (k == kCheap || k == kExpensive || k == kView || k == kReduce) ||
                  (has_fuses && f_.fuses_operands[c] == kFusesAny);
  }
  const bool has_indexing = HasIndexing();
  groups_.assign(nvals_, nullptr);
  split_.assign(nvals_, 0);
  made_at_.assign(nvals_, -1);
  closed_roots_.assign(n, 0);
  reads_reduction_.assign(n, 0);
  ynn_roots_.assign(n, 0);
  reads_big_reduction_.assign(n, 0);
  if (has_indexing) {
    for (int64_t s = 0; s < n; ++s) {
      if (KindOf(s) != kReduce) continue;
      closed_roots_[s] = 1;
      ynn_roots_[s] = 1;
      for (const int64_t* y = f_.outputs.begin(s); y != f_.outputs.end(s); ++y) {
        std::vector<int64_t> cs = ThroughAliases(*y);
        if (cs.size() == 1) {
          reads_reduction_[cs[0]] = 1;
          if (f_.nbytes[*y] >= kYnnMinBytes) reads_big_reduction_[cs[0]] = 1;
        }
      }
    }
    for (int64_t s = 0; s < n; ++s) {
      if (reads_reduction_[s]) closed_roots_[s] = 1;
      if (reads_big_reduction_[s]) ynn_roots_[s] = 1;
    }
  }
  const bool has_epilogues = !f_.epilogues.empty();
  const bool has_forwarded = !f_.has_forwarded.empty();
  std::vector<int64_t> roots;
  for (int64_t s = n - 1; s >= 0; --s) {
    const int8_t kind = KindOf(s);
    for (const int64_t* op = f_.outputs.begin(s); op != f_.outputs.end(s); ++op) {
      const int64_t o = *op;
      if (Materialized(o) || consumers_[o].empty()) continue;
      if (has_forwarded && f_.has_forwarded[o]) {
        virtual_[o] = 1;
        for (const int64_t* x = f_.forwarded.begin(o); x != f_.forwarded.end(o); ++x)
          end_[*x] = std::max(end_[*x], end_[o]);
        continue;
      }
      if (kind == kCheap && has_copiers_[o]) {
        std::vector<int64_t> hard, soft;
        std::vector<int64_t> others;
        for (int64_t c : consumers_[o])
          if (std::find(copiers_[o].begin(), copiers_[o].end(), c) == copiers_[o].end())
            others.push_back(c);
        for (int64_t c : others) {
          bool dup = fusible_[c] && !(KindOf(c) == kReduce && others.size() > 1);
          (dup ? soft : hard).push_back(pos_[c]);
        }
        if (!soft.empty()) {
          int64_t soft_max = *std::max_element(soft.begin(), soft.end());
          for (const int64_t* x = f_.inputs.begin(s); x != f_.inputs.end(s); ++x)
            end_[*x] = std::max(end_[*x], soft_max);
          if (!hard.empty()) {
            end_[o] = std::max(start_[o], *std::max_element(hard.begin(), hard.end()));
          } else {
            virtual_[o] = 1;
          }
          continue;
        }
      }
      if (kind == kView && f_.inputs.size(s) > 0) {
        // a bitcast: always an alias
      } else if (kind == kCheap || (kind == kExpensive && consumers_[o].size() == 1)) {
        std::vector<int64_t> cs = ThroughAliases(o);
        bool all_fusible = true;
        for (int64_t c : cs) all_fusible &= fusible_[c] != 0;
        if (!all_fusible &&
            !(has_fuses && cs.size() == 1 && f_.fuses_operands[cs[0]] == kFusesSole &&
              consumers_[o] == cs && has_indexing && f_.indexing[s] == kIndexSame))
          continue;
        const bool one_fusion = has_indexing && ReductionsComeBack(cs);
        if (has_indexing && cs.size() > 1 && !one_fusion) {
          std::vector<int64_t> closed = ClosedReaders(cs);
          if (!closed.empty()) {
            if (!made_at_built_) {
              for (int64_t t = 0; t < n; ++t)
                for (const int64_t* y = f_.outputs.begin(t); y != f_.outputs.end(t); ++y)
                  made_at_[*y] = t;
              made_at_built_ = true;
            }
            if (kind == kCheap && EffectivelyUnary(s)) {
              std::vector<int64_t> others;
              for (int64_t c : cs)
                if (std::find(closed.begin(), closed.end(), c) == closed.end()) others.push_back(c);
              int64_t closed_max = Horizon(closed[0]);
              for (int64_t c : closed) closed_max = std::max(closed_max, Horizon(c));
              end_[o] = std::max(start_[o], closed_max);
              if (!others.empty()) {
                int64_t last = Horizon(others[0]);
                for (int64_t c : others) last = std::max(last, Horizon(c));
                for (const int64_t* x = f_.inputs.begin(s); x != f_.inputs.end(s); ++x)
                  end_[*x] = std::max(end_[*x], last);
                split_[o] = 1;
              }
            }
            continue;
          }
        }
        bool has_reduce = false;
        for (int64_t c : cs) has_reduce |= KindOf(c) == kReduce;
        if (has_reduce && cs.size() > 1 && !one_fusion) continue;
      } else if (!(has_epilogues && f_.epilogues[s] && EndsInStoredEpilogue(o))) {
        continue;
      }
      if (has_indexing) {
        GroupsPtr found = IndexingGroups(consumers_[o]);
        const int64_t times = found->most;
        const int ind = f_.indexing[s];
        if (kind != kView && ind != kIndexBroadcast &&
            (times > kAllowedCodeDuplication || (ind == kIndexBranches && times > 1))) {
          if (kind == kCheap && ind != kIndexBranches && !found->simple) {
            auto few = std::make_shared<Groups>();
            few->simple = false;
            for (const auto& kv : found->map.items)
              if (SumOf(kv.second) <= kAllowedCodeDuplication) few->map.set(kv.first, kv.second);
            if (few->map.size() > 0) {
              int64_t many_max = start_[o];
              for (const auto& kv : found->map.items)
                if (!few->map.find(kv.first)) many_max = std::max(many_max, pos_[kv.first]);
              end_[o] = many_max;
              int64_t last = -1;
              bool any = false;
              for (const auto& kv : few->map.items) {
                last = any ? std::max(last, pos_[kv.first]) : pos_[kv.first];
                any = true;
              }
              for (const int64_t* x = f_.inputs.begin(s); x != f_.inputs.end(s); ++x)
                end_[*x] = std::max(end_[*x], last);
              split_[o] = 1;
              if (!few->map.find(s)) {
                Users own;
                own.set(s, 1);
                few->map.set(s, std::move(own));
              }
              int64_t most = 0;
              bool any_most = false;
              for (const auto& kv : few->map.items) {
                int64_t total = SumOf(kv.second);
                most = any_most ? std::max(most, total) : total;
                any_most = true;
              }
              few->most = most;
              groups_[o] = few;
            }
          }
          continue;
        }
        if (kind == kExpensive && !found->simple && found->map.size() > 1) continue;
        groups_[o] = found;
        if (reads_reduction_[s]) {
          roots.clear();
          FusionRoots(s, &roots);
          for (int64_t r : roots) closed_roots_[r] = 1;
          if (reads_big_reduction_[s])
            for (int64_t r : roots) ynn_roots_[r] = 1;
        }
      }
      virtual_[o] = 1;
      for (const int64_t* x = f_.inputs.begin(s); x != f_.inputs.end(s); ++x)
        end_[*x] = std::max(end_[*x], end_[o]);
    }
  }
  for (int64_t v : f_.hoist_to_start)
    if (!Virtual(v) && !f_.merged[v]) start_[v] = 0;
  if (!f_.in_place.empty()) {
    for (int64_t s = 0; s < n; ++s) {
      int64_t at = f_.in_place[s];
      if (0 <= at && at < f_.inputs.size(s)) {
        int64_t x = f_.inputs.begin(s)[at];
        if (!Materialized(x) && !Virtual(x) && end_[x] == pos_[s] && start_[x] < pos_[s])
          end_[x] = pos_[s] - 1;
      }
    }
  }
  if (has_indexing) ShareOperandBuffers();
  // Shared reads: per (value, bytes), its readers in order.
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<int64_t>>> readers_of;
  if (!f_.shared_reads.ptr.empty()) {
    for (int64_t s = 0; s < n; ++s) {
      for (const int64_t* k = f_.shared_reads.begin(s); k != f_.shared_reads.end(s); k += 2) {
        std::pair<int64_t, int64_t> key{k[0], k[1]};
        bool found = false;
        for (auto& e : readers_of) {
          if (e.first == key) {
            e.second.push_back(s);
            found = true;
            break;
          }
        }
        if (!found) readers_of.push_back({key, {s}});
      }
    }
  }
  Result out;
  for (auto& e : readers_of) {
    std::vector<int64_t> readers = e.second;
    int64_t first = pos_[readers[0]];
    for (int64_t c : readers) first = std::min(first, pos_[c]);
    if (has_indexing) {
      // Made by the first reader of any kind, kept until the last of the
      // reduction fusions that read it (as in `_lifetimes`).
      std::sort(readers.begin(), readers.end());
      readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
      readers = ClosedReaders(readers);
      if (readers.empty()) continue;
    }
    int64_t last = Horizon(readers[0]);
    for (int64_t c : readers) last = std::max(last, Horizon(c));
    if (!has_indexing && last <= first) continue;
    out.stored_broadcasts.push_back({e.first.first, e.first.second, first, last});
  }
  out.pos = std::move(pos_);
  out.start = std::move(start_);
  out.end = std::move(end_);
  out.is_virtual = std::move(virtual_);
  out.copy_last.reserve(copy_last.size());
  for (const auto& e : copy_last) out.copy_last.push_back({e[0], e[1], e[3]});
  return out;
}

void Check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("estimate_lifetimes: " + what);
}

// Rows of `n` (row pointers) whose entries (every `stride`-th: the values of
// (value, bytes) pairs) are value ids.
void CheckRows(const Rows& rows, int64_t n, int64_t nvals, const char* name, int64_t stride) {
  if (rows.ptr.empty()) return;
  Check(static_cast<int64_t>(rows.ptr.size()) == n + 1, std::string(name) + ": wrong length");
  Check(rows.ptr[0] == 0 && rows.ptr[n] == static_cast<int64_t>(rows.idx.size()),
        std::string(name) + ": bad row pointers");
  for (int64_t s = 0; s < n; ++s) {
    Check(rows.ptr[s] <= rows.ptr[s + 1] && (rows.ptr[s + 1] - rows.ptr[s]) % stride == 0,
          std::string(name) + ": bad row pointers");
  }
  for (size_t i = 0; i < rows.idx.size(); i += stride) {
    Check(0 <= rows.idx[i] && rows.idx[i] < nvals, std::string(name) + ": value out of range");
  }
}

}  // namespace

Result Estimate(const Flow& flow) {
  const int64_t n = flow.num_steps;
  const int64_t nvals = static_cast<int64_t>(flow.nbytes.size());
  Check(n >= 0, "negative num_steps");
  Check(static_cast<int64_t>(flow.kind.size()) == n, "kinds: wrong length");
  for (int8_t k : flow.kind) Check(0 <= k && k <= kMaterialized, "kinds: unknown kind");
  Check(!flow.inputs.ptr.empty() && !flow.outputs.ptr.empty(), "inputs/outputs missing");
  CheckRows(flow.inputs, n, nvals, "inputs", 1);
  CheckRows(flow.outputs, n, nvals, "outputs", 1);
  CheckRows(flow.early_copies, n, nvals, "early_copies", 3);
  CheckRows(flow.shared_reads, n, nvals, "shared_reads", 2);
  Check(static_cast<int64_t>(flow.start.size()) == nvals &&
            static_cast<int64_t>(flow.end.size()) == nvals &&
            static_cast<int64_t>(flow.materialized.size()) == nvals &&
            static_cast<int64_t>(flow.merged.size()) == nvals,
        "per-value columns: wrong length");
  for (int64_t v = 0; v < nvals; ++v) {
    Check(-1 <= flow.start[v] && flow.start[v] <= n && -1 <= flow.end[v] && flow.end[v] <= n,
          "start/end out of range");
  }
  for (int64_t v : flow.hoist_to_start) Check(0 <= v && v < nvals, "hoist_to_start: out of range");
  auto per_step = [n](size_t size) { return size == 0 || static_cast<int64_t>(size) == n; };
  Check(per_step(flow.movable.size()) && per_step(flow.fuses_operands.size()) &&
            per_step(flow.epilogues.size()) && per_step(flow.indexing.size()) &&
            per_step(flow.in_place.size()),
        "per-step columns: wrong length");
  if (!flow.has_forwarded.empty()) {
    Check(static_cast<int64_t>(flow.has_forwarded.size()) == nvals, "forwarded: wrong length");
    Check(!flow.forwarded.ptr.empty(), "forwarded: a mask without rows");
    CheckRows(flow.forwarded, nvals, nvals, "forwarded", 1);
  }
  return Estimator(flow).Run();
}

}  // namespace jaxmem::lifetimes
