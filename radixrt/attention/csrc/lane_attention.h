// bf16 attention with query rows in vector lanes (vdpbf16ps, AVX512-BF16): the extend kernel's
// pass on CPUs with the instruction and no AMX tiles (extend_attention.cpp), and paged decode's
// pass of a large cascade group's rows over their shared prefix (paged_decode.cpp).
//
// A score vector holds one key's scores for 16 query rows, so
// - K is never converted: S = Q Kᵀ multiplies Qᵀ (packed once per work item: qt [D/2][ld], bf16
//   pairs along d) by one key's d-pair broadcast straight from its pool row;
// - the online softmax is vertical: a block's max, exp and sum run over keys for 16 rows at
//   once (no per-row horizontal reduction); running max m, sum l and alpha are per lane;
// - P is stored as bf16 pairs of consecutive keys per row (pp [keys/2][kTileRows]) and P V
//   broadcasts a row's pair against V packed in key pairs (vp [keys/2][D]), rows x D per
//   register tile.
// Every lane's arithmetic depends only on its own row and keys (key blocks start at multiples of
// kKeyBlock from key 0): outputs do not depend on which rows share a vector, an item, a chunk of
// a group or a thread.
//
// State: m is in log2 units of the scaled scores (m = max s * scale * log2 e), l = Σ 2^(s scale
// log2 e - m), o unnormalized fp32 in natural order. Where a caller keeps m in natural-log units
// (paged decode's scans), `attend_all` converts at entry and exit.

#pragma once

#include <ATen/ATen.h>

#include "fma_attention.h"
#include "vec_util.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define RADIXRT_LANE_ATTENTION 1
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace lane_attention {

// Per-thread buffers of one work item (grown to the largest): the rows' query pairs, causal
// limits and state, one block's scores, P pairs, V pairs, alphas and key / value row pointers.
// Declared in every build (callers keep one beside their other scratch).
struct Scratch {
  std::vector<uint32_t> qt, pp, vp;
  std::vector<int32_t> lim;
  std::vector<float> s, alpha, m, l, o;
  std::vector<const uint32_t*> krow;
  std::vector<const void*> vrow;
};

#ifdef RADIXRT_LANE_ATTENTION

using fma_attention::kAcc;
using fma_attention::kKeyBlock;
using fma_attention::kNegInf;
using fma_attention::kSkipPhases;
using fma_attention::kSkipPV;
using fma_attention::kSkipScores;
using fma_attention::kSkipSoftmax;
using fma_attention::kSkipVPack;
using fma_attention::largest_divisor;
using fma_attention::with_rows;

constexpr int kRowVecs = 3;                   // 16-row vectors per score tile
constexpr int64_t kTileRows = kRowVecs * 16;  // query rows per softmax / P V tile
constexpr int kTileKeys = 8;                  // keys per score register tile (3 x 8 accumulators)
static_assert(kKeyBlock % kTileKeys == 0 && kKeyBlock % 2 == 0, "key tiles split a key block");
constexpr float kLog2e = 1.4426950408889634f;

// Head dims the pass takes (whole 16-element vectors of P V, pairs of dims for the scores).
constexpr bool supports_head_dim(int64_t D) { return D >= 16 && D <= 256 && D % 16 == 0; }

// 2^x as 2^f * 2^n, x = n + f, n = round(x), |f| <= 1/2, 2^f by the polynomial with
// coefficients c (highest degree first, Horner's rule).
template <int N>
inline __m512 exp2_poly(__m512 x, const float (&c)[N]) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(c[0]);
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^x for x <= 0 (x < -126 gives 2^-126, not 0; callers mask what must be 0): degree 5,
// relative error 1.1e-7. Used for alpha, whose x is -inf while a row has seen no key.
constexpr float kExp2Deg5[] = {1.3400433e-3f, 9.6760374e-3f, 5.5503272e-2f, 2.4022107e-1f,
                               6.9314718e-1f, 1.0000001f};
inline __m512 exp2_neg(__m512 x) {
  return exp2_poly(_mm512_max_ps(x, _mm512_set1_ps(-126.f)), kExp2Deg5);
}

// 2^x for finite x (large negative x underflows to 0; +-inf or NaN give NaN: callers mask
// those lanes): degree 4, relative error 3.6e-6, far below the bf16 rounding of P (2^-9). The
// probabilities of a block, 2-3% faster than exp2_neg on the agent shapes.
constexpr float kExp2Deg4[] = {9.6760374e-3f, 5.5922035e-2f, 2.4022107e-1f, 6.9312102e-1f,
                               1.0000001f};
inline __m512 exp2_finite(__m512 x) { return exp2_poly(x, kExp2Deg4); }

// Register tiles (uint32 = one bf16 pair): qt [D/2][ld] pairs along d; key rows as in the pool
// ([D/2] pairs); st [kKeyBlock][kTileRows] fp32 scores; pp [kKeyBlock/2][kTileRows] pairs of
// consecutive keys; vp [kKeyBlock/2][D] pairs of consecutive keys per d.
template <int D>
struct Tiles {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static constexpr int DP = D / 2;
  static constexpr int C_O = largest_divisor(D / 16, 4);
  static constexpr int R_O = kAcc / C_O;

  // st[j][v * 16 + lane] = Σ_d q[row v * 16 + lane][d] k_j[d] for kTileKeys keys, V vectors.
  template <int V>
  static inline void scores(const uint32_t* qt, int64_t ld, const uint32_t* const* krow,
                            float* st) {
    __m512 acc[kTileKeys][V];
#pragma GCC unroll 8
    for (int j = 0; j < kTileKeys; ++j) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
    }
    for (int dp = 0; dp < DP; ++dp) {
      __m512bh qv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qt + dp * ld + v * 16);
#pragma GCC unroll 8
      for (int j = 0; j < kTileKeys; ++j) {
        const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(krow[j][dp]));
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], kv, qv[v]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < kTileKeys; ++j) {
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(st + j * kTileRows + v * 16, acc[j][v]);
    }
  }

  // o[r][:] = o[r][:] * alpha[r] (only when `rescale`) + Σ_{jp < np} pp[jp][r] · vp[jp][:] for
  // R rows; pp and alpha are indexed from this tile's first row, pp rows stride kTileRows.
  template <int R>
  static inline void accumulate(const uint32_t* pp, const uint32_t* vp, int64_t np,
                                const float* alpha, bool rescale, float* o) {
    for (int64_t c0 = 0; c0 < D; c0 += C_O * 16) {
      __m512 acc[R][C_O];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c0 + c * 16);
      }
      if (rescale) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
          for (int c = 0; c < C_O; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], a);
        }
      }
      for (int64_t jp = 0; jp < np; ++jp) {
        __m512bh vv[C_O];
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) {
          vv[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + c0 + c * 16);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512bh pb =
              (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp * kTileRows + r]));
#pragma GCC unroll 4
          for (int c = 0; c < C_O; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) _mm512_storeu_ps(o + r * D + c0 + c * 16, acc[r][c]);
      }
    }
  }

  // Two V rows (keys 2i, 2i+1; b may be null = zeros) interleaved into vp row i: [D] pairs.
  static inline void pack_v_pair(const at::BFloat16* a, const at::BFloat16* b, uint32_t* dst) {
    // Word 2i of the result is a[i], word 2i+1 is b[i] (index 32 + i selects b[i]).
    alignas(64) static const uint16_t kLo[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t kHi[32] = {
        16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i va = D - d >= 32 ? _mm512_loadu_si512(a + d)
                                     : _mm512_castsi256_si512(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(a + d)));
      __m512i vb = _mm512_setzero_si512();
      if (b != nullptr) {
        vb = D - d >= 32 ? _mm512_loadu_si512(b + d)
                         : _mm512_castsi256_si512(
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
      }
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(va, lo, vb));
      if (D - d >= 32) _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
};

// Calls f(std::integral_constant<int, v>) for a runtime 1 <= v <= kRowVecs.
template <typename F>
inline void with_vecs(int v, const F& f) {
  if (v == 1) return f(std::integral_constant<int, 1>{});
  if (v == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, kRowVecs>{});
}
static_assert(kRowVecs == 3, "with_vecs covers 1..3 vectors");

// A pool row of zeros: the keys that pad a block's last score tile read it.
alignas(64) inline constexpr uint32_t kZeroKeyRow[128] = {};
static_assert(sizeof(kZeroKeyRow) >= 256 * 2, "a zero row covers the largest head_dim");

// Pass::block's default hook: nothing.
struct NoHook {
  void operator()() const {}
};

// One work item's rows [0, nr) of a KV head, over key blocks given one at a time. Sizes the
// scratch; the caller then fills qt ([D/2][ld] pairs, rows past nr zero), lim (the last key
// index each row sees) and the state m / l (log2 units) / o, and sets krow / vrow per block.
template <int D>
struct Pass {
  static constexpr int64_t DP = D / 2, KP = kKeyBlock / 2;
  using Tl = Tiles<D>;
  int64_t ld;
  uint32_t* qt;
  int32_t* lim;
  float* m;
  float* l;
  float* o;
  const uint32_t** krow;
  const void** vrow;
  uint32_t* pp;
  uint32_t* vp;
  float* alpha_t;
  float* st;
  __m512 c_log2;  // scale * log2 e: a raw score to the log2 units of m

  // o == nullptr: the pass's o is the scratch's (nr x D, zeroed), else the caller's.
  Pass(Scratch& sc, int64_t nr, float scale, float* o_out = nullptr) {
    // Row tiles start anywhere below nr and read kTileRows rows of qt / lim / m / l.
    ld = (nr + 15) / 16 * 16 + kTileRows;
    sc.qt.assign(DP * ld, 0u);
    sc.m.assign(ld, kNegInf);
    sc.l.assign(ld, 0.f);
    sc.lim.assign(ld + 16, -1);
    if (o_out == nullptr) sc.o.assign(nr * D, 0.f);
    sc.alpha.resize(kTileRows);
    sc.s.resize(kKeyBlock * kTileRows);
    sc.pp.resize(KP * kTileRows);
    sc.vp.resize(KP * D);
    sc.krow.resize(kKeyBlock);
    sc.vrow.resize(kKeyBlock);
    // Raw pointers from here on (sc may be a thread_local: its address is not recomputed).
    qt = sc.qt.data();
    lim = sc.lim.data();
    m = sc.m.data();
    l = sc.l.data();
    o = o_out != nullptr ? o_out : sc.o.data();
    krow = sc.krow.data();
    vrow = sc.vrow.data();
    pp = sc.pp.data();
    vp = sc.vp.data();
    alpha_t = sc.alpha.data();
    st = sc.s.data();
    c_log2 = _mm512_set1_ps(scale * kLog2e);
  }

  // Keys j0 .. j0 + nb - 1 (rows krow / vrow [0, nb)) for rows [r_lo, r_end): V packed in pairs
  // once, then per tile of kTileRows rows the scores, the online softmax (the causal limit
  // applied per lane where some row's `lim` falls inside the block) and O = O alpha + P V.
  // after_pack() runs once the V rows are read, after_softmax() once the first tile's P is
  // stored (where a caller spreads its prefetches of later blocks: all of a block's at once
  // queue up behind each other).
  template <typename AfterPack = NoHook, typename AfterSoftmax = NoHook>
  void block(int64_t j0, int64_t nb, int64_t r_lo, int64_t r_end,
             const AfterPack& after_pack = {}, const AfterSoftmax& after_softmax = {}) const {
    alignas(64) static const uint16_t kInterleave[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    const int64_t np = (nb + 1) / 2;
    for (int64_t i = 0; i < np && !(kSkipPhases & kSkipVPack); ++i) {
      const auto* va = static_cast<const at::BFloat16*>(vrow[2 * i]);
      const auto* vbb =
          2 * i + 1 < nb ? static_cast<const at::BFloat16*>(vrow[2 * i + 1]) : nullptr;
      Tl::pack_v_pair(va, vbb, vp + i * D);
    }
    after_pack();
    for (int64_t jj = nb; jj < kKeyBlock; ++jj) krow[jj] = kZeroKeyRow;
    const int64_t nk = (nb + kTileKeys - 1) / kTileKeys * kTileKeys;
    const __m512i last_key = _mm512_set1_epi32(static_cast<int32_t>(j0 + nb - 1));
    for (int64_t r0 = r_lo; r0 < r_end; r0 += kTileRows) {
      const int nv = static_cast<int>(std::min<int64_t>(kRowVecs, (r_end - r0 + 15) / 16));
      if (!(kSkipPhases & kSkipScores)) with_vecs(nv, [&](auto vv) {
        for (int64_t jj = 0; jj < nk; jj += kTileKeys) {
          Tl::template scores<decltype(vv)::value>(qt + r0, ld, krow + jj, st + jj * kTileRows);
        }
      });
      // Online softmax, 16 rows per vector, over the block's keys.
      for (int v = 0; v < nv && !(kSkipPhases & kSkipSoftmax); ++v) {
        const int64_t r = r0 + 16 * v;
        const __mmask16 valid =
            r_end - r >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (r_end - r)) - 1);
        const __m512i limv = _mm512_loadu_si512(lim + r);
        // Causal limit inside this block for some valid row?
        const bool masked = _mm512_mask_cmplt_epi32_mask(valid, limv, last_key) != 0;
        const float* sv = st + 16 * v;
        __m512 mx = _mm512_set1_ps(kNegInf);
        if (!masked) {
          for (int64_t jj = 0; jj < nb; ++jj) {
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(sv + jj * kTileRows));
          }
        } else {
          for (int64_t jj = 0; jj < nb; ++jj) {
            const __mmask16 see =
                _mm512_cmpge_epi32_mask(limv, _mm512_set1_epi32(static_cast<int32_t>(j0 + jj)));
            mx = _mm512_mask_max_ps(mx, see, mx, _mm512_loadu_ps(sv + jj * kTileRows));
          }
        }
        const __m512 m_old = _mm512_loadu_ps(m + r);
        const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx, c_log2));
        const __m512 alpha = exp2_neg(_mm512_sub_ps(m_old, m_new));  // ~0 while m was -inf
        __m512 sum = _mm512_setzero_ps();
        for (int64_t jp = 0; jp < np; ++jp) {
          const int64_t j = 2 * jp;
          __m512 p0 =
              exp2_finite(_mm512_fmsub_ps(_mm512_loadu_ps(sv + j * kTileRows), c_log2, m_new));
          __m512 p1 = j + 1 < nb ? exp2_finite(_mm512_fmsub_ps(
                                       _mm512_loadu_ps(sv + (j + 1) * kTileRows), c_log2, m_new))
                                 : _mm512_setzero_ps();
          if (masked) {
            p0 = _mm512_maskz_mov_ps(
                _mm512_cmpge_epi32_mask(limv, _mm512_set1_epi32(static_cast<int32_t>(j0 + j))),
                p0);
            p1 = _mm512_maskz_mov_ps(
                _mm512_cmpge_epi32_mask(limv,
                                        _mm512_set1_epi32(static_cast<int32_t>(j0 + j + 1))),
                p1);
          }
          sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);
          const __m512i pair =
              _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
          _mm512_storeu_si512(pp + jp * kTileRows + 16 * v, pair);
        }
        const __m512 l_new = _mm512_fmadd_ps(_mm512_loadu_ps(l + r), alpha, sum);
        _mm512_mask_storeu_ps(m + r, valid, m_new);
        _mm512_mask_storeu_ps(l + r, valid, l_new);
        _mm512_storeu_ps(alpha_t + 16 * v, alpha);
      }
      if (r0 == r_lo) after_softmax();
      const int64_t r1 = std::min(r_end, r0 + kTileRows);
      for (int64_t ra = r0; ra < r1 && !(kSkipPhases & kSkipPV); ra += Tl::R_O) {
        const int64_t rr = ra - r0;
        const int n = static_cast<int>(std::min<int64_t>(Tl::R_O, r1 - ra));
        bool rescale = false;
        for (int i = 0; i < n; ++i) rescale |= alpha_t[rr + i] != 1.f;
        with_rows<Tl::R_O>(n, [&](auto rows) {
          Tl::template accumulate<decltype(rows)::value>(pp + rr, vp, np, alpha_t + rr, rescale,
                                                         o + ra * D);
        });
      }
    }
  }
};

#ifndef RADIXRT_LANE_PREFETCH_BLOCKS
#define RADIXRT_LANE_PREFETCH_BLOCKS 2
#endif
// Blocks ahead whose K and V rows attend_all starts fetching while a block is computed.
constexpr int64_t kPrefetchBlocks = RADIXRT_LANE_PREFETCH_BLOCKS;

// prefetch_row where the compiler may not move or drop it: GCC 12 compiled attend_all's
// __builtin_prefetch loops into code 1.5x slower from memory than with none (one group item over
// 4096 keys), while these, issued where written, ran as fast as the hardware prefetcher alone
// on contiguous slots (and fetch scattered ones ahead).
inline void fetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) asm volatile("prefetcht2 %0" : : "m"(c[off]));
}

// Continues the state (m[r], l[r] with m in natural-log units of the scaled scores, o[r, :]
// unnormalized fp32) of the nq bf16 queries q[r, :] (unscaled) over keys 0..key_end of one KV
// head, every row seeing every key: paged decode's cascade group over its shared prefix. Key j
// is the pool row at kbase / vbase + slot_of(j) * slot_stride (a valid slot).
template <int D, typename SlotOf>
void attend_all(const at::BFloat16* q, int64_t nq, float scale, int64_t key_end,
                const SlotOf& slot_of, const at::BFloat16* kbase, const at::BFloat16* vbase,
                int64_t slot_stride, float* m, float* l, float* o, Scratch& sc) {
  static_assert(supports_head_dim(D), "rows-in-lanes attention: head_dim a multiple of 16");
  const Pass<D> pass(sc, nq, scale, o);
  const auto* q32 = reinterpret_cast<const uint32_t*>(q);
  for (int64_t r = 0; r < nq; ++r) {
    for (int64_t dp = 0; dp < Pass<D>::DP; ++dp) pass.qt[dp * pass.ld + r] = q32[r * D / 2 + dp];
    pass.lim[r] = static_cast<int32_t>(key_end - 1);
    pass.m[r] = m[r] * kLog2e;  // -inf stays -inf
    pass.l[r] = l[r];
  }
  auto row = [&](const at::BFloat16* base, int64_t j) { return base + slot_of(j) * slot_stride; };
  constexpr int64_t kRowBytes = D * sizeof(at::BFloat16);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - j0);
    // The first blocks' rows before the first; then the rows kPrefetchBlocks blocks ahead, K
    // once this block's V is packed, V once its first scores are through the softmax.
    const int64_t pf_end = std::min(key_end, j0 + (kPrefetchBlocks + 1) * kKeyBlock);
    const int64_t pf0 = j0 == 0 ? pf_end : j0 + kPrefetchBlocks * kKeyBlock;
    for (int64_t j = 0; j0 == 0 && j < pf_end; ++j) {
      fetch_row(row(kbase, j), kRowBytes);
      fetch_row(row(vbase, j), kRowBytes);
    }
    for (int64_t jj = 0; jj < nb; ++jj) {
      pass.krow[jj] = reinterpret_cast<const uint32_t*>(row(kbase, j0 + jj));
      pass.vrow[jj] = row(vbase, j0 + jj);
    }
    pass.block(
        j0, nb, 0, nq,
        [&] {
          for (int64_t j = pf0; j < pf_end; ++j) fetch_row(row(kbase, j), kRowBytes);
        },
        [&] {
          for (int64_t j = pf0; j < pf_end; ++j) fetch_row(row(vbase, j), kRowBytes);
        });
  }
  for (int64_t r = 0; r < nq; ++r) {
    m[r] = pass.m[r] / kLog2e;
    l[r] = pass.l[r];
  }
}

#else

constexpr bool supports_head_dim(int64_t) { return false; }

#endif  // RADIXRT_LANE_ATTENTION

}  // namespace lane_attention
}  // namespace radixrt_cpu
