// bf16 attention over blocks of 64 keys in vector registers (vdpbf16ps, AVX512-BF16): the
// same work items, state and packed blocks as amx_attention.h, for CPUs that have the
// instruction but no AMX tiles (Zen 4, Zen 5, Xeons before Sapphire Rapids). Paged decode runs
// a large cascade group's pass over its shared prefix here (paged_decode.cpp), where the
// group's many queries share each block's packing.
//
// `attend` continues each query row's online-softmax state (running max m, sum l, unnormalized
// output o, fp32) over keys 0..key_end of one KV head, read in place from the pool rows
// `slot_of(j)`. Per block of 64 keys:
// - K and V are packed once for all of the item's rows (bf16_blocks::pack_block: keys of K in
//   vector lanes, pairs of head dims per vector; V in pairs of keys, dims in lanes);
// - S = Q Kᵀ in register tiles of kScoreRows rows x 64 keys: per pair of head dims, one
//   vdpbf16ps per (row, 16 keys) with the row's pair broadcast (bf16 queries as given, exact
//   products, fp32 sums; no reduction across lanes), then scaled by `scale` in fp32;
// - the row-wise online softmax straight to bf16 P (bf16_blocks::softmax_to_p16, as the AMX
//   path: the running max moves only past kMaxSlack, the causal limit applied per row);
// - O = O alpha + P V in register tiles of kOutRows rows x 64 dims: per pair of keys, one
//   vdpbf16ps per (row, 16 dims) with the row's pair of probabilities broadcast.
// A row's arithmetic depends only on its own query and keys (blocks start at multiples of
// kKeyBlock from key 0; a register tile's rows never mix), never on the other rows, the tile
// sizes, the thread or the call.

#pragma once

#include <ATen/ATen.h>

#include "bf16_blocks.h"
#include "fma_attention.h"
#include "vec_util.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace radixrt_cpu {
namespace dpbf16_attention {

// Per-thread buffers (grown to the largest call): fp32 scores and bf16 P of the rows (P with a
// whole 16-row tile of room past the last row), one block's packed K and V, per-row alpha.
// Declared in every build (callers keep one beside their other scratch).
struct Scratch {
  std::vector<uint16_t> p, k;
  std::vector<float> s, alpha;
};

#ifdef RADIXRT_BF16_BLOCKS
#define RADIXRT_DPBF16_ATTENTION 1

using fma_attention::kKeyBlock;
using fma_attention::with_rows;

// Head dims: whole 32-element chunks (the packed blocks' tiles).
constexpr bool supports_head_dim(int64_t D) { return D >= 32 && D <= 256 && D % 32 == 0; }

// Register tiles: rows x 4 vectors of accumulators (24 of the 32 zmm registers), beside the 4
// loaded K or V vectors and a broadcast.
constexpr int kScoreRows = 6;
constexpr int kOutRows = 6;
#ifndef RADIXRT_DOT_PREFETCH_BLOCKS
#define RADIXRT_DOT_PREFETCH_BLOCKS 2
#endif
constexpr int64_t kPrefetchBlocks = RADIXRT_DOT_PREFETCH_BLOCKS;

// The 32-bit pair at bf16 element e of row (e even), broadcast to every lane.
inline __m512bh pair_at(const uint16_t* row, int64_t e) {
  int32_t v;
  std::memcpy(&v, row + e, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// s[r][0..64) = q[r] · keys of the packed block (fp32, unscaled) for R rows; q rows of D bf16,
// s rows of kKeyBlock floats.
template <int D, int R>
inline void scores(const uint16_t* q, const uint16_t* kp, float* s) {
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int c = 0; c < D / 32; ++c) {
#pragma GCC unroll 2
    for (int i = 0; i < 16; ++i) {
      __m512bh kv[4];
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        kv[t] = (__m512bh)_mm512_loadu_si512(kp + (c * 4 + t) * 512 + i * 32);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = pair_at(q + r * D, c * 32 + 2 * i);
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], qb, kv[t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + r * kKeyBlock + 16 * t, acc[r][t]);
  }
}

// o[r][16 d0 .. 16 (d0 + W)) = o[r][...] * alpha[r] + p[r] · V of the packed block, for R rows
// (o rows of D floats, p rows of kKeyBlock bf16; keys past the block's real ones have p = 0).
template <int D, int R, int W>
inline void accumulate(const uint16_t* p, const uint16_t* vp, const float* alpha, float* o,
                       int d0) {
  __m512 acc[R][W];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) {
      acc[r][w] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (d0 + w) * 16), a);
    }
  }
  for (int u = 0; u < 2; ++u) {
#pragma GCC unroll 2
    for (int i = 0; i < 16; ++i) {
      __m512bh vv[W];
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) {
        vv[w] = (__m512bh)_mm512_loadu_si512(vp + ((u * (D / 16) + d0 + w) * 16 + i) * 32);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512bh pb = pair_at(p + r * kKeyBlock, u * 32 + 2 * i);
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], pb, vv[w]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + r * D + (d0 + w) * 16, acc[r][w]);
  }
}

// Continues the state (m[r], l[r], o[r, :]) of the nq bf16 queries q[r, :] (unscaled: the fp32
// scores are multiplied by `scale`) over keys 0..key_end of one KV head. Key j is the pool row
// at kbase / vbase + slot_of(j) * slot_stride (a valid slot). Block j0's rows below row_lo(j0)
// see none of its keys and are skipped; visible_keys(r, j0, nb) >= 1 is how many of its nb keys
// row r >= row_lo(j0) sees (keys a row does not see get p = 0).
template <int D, typename SlotOf, typename RowLo, typename VisibleKeys>
void attend(const at::BFloat16* q, int64_t nq, float scale, int64_t key_end,
            const SlotOf& slot_of, const RowLo& row_lo, const VisibleKeys& visible_keys,
            const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t slot_stride, float* m,
            float* l, float* o, Scratch& sc) {
  static_assert(supports_head_dim(D), "vdpbf16ps attention: head_dim a multiple of 32, <= 256");
  sc.s.resize(nq * kKeyBlock);
  sc.p.resize((nq + 16) * kKeyBlock);  // softmax_to_p16 writes whole 16-row tiles
  sc.k.resize(bf16_blocks::kBlockPack<D>);
  sc.alpha.resize(nq + 16);
  const uint16_t* qh = reinterpret_cast<const uint16_t*>(q);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - j0);
    const int64_t r_lo = row_lo(j0);
    if (r_lo >= nq) continue;
    // The rows kPrefetchBlocks blocks ahead start on their way from memory while this one is
    // computed: K before the scores, V before P V (the first blocks' all before the first).
    const int64_t pf_end = std::min(key_end, j0 + (kPrefetchBlocks + 1) * kKeyBlock);
    const int64_t pf0 = j0 == 0 ? pf_end : j0 + kPrefetchBlocks * kKeyBlock;
    for (int64_t j = 0; j0 == 0 && j < pf_end; ++j) {
      prefetch_row(kbase + slot_of(j) * slot_stride, D * sizeof(at::BFloat16));
      prefetch_row(vbase + slot_of(j) * slot_stride, D * sizeof(at::BFloat16));
    }
    bf16_blocks::pack_block<D>(
        [&](int64_t jj) {
          return reinterpret_cast<const uint16_t*>(kbase + slot_of(j0 + jj) * slot_stride);
        },
        [&](int64_t jj) {
          return reinterpret_cast<const uint16_t*>(vbase + slot_of(j0 + jj) * slot_stride);
        },
        nb, sc.k.data());
    for (int64_t j = pf0; j < pf_end; ++j) {
      prefetch_row(kbase + slot_of(j) * slot_stride, D * sizeof(at::BFloat16));
    }
    const uint16_t* kp = sc.k.data();
    const uint16_t* vp = kp + kKeyBlock * D;
    for (int64_t r0 = r_lo; r0 < nq; r0 += kScoreRows) {
      with_rows<kScoreRows>(static_cast<int>(std::min<int64_t>(kScoreRows, nq - r0)),
                            [&](auto rr) {
                              scores<D, decltype(rr)::value>(qh + r0 * D, kp,
                                                             sc.s.data() + r0 * kKeyBlock);
                            });
    }
    for (int64_t r0 = r_lo; r0 < nq; r0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, nq - r0));
      int64_t visible[16];
      for (int i = 0; i < n; ++i) visible[i] = visible_keys(r0 + i, j0, nb);
      // alpha is 1 for rows whose max stayed: O * 1 keeps its bits, so no branch below
      bf16_blocks::softmax_to_p16(sc.s.data() + r0 * kKeyBlock, n, visible, scale, m + r0,
                                  l + r0, sc.alpha.data() + r0, sc.p.data() + r0 * kKeyBlock);
    }
    for (int64_t j = pf0; j < pf_end; ++j) {
      prefetch_row(vbase + slot_of(j) * slot_stride, D * sizeof(at::BFloat16));
    }
    for (int64_t r0 = r_lo; r0 < nq; r0 += kOutRows) {
      with_rows<kOutRows>(static_cast<int>(std::min<int64_t>(kOutRows, nq - r0)), [&](auto rr) {
        constexpr int R = decltype(rr)::value;
        const uint16_t* p = sc.p.data() + r0 * kKeyBlock;
        const float* alpha = sc.alpha.data() + r0;
        float* orow = o + r0 * D;
        int d0 = 0;
        for (; d0 + 4 <= D / 16; d0 += 4) accumulate<D, R, 4>(p, vp, alpha, orow, d0);
        if constexpr (D % 64 == 32) accumulate<D, R, 2>(p, vp, alpha, orow, d0);
      });
    }
  }
}

#else

constexpr bool supports_head_dim(int64_t) { return false; }

#endif  // RADIXRT_BF16_BLOCKS

}  // namespace dpbf16_attention
}  // namespace radixrt_cpu
