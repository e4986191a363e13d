// radixrt::paged_decode_plan: a decode step's paged-attention plan (radixrt/attention/
// paged_decode.py, PagedDecodePlan) from its kv_indices / kv_indptr in one call: the shared-prefix
// groups of radixrt/attention/cascade.py `shared_prefix_groups`, then the plan's row and group
// tensors. The same rules and order as the Python pair (tested against it), without its dozen
// small tensor ops: run once per step right after the previous step has streamed ~150 MB through
// the caches, those ops cost ~100 us cold.
//
//   paged_decode_plan(kv_indices int32 [N], kv_indptr int32 [B + 1], min_shared)
//     -> (row_start, row_len, group_start, group_len, group_row_ptr, group_rows), all int64
//
// Row b's slots are kv_indices[kv_indptr[b] : kv_indptr[b + 1]]. Groups: rows longer than
// `min_shared` keyed by their slot at position min_shared - 1 (slot 0, the pool's dummy, keys
// nothing), keys in order of first appearance, rows ascending; a key with >= 2 rows shares the
// leading slots all its rows agree on, below the shortest row's length, and is a group when
// that is >= min_shared. A grouped row's own keys start after its group's prefix.

#include <torch_headers.h>  // first: precompiled by the build

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace radixrt_cpu {
namespace {

using at::Tensor;

Tensor longs(const std::vector<int64_t>& v) {
  Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> paged_decode_plan(
    const Tensor& kv_indices, const Tensor& kv_indptr, int64_t min_shared) {
  TORCH_CHECK(kv_indices.dim() == 1 && kv_indices.scalar_type() == at::kInt,
              "paged_decode_plan: kv_indices must be 1-D int32");
  TORCH_CHECK(kv_indptr.dim() == 1 && kv_indptr.numel() >= 1 &&
                  kv_indptr.scalar_type() == at::kInt,
              "paged_decode_plan: kv_indptr must be 1-D int32 with B + 1 entries");
  TORCH_CHECK(min_shared >= 1, "paged_decode_plan: min_shared must be >= 1, got ", min_shared);
  const Tensor idx = kv_indices.contiguous(), ptr = kv_indptr.contiguous();
  const int32_t* kv = idx.data_ptr<int32_t>();
  const int32_t* ip = ptr.data_ptr<int32_t>();
  const int64_t rows = ptr.numel() - 1, n = idx.numel();
  std::vector<int64_t> start(rows), len(rows);
  for (int64_t b = 0; b < rows; ++b) {
    TORCH_CHECK(ip[b] >= 0 && ip[b] <= ip[b + 1] && ip[b + 1] <= n,
                "paged_decode_plan: kv_indptr must rise from 0 within kv_indices, at row ", b);
    start[b] = ip[b];
    len[b] = ip[b + 1] - ip[b];
  }

  // Candidate rows by key, keys in order of first appearance.
  std::vector<std::pair<int32_t, std::vector<int64_t>>> by_key;
  std::unordered_map<int32_t, size_t> slot_of;
  int64_t candidates = 0;
  for (int64_t b = 0; b < rows; ++b) candidates += len[b] > min_shared;
  if (candidates >= 2) {
    for (int64_t b = 0; b < rows; ++b) {
      if (len[b] <= min_shared) continue;
      const int32_t key = kv[start[b] + min_shared - 1];
      if (key == 0) continue;
      const auto [it, fresh] = slot_of.try_emplace(key, by_key.size());
      if (fresh) by_key.push_back({key, {}});
      by_key[it->second].second.push_back(b);
    }
  }
  std::vector<int64_t> g_start, g_len, g_ptr{0}, g_rows;
  for (const auto& [key, members] : by_key) {
    if (members.size() < 2) continue;
    int64_t limit = len[members[0]];
    for (const int64_t b : members) limit = std::min(limit, len[b]);
    limit -= 1;
    if (limit < min_shared) continue;
    const int32_t* first = kv + start[members[0]];
    int64_t shared = limit;
    for (size_t m = 1; m < members.size(); ++m) {
      const int32_t* other = kv + start[members[m]];
      int64_t c = 0;
      while (c < shared && other[c] == first[c]) ++c;
      shared = c;
    }
    if (shared < min_shared) continue;
    g_start.push_back(start[members[0]]);
    g_len.push_back(shared);
    g_rows.insert(g_rows.end(), members.begin(), members.end());
    g_ptr.push_back(static_cast<int64_t>(g_rows.size()));
  }
  for (size_t g = 0; g + 1 < g_ptr.size(); ++g) {
    for (int64_t i = g_ptr[g]; i < g_ptr[g + 1]; ++i) {
      start[g_rows[i]] += g_len[g];
      len[g_rows[i]] -= g_len[g];
    }
  }
  return {longs(start), longs(len), longs(g_start), longs(g_len), longs(g_ptr), longs(g_rows)};
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def(
      "paged_decode_plan(Tensor kv_indices, Tensor kv_indptr, int min_shared) -> (Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("paged_decode_plan", &radixrt_cpu::paged_decode_plan);
}
