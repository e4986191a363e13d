// radixrt::decode_batch_rows: the index tensors of a CPU decode step's ForwardBatch
// (radixrt/core/forward_batch.py, `_build_decode_cpu`) in one call, from the step's ids, request
// rows and prefix lengths and the request-to-token table. The same values and dtypes as the
// numpy build beside it (tested equal); what it saves is that build's dozen numpy and torch
// calls, which run right after the previous step has streamed ~150 MB through the caches and
// cost ~180 us there (~75 us this way).
//
//   decode_batch_rows(ids int[B], rows int[B], prefix int[B], table int32 [R, W])
//     -> (longs int64 [8, B], ints int32 [3, B + 1], kv_indices int32 [sum(prefix + 1)])
//
// longs rows: input_ids, positions (= prefix), req_pool_indices, seq_lens (= prefix + 1),
// extend_lens (1), out_cache_loc (table[row, prefix]), logits_indices (0..B-1), prefix_lens.
// ints rows: qo_indptr (0..B), kv_indptr (0, then the running sum of seq_lens), ones.
// kv_indices: each row's table[row, :prefix + 1], rows in order.

#include <torch_headers.h>  // first: precompiled by the build

#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace radixrt_cpu {
namespace {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor> decode_batch_rows(c10::IntArrayRef ids, c10::IntArrayRef rows,
                                                     c10::IntArrayRef prefix,
                                                     const Tensor& table) {
  const int64_t bs = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(ids.size()) == bs && static_cast<int64_t>(prefix.size()) == bs,
              "decode_batch_rows: ids, rows and prefix must have one entry per request, got ",
              ids.size(), ", ", rows.size(), " and ", prefix.size());
  TORCH_CHECK(table.device().is_cpu() && table.dim() == 2 && table.scalar_type() == at::kInt &&
                  table.stride(1) == 1,
              "decode_batch_rows: table must be a CPU int32 [rows, width] tensor, contiguous in "
              "its last dimension");
  const int64_t num_rows = table.size(0), width = table.size(1), ld = table.stride(0);
  int64_t total = 0;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < num_rows, "decode_batch_rows: row ", rows[b],
                " out of range [0, ", num_rows, ")");
    TORCH_CHECK(prefix[b] >= 0 && prefix[b] < width, "decode_batch_rows: prefix ", prefix[b],
                " out of range [0, ", width, ")");
    total += prefix[b] + 1;
  }
  TORCH_CHECK(total <= std::numeric_limits<int32_t>::max(),
              "decode_batch_rows: kv_indptr must fit int32");
  Tensor longs = at::empty({8, bs}, at::kLong);
  Tensor ints = at::empty({3, bs + 1}, at::kInt);
  Tensor kv = at::empty({total}, at::kInt);
  int64_t* l = longs.data_ptr<int64_t>();
  int32_t* qo = ints.data_ptr<int32_t>();
  int32_t* indptr = qo + (bs + 1);
  int32_t* ones = indptr + (bs + 1);
  int32_t* out = kv.data_ptr<int32_t>();
  const int32_t* tp = table.data_ptr<int32_t>();
  int64_t off = 0;
  indptr[0] = 0;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t p = prefix[b];
    const int32_t* row = tp + rows[b] * ld;
    l[b] = ids[b];
    l[bs + b] = p;
    l[2 * bs + b] = rows[b];
    l[3 * bs + b] = p + 1;
    l[4 * bs + b] = 1;
    l[5 * bs + b] = row[p];
    l[6 * bs + b] = b;
    l[7 * bs + b] = p;
    std::memcpy(out + off, row, static_cast<size_t>(p + 1) * sizeof(int32_t));
    off += p + 1;
    qo[b] = static_cast<int32_t>(b);
    indptr[b + 1] = static_cast<int32_t>(off);
    ones[b] = 1;
  }
  qo[bs] = static_cast<int32_t>(bs);
  ones[bs] = 1;
  return {longs, ints, kv};
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def(
      "decode_batch_rows(int[] ids, int[] rows, int[] prefix, Tensor table) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("decode_batch_rows", &radixrt_cpu::decode_batch_rows);
}
