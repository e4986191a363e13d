// One decode row's keys on AMX tiles (TDPBF16PS): the paged-decode scan of a (row, KV head)
// item of a bf16 pool, its few query heads (the GQA group: 1-4) against the row's own keys,
// for CPUs with AMX-BF16 (paged_decode.cpp's KeyScan::run takes it where amx_usable() and the
// row has kAmxRowsMinKeys own keys or more).
//
// The vdpbf16ps scan spends most of its instructions on arithmetic that tiles do in bulk: per
// key and query two dot products and a share of a 16-way transpose-reduce, and per key pair the
// P V dot products of every query. Here, per block of 32 keys:
// - Sᵀ = K Qᵀ: the key rows are the A tiles as the pool holds them (a block whose slots are one
//   run of slots is read in place, row stride = the pool's slot stride; other blocks are copied
//   first), Qᵀ the B tile (the queries' bf16 pairs, made once per call). So K is never
//   transposed or packed. Products exact, sums fp32 (in TDPBF16PS's order), scaled in fp32.
// - Sᵀ's columns (one per query) are read out with two-source permutes, and each query's online
//   softmax runs over the block as in the scan (running max once per block, exp2_poly5).
// - O += P V: P rounded to bf16 (as the scan's vdpbf16ps P V does) in an A tile, the V rows of
//   keys 2i and 2i + 1 interleaved by unpacklo / unpackhi_epi16 (the scan's pair layout) into
//   the B tiles; O's rows stay fp32 in memory, in that pair layout (the caller converts).
// - The K and V rows `ahead_keys` keys ahead are prefetched, spread over the V packing.
// A query's arithmetic depends only on its own query, its keys and the state passed in: never
// on the batch, the thread or the call (batch-invariant). Requires amx_usable() and
// supports(D, nq); the caller takes the scan otherwise.

#pragma once

#include "amx_tiles.h"
#include "vec_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(RADIXRT_AMX_TILES) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(CPU_CAPABILITY_AVX512)
#define RADIXRT_AMX_DECODE 1
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace amx_decode {

constexpr int64_t kKeys = 32;       // keys per block (one P tile row: 32 bf16)
constexpr int64_t kMaxQueries = 4;  // Sᵀ's columns of a 16-key half fit four vectors
constexpr int64_t kMaxDim = 128;

// Head dims and query counts the tiles take.
constexpr bool supports(int64_t D, int64_t nq) {
  return D % 32 == 0 && D <= kMaxDim && nq >= 1 && nq <= kMaxQueries;
}

#ifdef RADIXRT_AMX_DECODE

// Per-thread buffers, all small enough for L1 (zero-initialized: thread storage).
struct Scratch {
  alignas(64) uint32_t bq[kMaxDim / 32][16][kMaxQueries];  // Qᵀ per 32-dim chunk (bf16 pairs)
  alignas(64) float s[2 * 16 * kMaxQueries + 64];          // Sᵀ, key-major, + read slack
  alignas(64) uint16_t p[kMaxQueries][kKeys];              // P in bf16
  alignas(64) uint16_t v[kMaxDim / 16][16][32];            // V pairs: D/16 B tiles
  alignas(64) uint16_t k[kKeys][kMaxDim];                  // a block's K rows, copied
  alignas(64) uint16_t zero[kMaxDim];                      // padding rows (p = 0 there)
};

// The tiles: 0 Sᵀ (16 keys x nq fp32), 1 K (16 keys x 32 dims), 2 Qᵀ (16 dim pairs x nq),
// 3 P (nq x 32 keys), 4 V pairs (16 key pairs x 16 dims), 5 O (nq x 16 dims).
// TileConfig's 16 x 64 bytes, but for Sᵀ and Qᵀ (nq columns) and P and O (nq rows).
struct DecodeTiles : TileConfig {
  explicit DecodeTiles(int nq) {
    colsb[0] = colsb[2] = static_cast<uint16_t>(4 * nq);
    rows[3] = rows[5] = static_cast<uint8_t>(nq);
  }
};

// Whether idx[0..32) is one run of slots (idx[0], idx[0] + 1, ...).
inline bool one_run(const int32_t* idx) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i first = _mm512_add_epi32(_mm512_set1_epi32(idx[0]), iota);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(16));
  return _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(idx), first) == 0xFFFF &&
         _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(idx + 16), second) == 0xFFFF;
}

// Query t's scores of one 16-key half from Sᵀ stored key-major (s[j * nq + t]).
inline __m512 column(const float* s, int nq, int t) {
  const __m512i idx = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(nq)),
      _mm512_set1_epi32(t));
  const __m512 lo = _mm512_permutex2var_ps(_mm512_loadu_ps(s), idx, _mm512_loadu_ps(s + 16));
  if (nq <= 2) return lo;
  const __m512 hi = _mm512_permutex2var_ps(_mm512_loadu_ps(s + 32), idx, _mm512_loadu_ps(s + 48));
  return _mm512_mask_mov_ps(lo, _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32)), hi);
}

// Continues the state (m[t], l[t], o[t, :]) of the nq bf16 queries q[t, :] (unscaled; the fp32
// scores are multiplied by `scale`) over keys idx[0..n) (valid slots) of one KV head: key j is
// the pool row at kbase / vbase + idx[j] * stride. o rows are fp32 in the scan's pair layout
// (row stride D). m is in scaled-score units, l the sum of exp(score - m). Requires
// amx_usable() and supports(D, nq).
template <int D>
void scan(const at::BFloat16* q, int nq, const int32_t* idx, int64_t n, float scale,
          const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t stride, float* m, float* l,
          float* o, int64_t ahead_keys, bool l1) {
  static_assert(supports(D, 1), "AMX decode: head_dim a multiple of 32, at most 128");
  thread_local Scratch sc;
  const auto* qh = reinterpret_cast<const uint32_t*>(q);
  for (int c = 0; c < D / 32; ++c) {
    for (int r = 0; r < 16; ++r) {
      for (int t = 0; t < nq; ++t) sc.bq[c][r][t] = qh[t * (D / 2) + 16 * c + r];
    }
  }
  const auto* kb16 = reinterpret_cast<const uint16_t*>(kbase);
  const auto* vb16 = reinterpret_cast<const uint16_t*>(vbase);
  const int64_t qstride = 4 * nq;
  const DecodeTiles cfg(nq);
  _tile_loadconfig(&cfg);
  float mx[kMaxQueries];
  __m512 lv[kMaxQueries];
  for (int t = 0; t < nq; ++t) {
    mx[t] = m[t];
    lv[t] = _mm512_maskz_mov_ps(1, _mm512_castps128_ps512(_mm_set_ss(l[t])));
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int nb = static_cast<int>(std::min<int64_t>(kKeys, n - j0));
    // K: in place where the block is one run of slots, else copied (zero rows past nb)
    const uint16_t* krows;
    int64_t kstride;  // elements
    if (nb == kKeys && one_run(idx + j0)) {
      krows = kb16 + static_cast<int64_t>(idx[j0]) * stride;
      kstride = stride;
    } else {
      for (int jj = 0; jj < kKeys; ++jj) {
        const uint16_t* src = jj < nb ? kb16 + static_cast<int64_t>(idx[j0 + jj]) * stride : sc.zero;
        std::memcpy(sc.k[jj], src, D * sizeof(uint16_t));
      }
      krows = sc.k[0];
      kstride = kMaxDim;
    }
    // Sᵀ = K Qᵀ, a 16-key half at a time (the second only where it has keys)
    const int halves = nb > 16 ? 2 : 1;
    for (int h = 0; h < halves; ++h) {
      _tile_zero(0);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(1, krows + 16 * h * kstride + 32 * c, kstride * 2);
        _tile_loadd(2, sc.bq[c], 4 * kMaxQueries);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sc.s + 16 * nq * h, qstride);
    }
    // the online softmax per query, P rounded to bf16
    const __mmask16 valid0 = static_cast<__mmask16>(nb >= 16 ? 0xFFFFu : (1u << nb) - 1u);
    const __mmask16 valid1 =
        static_cast<__mmask16>(nb >= 32 ? 0xFFFFu : nb > 16 ? (1u << (nb - 16)) - 1u : 0u);
    for (int t = 0; t < nq; ++t) {
      const __m512 s0 = _mm512_mask_mul_ps(neg_inf, valid0, column(sc.s, nq, t), vscale);
      const __m512 s1 = halves > 1
                            ? _mm512_mask_mul_ps(neg_inf, valid1, column(sc.s + 16 * nq, nq, t), vscale)
                            : neg_inf;
      const float bmax = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      if (bmax > mx[t]) {
        const float alpha = std::exp(mx[t] - bmax);  // 0 while mx is -inf
        const __m512 va = _mm512_set1_ps(alpha);
        lv[t] = _mm512_mul_ps(lv[t], va);
        float* orow = o + t * D;
        for (int c = 0; c < D; c += 16) {
          _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), va));
        }
        mx[t] = bmax;
      }
      const __m512 mv = _mm512_set1_ps(mx[t]);
      const __m512 p0 = exp_masked(valid0, _mm512_sub_ps(s0, mv));
      const __m512 p1 = exp_masked(valid1, _mm512_sub_ps(s1, mv));
      lv[t] = _mm512_add_ps(lv[t], _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(sc.p[t], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    // V rows of key pairs interleaved into the B tiles; the rows ahead prefetched meanwhile
    const int64_t pf0 = j0 + ahead_keys;
    const int npf = ahead_keys > 0 ? static_cast<int>(std::max<int64_t>(
                                         0, std::min<int64_t>(n, pf0 + kKeys) - pf0))
                                   : 0;
    for (int i = 0; i < 16; ++i) {
      for (int e = 2 * i; e < 2 * i + 2 && e < npf; ++e) {
        const int64_t off = static_cast<int64_t>(idx[pf0 + e]) * stride;
        prefetch_row(kb16 + off, D * 2, l1);
        prefetch_row(vb16 + off, D * 2, l1);
      }
      const uint16_t* va = 2 * i < nb ? vb16 + static_cast<int64_t>(idx[j0 + 2 * i]) * stride
                                      : sc.zero;
      const uint16_t* vb = 2 * i + 1 < nb
                               ? vb16 + static_cast<int64_t>(idx[j0 + 2 * i + 1]) * stride
                               : sc.zero;
      for (int c = 0; c < D / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(va + 32 * c);
        const __m512i y = _mm512_loadu_si512(vb + 32 * c);
        _mm512_store_si512(sc.v[2 * c][i], _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(sc.v[2 * c + 1][i], _mm512_unpackhi_epi16(x, y));
      }
    }
    // O += P V, 16 (pair-layout) dims at a time
    _tile_loadd(3, sc.p, 2 * kKeys);
    for (int d = 0; d < D / 16; ++d) {
      _tile_loadd(5, o + 16 * d, D * 4);
      _tile_loadd(4, sc.v[d], 64);
      _tile_dpbf16ps(5, 3, 4);
      _tile_stored(5, o + 16 * d, D * 4);
    }
  }
  _tile_release();
  for (int t = 0; t < nq; ++t) {
    m[t] = mx[t];
    l[t] = _mm512_reduce_add_ps(lv[t]);
  }
}

#endif  // RADIXRT_AMX_DECODE

}  // namespace amx_decode
}  // namespace radixrt_cpu
