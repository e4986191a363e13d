// bf16 attention blocks for dot-product tiles: one 64-key block of a KV head's K and V packed
// in the pair layout that TDPBF16PS (AMX) and vdpbf16ps (AVX512-BF16) take, and the online
// softmax of a tile of score rows straight to bf16 P: amx_attention.h's blocks (the extend
// kernel's AMX path packs them ahead for several parts of a request).
//
// Packed block (kBlockPack<D> bf16 elements): K first, for head-dim chunk c (32 dims) and key
// tile t (16 keys) a 16 x 32 bf16 tile whose row i holds dims (2i, 2i + 1) of the tile's 16 keys
// (lane = key); then V, for key tile u (32 keys) and dim tile d (16 dims) a 16 x 32 tile whose
// row i holds keys (2i, 2i + 1) of the 16 dims (lane = dim). Keys past a block's real ones are
// zeros.

#pragma once

#include <ATen/ATen.h>

#include "fma_attention.h"

#include <cmath>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define RADIXRT_BF16_BLOCKS 1
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace bf16_blocks {

#ifdef RADIXRT_BF16_BLOCKS

using fma_attention::kKeyBlock;
using fma_attention::kNegInf;
static_assert(kKeyBlock == 64, "four 16-key score tiles and two 32-key value tiles per block");

// K rows of keys j0 .. j0 + 63 (nb real, zeros after) -> B tiles of S = Q Kᵀ: for head-dim chunk
// c (32 dims) and key tile t (16 keys), row i holds dims (2i, 2i + 1) of the tile's 16 keys.
template <int D, typename RowOf>
inline void pack_k(const RowOf& row_of, int64_t nb, uint16_t* out) {
  for (int t = 0; t < 4; ++t) {
    for (int c = 0; c < D / 32; ++c) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t j = t * 16 + i;
        r[i] = j < nb ? _mm512_castsi512_ps(_mm512_loadu_si512(row_of(j) + c * 32))
                      : _mm512_setzero_ps();
      }
      fma_attention::transpose16(r);
      uint16_t* tile = out + (c * 4 + t) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + i * 32, r[i]);
    }
  }
}

// V rows of keys j0 .. j0 + 63 (nb real, zeros after) -> B tiles of O += P V: for key tile u
// (32 keys) and dim tile d (16 dims), row i holds keys (2i, 2i + 1) of each of the 16 dims.
template <int D, typename RowOf>
inline void pack_v(const RowOf& row_of, int64_t nb, uint16_t* out) {
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int u = 0; u < 2; ++u) {
    for (int i = 0; i < 16; ++i) {
      const int64_t j = u * 32 + 2 * i;
      for (int c = 0; c < D / 32; ++c) {
        const __m512i x = j < nb ? _mm512_loadu_si512(row_of(j) + c * 32) : _mm512_setzero_si512();
        const __m512i y =
            j + 1 < nb ? _mm512_loadu_si512(row_of(j + 1) + c * 32) : _mm512_setzero_si512();
        const __m512i a = _mm512_unpacklo_epi16(x, y), b = _mm512_unpackhi_epi16(x, y);
        // dims 32c + 0..15 and 32c + 16..31 of the pair, in order
        _mm512_storeu_si512(out + ((u * (D / 16) + 2 * c) * 16 + i) * 32,
                            _mm512_permutex2var_epi64(a, lo_idx, b));
        _mm512_storeu_si512(out + ((u * (D / 16) + 2 * c + 1) * 16 + i) * 32,
                            _mm512_permutex2var_epi64(a, hi_idx, b));
      }
    }
  }
}

// bf16 elements of one 64-key block's packed K and V (pack_block's output).
template <int D>
constexpr int64_t kBlockPack = 2 * kKeyBlock * D;

// Keys j0 .. j0 + 63 of one KV head (nb real, zeros after) packed as pack_k, then pack_v.
template <int D, typename KRow, typename VRow>
inline void pack_block(const KRow& krow, const VRow& vrow, int64_t nb, uint16_t* out) {
  pack_k<D>(krow, nb, out);
  pack_v<D>(vrow, nb, out + kKeyBlock * D);
}

// The first k lanes of a vector (all for k >= 16, none for k <= 0).
inline __mmask16 first_lanes(int64_t k) {
  return k >= 16 ? 0xFFFF : k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1u);
}

// How far a block's maximum may exceed a row's running max m before m moves to it (natural-log
// units): below it m stays, p = exp(s scale - m) reaches up to e^8 (fp32 sums and bf16 P hold
// that at the same relative precision) and the row's O needs no rescaling (alpha = 1). A row's
// max settles after its first blocks, so most tiles skip the rescale pass over O (it had taken
// ~20% of a 512-token prefill's attention). Whether m moves depends only on the row's own
// scores: results stay batch-invariant.
constexpr float kMaxSlack = 8.f;

// The online softmax of one row tile (n <= 16 rows of unscaled fp32 scores s, stride
// kKeyBlock; row i's first visible[i] >= 1 entries real) in two passes, straight to bf16 P
// (rows past n: zeros): the rows' raw maxima, m_new = raw max * scale where it exceeds m by more
// than kMaxSlack (or m is -inf), else m (a positive scale keeps the order, so the same bits as
// the maximum of the scaled scores), alpha = exp(m - m_new), then p = exp2_poly5(s * scale
// log2(e) - m_new log2(e)) (the exponent in one fused rounding) on the visible entries, summed
// into l and stored rounded to bf16. Returns whether any row's m moved (else every alpha is 1).
// On the AMX Xeon (stop 67) exp2_poly5 in place of exp_u20 took a 512-token prefill's
// attention from 20.3-21.0 to 16.8-18.3 ms (bench/extend_steps.py profile).
inline bool softmax_to_p16(const float* s, int n, const int64_t* visible, float scale, float* m,
                           float* l, float* alpha, uint16_t* p) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 part[16];
  for (int i = 0; i < 16; ++i) {
    part[i] = neg_inf;
    if (i >= n) continue;
    for (int c = 0; c < 4; ++c) {
      part[i] = _mm512_mask_max_ps(part[i], first_lanes(visible[i] - 16 * c), part[i],
                                   _mm512_loadu_ps(s + i * kKeyBlock + 16 * c));
    }
  }
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1u);
  const __m512 raw_max = fma_attention::transpose_reduce16(part, [](__m512 a, __m512 b) {
    return _mm512_max_ps(a, b);
  });
  alignas(64) float m_new[16];
  const __m512 m_old = _mm512_mask_loadu_ps(neg_inf, rows, m);
  const __m512 block_max = _mm512_mul_ps(raw_max, _mm512_set1_ps(scale));
  // -inf + slack is -inf: a row's first block always moves m
  const __mmask16 moved = _mm512_mask_cmp_ps_mask(
      rows, block_max, _mm512_add_ps(m_old, _mm512_set1_ps(kMaxSlack)), _CMP_GT_OQ);
  _mm512_store_ps(m_new, _mm512_mask_blend_ps(moved, m_old, block_max));
  for (int i = 0; i < n; ++i) {
    alpha[i] = (moved >> i) & 1 ? std::exp(m[i] - m_new[i]) : 1.f;  // 0 while m is -inf
    m[i] = m_new[i];
  }
  // p = 2^(s scale log2(e) - m log2(e)): one fused rounding forms the exponent.
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e);
  for (int i = 0; i < 16; ++i) {
    uint16_t* prow = p + i * kKeyBlock;
    if (i >= n) {
      part[i] = _mm512_setzero_ps();
      _mm512_storeu_si512(prow, _mm512_setzero_si512());
      _mm512_storeu_si512(prow + 32, _mm512_setzero_si512());
      continue;
    }
    const __m512 vm = _mm512_set1_ps(m_new[i] * kLog2e);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; c += 2) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const __mmask16 real = first_lanes(visible[i] - 16 * (c + h));
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + i * kKeyBlock + 16 * (c + h)),
                                         vscale, vm);
        e[h] = _mm512_maskz_mov_ps(real, exp2_poly5(x));
        sum = _mm512_add_ps(sum, e[h]);
      }
      _mm512_storeu_si512(prow + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    part[i] = sum;
  }
  const __m512 sums = fma_attention::transpose_reduce16(part, [](__m512 a, __m512 b) {
    return _mm512_add_ps(a, b);
  });
  alignas(64) float lsum[16];
  _mm512_store_ps(lsum, sums);
  for (int i = 0; i < n; ++i) l[i] = l[i] * alpha[i] + lsum[i];
  return moved != 0;
}

#endif  // RADIXRT_BF16_BLOCKS

}  // namespace bf16_blocks
}  // namespace radixrt_cpu
