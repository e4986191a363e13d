// Work queue shared by radixrt's CPU attention kernels (paged_decode.cpp, extend_attention.cpp):
// independent items of uneven cost run on torch's intra-op threads, largest first, each thread
// taking the next item when it finishes one (so a few long items do not leave threads idle).
// In a decode team (team.h) the team's members take the items and meet when all are done.

#pragma once

#include <ATen/Parallel.h>

#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace radixrt_cpu {

// Runs work(item) for every item; Item has an int64_t `cost`. Items are sorted by cost,
// largest first (equal costs keep their order). A call whose total cost is below
// `min_parallel_cost` runs on the calling thread: waking the other threads costs more than the
// work (tens of microseconds, far more when the machine is oversubscribed).
template <typename Item, typename F>
void run_largest_first(std::vector<Item>& items, int64_t min_parallel_cost, const F& work) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  int64_t total = 0;
  for (const Item& it : items) total += it.cost;
  if (TeamMember* m = team_member()) {  // the team's queue (or its first member), then it meets
    if (total >= min_parallel_cost) {
      m->share(n, [&](int64_t i) { work(items[i]); });
    } else if (m->id == 0) {
      for (const Item& it : items) work(it);
    }
    m->barrier();
    return;
  }
  std::atomic<int64_t> next{0};
  const int64_t workers =
      total < min_parallel_cost ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(items[i]);
  });
}

}  // namespace radixrt_cpu
