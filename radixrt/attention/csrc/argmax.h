// Row argmax shared by radixrt's CPU kernels: argmax.cpp (argmax_rows over whole rows) and the
// matmuls that pick greedy ids while they compute logits (qgemm_vnni.cpp, qgemv.cpp: each
// thread over the columns it wrote; amx_linear.cpp: over its fp32 sums, never stored; the
// threads' picks merged after the call).
//
// Order (torch.argmax's): the largest value, the lowest index among equals; a row holding a NaN
// gives its first NaN. It is a total order on (value, index) pairs, so picks over column ranges
// merged in any order give the whole row's index.

#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include "vec_util.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixrt_cpu {

template <typename T>
inline int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(static_cast<float>(x[i]))) return i;
  }
  return -1;
}

// Vector chains of row_argmax: vectors 4j + c go to chain c, so four compare-and-blend chains
// run side by side instead of one (one chain is bound by its compare -> blend latency: ~3 GB/s
// per thread on Zen 5; four read at memory speed).
constexpr int64_t kArgmaxChains = 4;

template <typename T>
inline int64_t row_argmax(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  int64_t i = 0;
  if (n >= kArgmaxChains * kVec) {
    alignas(64) float lane_idx[kVec];
    for (int64_t l = 0; l < kVec; ++l) lane_idx[l] = static_cast<float>(l);
    const Vec lanes = Vec::loadu(lane_idx);
    Vec vmax[kArgmaxChains], vidx[kArgmaxChains], off[kArgmaxChains];
    Vec nan_seen(0.f);
    for (int64_t c = 0; c < kArgmaxChains; ++c) {
      off[c] = lanes + Vec(static_cast<float>(c * kVec));
      vmax[c] = load_f32<T>(x + c * kVec);
      vidx[c] = off[c];
      nan_seen = nan_seen | (vmax[c] != vmax[c]);
    }
    // Within a chain and lane, indices only grow and only a strictly greater value replaces:
    // each lane holds the first position of its maximum.
    auto visit = [&](int64_t c, int64_t at) {
      const Vec v = load_f32<T>(x + at);
      const Vec gt = v > vmax[c];
      vmax[c] = Vec::blendv(vmax[c], v, gt);
      vidx[c] = Vec::blendv(vidx[c], lanes + Vec(static_cast<float>(at)), gt);
      nan_seen = nan_seen | (v != v);
    };
    for (i = kArgmaxChains * kVec; i + kArgmaxChains * kVec <= n; i += kArgmaxChains * kVec) {
      for (int64_t c = 0; c < kArgmaxChains; ++c) visit(c, i + c * kVec);
    }
    for (int64_t c = 0; i + kVec <= n; ++c, i += kVec) visit(c, i);  // whole vectors left
    alignas(64) float nn[kVec];
    nan_seen.store(nn);
    for (int64_t l = 0; l < kVec; ++l) {
      uint32_t bits;
      std::memcpy(&bits, &nn[l], sizeof(bits));
      if (bits != 0) return first_nan(x, n);
    }
    // Every (chain, lane) candidate: the largest value, the lowest index among equals.
    for (int64_t c = 0; c < kArgmaxChains; ++c) {
      alignas(64) float m[kVec], ix[kVec];
      vmax[c].store(m);
      vidx[c].store(ix);
      for (int64_t l = 0; l < kVec; ++l) {
        const int64_t li = static_cast<int64_t>(ix[l]);
        if (m[l] > best || (m[l] == best && li < best_i)) {
          best = m[l];
          best_i = li;
        }
      }
    }
  } else if (n > 0) {
    best = static_cast<float>(x[0]);
    if (std::isnan(best)) return 0;
    i = 1;
  }
  for (; i < n; ++i) {  // the tail: later than every vector index, so only strictly greater wins
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) {
      best = v;
      best_i = i;
    }
  }
  return best_i;
}

// One row's pick over a range of its columns: the value at `column` and, where the range holds
// a NaN, the first one (`first_nan`); `column` -1: the range was not visited.
struct RowPick {
  float value = 0.f;
  int64_t column = -1;
  int64_t first_nan = -1;

  // The index the order above gives (the first NaN, else the column).
  int64_t index() const { return first_nan >= 0 ? first_nan : column; }
};

// a merged with b (either may be unvisited).
inline RowPick merge_picks(RowPick a, const RowPick& b) {
  if (b.column < 0) return a;
  if (a.column < 0) return b;
  if (b.first_nan >= 0 && (a.first_nan < 0 || b.first_nan < a.first_nan)) a.first_nan = b.first_nan;
  if (b.value > a.value || (b.value == a.value && b.column < a.column)) {
    a.value = b.value;
    a.column = b.column;
  }
  return a;
}

// The pick of x[c0, c1) (c0 < c1; column indices as in the whole row): row_argmax over the
// range, whose index is the range's first NaN when it holds one.
template <typename T>
inline RowPick range_pick(const T* x, int64_t c0, int64_t c1) {
  const int64_t i = row_argmax(x + c0, c1 - c0);
  RowPick p;
  p.value = static_cast<float>(x[c0 + i]);
  p.column = c0 + i;
  if (std::isnan(p.value)) {
    p.first_nan = c0 + i;
    p.value = -std::numeric_limits<float>::infinity();
    // the range's largest non-NaN value is not needed: the row's answer is a NaN
  }
  return p;
}

// The RowPick of a run's n lanes (lane l: its largest value m[l], first reaching it at column
// ix[l]) and the row's first NaN (-1: none): the largest value, the lowest column among equals.
inline RowPick reduce_lanes(const float* m, const int32_t* ix, int64_t n, int64_t first_nan) {
  RowPick p;
  p.value = m[0];
  p.column = ix[0];
  for (int64_t l = 1; l < n; ++l) {
    if (m[l] > p.value || (m[l] == p.value && ix[l] < p.column)) {
      p.value = m[l];
      p.column = ix[l];
    }
  }
  p.first_nan = first_nan;
  return p;
}

#if defined(__AVX512F__)
// One row's 16 lanes over the columns a run has visited, in increasing column order: each lane
// keeps its largest value and the first column reaching it (only a strictly greater value
// replaces), and the row its first NaN; `reduce` gives the run's RowPick.
struct LanePick16 {
  __m512 vmax;
  __m512i vidx;
  int64_t first_nan = -1;
  bool started = false;

  void visit(const float* y, int32_t column) { visit(_mm512_loadu_ps(y), column); }

  // Columns column .. column + 15 holding v.
  void visit(__m512 v, int32_t column) {
    const __m512i idx =
        _mm512_add_epi32(_mm512_set1_epi32(column),
                         _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan != 0 && first_nan < 0) first_nan = column + __builtin_ctz(nan);
    if (!started) {
      vmax = v;
      vidx = idx;
      started = true;
      return;
    }
    const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
    vmax = _mm512_mask_mov_ps(vmax, gt, v);
    vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
  }

  RowPick reduce() const {
    if (!started) return RowPick{};
    alignas(64) float m[16];
    alignas(64) int32_t ix[16];
    _mm512_store_ps(m, vmax);
    _mm512_store_si512(ix, vidx);
    return reduce_lanes(m, ix, 16, first_nan);
  }
};
#endif  // __AVX512F__

// The picks of one call: each run claims a slot of `runs` (at most `slots` runs) and fills the
// rows it computed.
struct Picks {
  int64_t m = 0, slots = 0;
  std::vector<RowPick> runs;  // [slots, m]
  std::atomic<int64_t> claimed{0};
  const char* op;  // named in errors

  Picks(int64_t rows, int64_t max_runs, const char* op_name)
      : m(rows), slots(max_runs), runs(static_cast<size_t>(rows * max_runs)), op(op_name) {}

  // A run's slot (raises past `slots`).
  int64_t claim() {
    const int64_t slot = claimed.fetch_add(1, std::memory_order_acq_rel);
    TORCH_CHECK(slot < slots, op, ": more runs than threads");
    return slot;
  }

  // Each row's index into `out` (int64 [m]).
  void finish(int64_t* out) const {
    const int64_t n = std::min(claimed.load(std::memory_order_acquire), slots);
    for (int64_t r = 0; r < m; ++r) {
      RowPick p;
      for (int64_t s = 0; s < n; ++s) p = merge_picks(p, runs[s * m + r]);
      TORCH_CHECK(p.column >= 0, op, ": row ", r, " was not computed");
      out[r] = p.index();
    }
  }
};

}  // namespace radixrt_cpu
