// Work queue shared by radixrt's CPU attention kernels (paged_decode.cpp, extend_attention.cpp):
// independent items of uneven cost run on torch's intra-op threads, largest first, each thread
// taking the next item when it finishes one (so a few long items do not leave threads idle).
// In a decode team (team.h) each member runs its share of the items as given, split by cost
// (team_share), then takes the others' last ones (TeamMember::run_items), and the team meets
// when all are done.

#pragma once

#include <ATen/Parallel.h>

#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace radixrt_cpu {

// Paged decode's (query, key) pairs in a phase below which the phase runs on one thread
// (min_parallel_attention_work). Outside a team (a parallel region per op) the other threads
// must be woken first, which costs more than a small phase (tens of microseconds, far more when
// the machine is oversubscribed and a woken thread has to wait for a time slice). In a team the
// members are already running and meet after the phase either way: only a phase too small to
// pay for its items' crossings stays on the first member. decode_layers' attention_keeps_rows
// reads the team's (below it, a team's first member runs all).
// The same pairs cost 1-7 ns each on one thread from Zen 5's bf16 dot to an fp32-FMA scan; a
// shared-prefix group's rows leave few keys of their own, so a decode step's second phase
// (every row's own keys) often fell under the old single threshold of 16384 and ran on one
// thread: ~1.45x the attention time of a batch-8 step sharing 400 of 600 keys per row, slower
// than reading every row's keys without the group (bench/results/2026-12-01-s38-*).
struct AttentionParallelWork {
  std::atomic<int64_t> regions{4096};
  std::atomic<int64_t> team{512};
};

// The process's thresholds (benchmarks and tests change them: radixrt::attention_parallel_work,
// between calls only: a team's members each read the team's and must agree).
inline AttentionParallelWork& attention_parallel_work() {
  static AttentionParallelWork w;
  return w;
}

// Paged decode splits a row's own keys into parts (consecutive key runs, each a work item per
// KV head, merged by log-sum-exp in key order) when the batch has too few (row, KV head) items
// to keep every thread busy: one row on 3 KV heads made 3 items for 2 threads, one of which
// ran two. Only then: a part's first blocks start without the scan's prefetch and each split
// row is merged after its parts, 1.04-1.16x the CPU time of whole rows (Zen 3, fp16 pool,
// 512-4096 keys, 2-64 rows). So a split row's bits depend on the batch's size (as a cascade
// group's rows do on their group), never on the threads' timing. `min_keys`: the fewest keys
// of a part (shorter rows stay whole); `max_parts`: the most parts of a row (1: never split);
// `items_per_thread`: the items per thread below which rows split (tests raise it to split
// every long row). Benchmarks and tests change them between calls only
// (radixrt::paged_decode_row_parts): a team's members each read them and must agree
// (decode_layers' attention_keeps_rows computes the same items).
#ifndef RADIXRT_PD_PART_KEYS
#define RADIXRT_PD_PART_KEYS 256
#endif
#ifndef RADIXRT_PD_MAX_PARTS
#define RADIXRT_PD_MAX_PARTS 8
#endif
struct RowPartSettings {
  std::atomic<int64_t> min_keys{RADIXRT_PD_PART_KEYS};
  std::atomic<int64_t> max_parts{RADIXRT_PD_MAX_PARTS};
  std::atomic<int64_t> items_per_thread{2};
};

inline RowPartSettings& row_part_settings() {
  static RowPartSettings s;
  return s;
}

// Part boundaries fall on multiples of this many keys (the AVX2 scan's key block; two of the
// AVX-512 scan's), so only a row's last part has a partial block.
constexpr int64_t kRowPartAlign = 32;

// A row of `keys` own keys in `parts` parts of `len` keys (the last one shorter or equal).
struct RowSplit {
  int64_t parts, len;
  // Keys of part p.
  int64_t keys_of(int64_t p, int64_t keys) const { return std::min(len, keys - p * len); }
};

// How a row of `keys` own keys splits in a batch of `rows` rows on `kv_heads` KV heads shared
// by `threads` threads: into enough parts for items_per_thread items per thread, each of at
// least min_keys keys, at most max_parts; whole where the batch already has that many items.
inline RowSplit row_split(int64_t keys, int64_t rows, int64_t kv_heads, int64_t threads) {
  const RowPartSettings& s = row_part_settings();
  const int64_t min_keys = s.min_keys.load(std::memory_order_relaxed);
  const int64_t max_parts = s.max_parts.load(std::memory_order_relaxed);
  const int64_t items = rows * kv_heads;
  const int64_t want_items = s.items_per_thread.load(std::memory_order_relaxed) * threads;
  if (min_keys <= 0 || max_parts <= 1 || items >= want_items || keys < 2 * min_keys) {
    return {1, keys};
  }
  const int64_t want = std::min({max_parts, keys / min_keys, (want_items + items - 1) / items});
  const int64_t len = ((keys + want - 1) / want + kRowPartAlign - 1) / kRowPartAlign *
                      kRowPartAlign;
  return {(keys + len - 1) / len, len};
}

// Paged decode's items over the rows' own keys, in the order the op makes them (row by row,
// then KV head, then part: attention_keeps_rows relies on it): emit(b, h, p, keys of the part,
// the row's split) for `rows` rows of len[b] own keys.
template <typename F>
void for_each_row_item(const int64_t* len, int64_t rows, int64_t kv_heads, int64_t threads,
                       const F& emit) {
  for (int64_t b = 0; b < rows; ++b) {
    const RowSplit sp = row_split(len[b], rows, kv_heads, threads);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t p = 0; p < sp.parts; ++p) emit(b, h, p, sp.keys_of(p, len[b]), sp);
    }
  }
}

// The threshold for a phase run by the calling thread: its team's, else the regions'.
inline int64_t min_parallel_attention_work() {
  const AttentionParallelWork& w = attention_parallel_work();
  return (team_member() != nullptr ? w.team : w.regions).load(std::memory_order_relaxed);
}

// The team member (of `size`) that team_share gives an item of `cost` after items costing
// `before` in all, of `total`: the one whose equal share of the total holds the item's middle.
inline int64_t team_share_owner(int64_t before, int64_t cost, int64_t total, int64_t size) {
  // 2 * (before + cost / 2) in units of total / size, in integers
  return std::min(size - 1, (2 * before + cost) * size / (2 * std::max<int64_t>(1, total)));
}

// A team member's items [lo, hi) of `items`: item i is the member's whose equal share of the
// total cost holds the middle of i's cost, counted from the first item. Every member computes
// the same split from the same items, so no item is handed out by a shared counter (a claim is
// a cache-line round trip between the members' cores: ~0.5 us when they share no cache, ~25
// claims per decode layer). The middles rise with i, so a member's items are contiguous: in a
// decode step the (row, head) items of the rows whose queries it rotated and stored (fused_ops'
// row split).
template <typename Item>
std::pair<int64_t, int64_t> team_share(const TeamMember& m, const std::vector<Item>& items,
                                       int64_t total) {
  int64_t before = 0, lo = 0, hi = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const int64_t owner = team_share_owner(before, items[i].cost, total, m.size);
    if (owner < m.id) lo = i + 1;
    if (owner <= m.id) hi = i + 1;
    before += items[i].cost;
  }
  return {lo, std::max(lo, hi)};
}

// Runs work(item) for every item; Item has an int64_t `cost`. Items are sorted by cost,
// largest first (equal costs keep their order), except in a team (team_share). A call whose
// total cost is below `min_parallel_cost` runs on the calling thread: waking the other threads
// costs more than the work (tens of microseconds, far more when the machine is
// oversubscribed).
template <typename Item, typename F>
void run_largest_first(std::vector<Item>& items, int64_t min_parallel_cost, const F& work) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  int64_t total = 0;
  for (const Item& it : items) total += it.cost;
  if (TeamMember* m = team_member()) {  // its share (or all, on its first member), then it meets
    const bool stay = m->rows_stay;  // the caller knows the split keeps each member's rows
    m->rows_stay = false;
    if (total >= min_parallel_cost) {
      const auto [lo, hi] = team_share(*m, items, total);
      // Where the rows stay, an item another member takes reads only what this member had
      // stored before it started its share (its rows' queries and K/V), and this member
      // returns once its items all ran: the op after reads its rows' outputs.
      m->run_items(lo, hi, [&](int64_t i) { work(items[i]); });
      if (stay) return;
    } else if (m->id == 0) {
      for (const Item& it : items) work(it);
    }
    m->barrier();
    return;
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers =
      total < min_parallel_cost ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(items[i]);
  });
}

}  // namespace radixrt_cpu
