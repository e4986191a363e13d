// fp32 FMA attention over blocks of 64 keys for any number of query rows: the extend kernel's
// fp32 path per work item (extend_attention.cpp) and, on pools without a dot-product
// instruction, paged decode's pass of a shared-prefix group's rows over their prefix
// (paged_decode.cpp), where the group's many queries amortize the block's conversion.
//
// `attend` continues each query row's online-softmax state (running max m, sum l, unnormalized
// output o, fp32) over keys 0..n of one KV head, read in place from the pool rows `slot_of(j)`:
// per block the keys are converted to fp32 once (K transposed, V row-major), then register-tiled
// S = Q Kᵀ, a row-wise online softmax (the causal limit applied per row inside the blocks that
// cross it) and O = O alpha + P V. Queries come in fp32, already multiplied by the softmax
// scale. A row's arithmetic depends only on its own query and keys (blocks start at multiples of
// kKeyBlock from key 0), never on the other rows, the thread or the call.

#pragma once

#include <ATen/ATen.h>

#include "vec_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace fma_attention {

constexpr int64_t kKeyBlock = 64;  // keys per block
static_assert(kKeyBlock % kVec == 0, "key block must be a whole number of vectors");
// Vector accumulators a micro-kernel tile keeps in registers (32 zmm / 16 ymm registers).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAcc = 24;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kAcc = 12;
#else
constexpr int kAcc = 8;
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Largest divisor of n that is <= cap.
constexpr int largest_divisor(int n, int cap) {
  for (int c = cap; c > 1; --c) {
    if (n % c == 0) return c;
  }
  return 1;
}


// Calls f(std::integral_constant<int, r>) for a runtime 1 <= r <= R.
template <int R, typename F>
inline void with_rows(int r, const F& f) {
  if constexpr (R > 1) {
    if (r < R) return with_rows<R - 1>(r, f);
  }
  f(std::integral_constant<int, R>{});
}


template <int D>
struct Tiles {
  static_assert(D % kVec == 0, "head_dim must be a whole number of vectors");
  // Scores: R_S query rows x C_S key vectors per tile.
  static constexpr int C_S = largest_divisor(kKeyBlock / kVec, 4);
  static constexpr int R_S = kAcc / C_S;
  // Output: R_O query rows x C_O head_dim vectors per tile.
  static constexpr int C_O = largest_divisor(D / kVec, 4);
  static constexpr int R_O = kAcc / C_O;

  // s[r][:] = q[r][:] · kt[:][j] for R rows; q rows stride D, s rows stride kKeyBlock.
  template <int R>
  static inline void scores(const float* q, const float* kt, float* s) {
    for (int64_t c0 = 0; c0 < kKeyBlock; c0 += C_S * kVec) {
      Vec acc[R][C_S];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_S; ++c) acc[r][c] = Vec(0.f);
      }
      for (int d = 0; d < D; ++d) {
        Vec kv[C_S];
#pragma GCC unroll 4
        for (int c = 0; c < C_S; ++c) kv[c] = Vec::loadu(kt + d * kKeyBlock + c0 + c * kVec);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const Vec qb(q[r * D + d]);
#pragma GCC unroll 4
          for (int c = 0; c < C_S; ++c) acc[r][c] = at::vec::fmadd(qb, kv[c], acc[r][c]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_S; ++c) acc[r][c].store(s + r * kKeyBlock + c0 + c * kVec);
      }
    }
  }

  // o[r][:] = o[r][:] * alpha[r] + Σ_{j < nb} p[r][j] vp[j][:] for R rows.
  template <int R>
  static inline void accumulate(const float* p, const float* vp, int64_t nb, const float* alpha,
                                float* o) {
    for (int64_t c0 = 0; c0 < D; c0 += C_O * kVec) {
      Vec acc[R][C_O];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec a(alpha[r]);
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) acc[r][c] = Vec::loadu(o + r * D + c0 + c * kVec) * a;
      }
      for (int64_t j = 0; j < nb; ++j) {
        Vec vv[C_O];
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) vv[c] = Vec::loadu(vp + j * D + c0 + c * kVec);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const Vec pb(p[r * kKeyBlock + j]);
#pragma GCC unroll 4
          for (int c = 0; c < C_O; ++c) acc[r][c] = at::vec::fmadd(pb, vv[c], acc[r][c]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) acc[r][c].store(o + r * D + c0 + c * kVec);
      }
    }
  }
};


// Phase costs (`bench/attention_kernel.py extend-phases`): RADIXRT_EXT_SKIP_PHASES compiles the
// phases of this bit mask out of either path ("V packing": the fp32 path's K/V block
// conversion), leaving wrong results and the time of the rest.
#ifndef RADIXRT_EXT_SKIP_PHASES
#define RADIXRT_EXT_SKIP_PHASES 0
#endif
constexpr int kSkipScores = 1, kSkipSoftmax = 2, kSkipPV = 4, kSkipVPack = 8;
constexpr int kSkipPhases = RADIXRT_EXT_SKIP_PHASES;

// Online-softmax step of one score row (kKeyBlock entries, `visible` >= 1 of them real):
// s masked past `visible`; new running max m, alpha = exp(m_old - m), s becomes the
// probabilities exp(s - m), l = l * alpha + Σ s.
inline void softmax_row(float* s, int64_t visible, float& m, float& l, float& alpha) {
  for (int64_t jj = visible; jj < kKeyBlock; ++jj) s[jj] = kNegInf;
  Vec mx = Vec::loadu(s);
  for (int64_t c = kVec; c < kKeyBlock; c += kVec) mx = at::vec::maximum(mx, Vec::loadu(s + c));
  const float m_new = std::max(m, hmax(mx));
  alpha = std::exp(m - m_new);  // 0 while m is -inf
  const Vec vm(m_new);
  Vec sum(0.f);
  for (int64_t c = 0; c < kKeyBlock; c += kVec) {
    const Vec p = (Vec::loadu(s + c) - vm).exp_u20();  // exp(-inf) = 0
    p.store(s + c);
    sum = sum + p;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
}


#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// One vector register of the build's width (Vec's), for the rows-at-once softmax and the K
// block transposition below.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
#else
using Reg = __m256;
#endif
static_assert(sizeof(Reg) == kVec * sizeof(float), "Reg holds one Vec");

// The second half of softmax_rows16 / softmax_rows8 on n <= kVec score rows (stride
// kKeyBlock): alpha = exp(m_old - m_new) and m = m_new for each row, the row's entries become
// exp(s - m_new), and part[i] gets row i's vector of partial sums (zeros past n).
inline void probabilities(float* s, int n, const float* m_old, const float* m_new, float* m,
                          float* alpha, Reg* part) {
  for (int i = 0; i < n; ++i) {
    alpha[i] = std::exp(m_old[i] - m_new[i]);  // 0 while m is -inf
    m[i] = m_new[i];
  }
  for (int i = 0; i < kVec; ++i) {
    if (i >= n) {
      part[i] = static_cast<Reg>(Vec(0.f));
      continue;
    }
    float* row = s + i * kKeyBlock;
    const Vec vm(m_new[i]);
    Vec sum(0.f);
    for (int c = 0; c < kKeyBlock; c += kVec) {
      const Vec p = (Vec::loadu(row + c) - vm).exp_u20();  // exp(-inf) = 0
      p.store(row + c);
      sum = sum + p;
    }
    part[i] = static_cast<Reg>(sum);
  }
}
#endif


#if defined(CPU_CAPABILITY_AVX512)
// Transpose-reduce of 16 vectors: lane i of the result is op over the lanes of v[i] (pairs of
// vectors, then quads, then 128-bit lanes twice: 15 combines instead of 16 horizontal
// reductions).
template <typename Op>
inline __m512 transpose_reduce16(const __m512* v, const Op& op) {
  __m512 pair[8], quad[4], half[2];
  for (int i = 0; i < 8; ++i) {
    pair[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(pair[2 * i]), y = _mm512_castps_pd(pair[2 * i + 1]);
    quad[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    half[i] = op(_mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0x88),
                 _mm512_shuffle_f32x4(quad[2 * i], quad[2 * i + 1], 0xDD));
  }
  return op(_mm512_shuffle_f32x4(half[0], half[1], 0x88),
            _mm512_shuffle_f32x4(half[0], half[1], 0xDD));
}

// r[i] = row i of a 16 x 16 block -> r[j] = its column j (lane i = row i's lane j): pairs of
// rows interleaved, then quads, then 128-bit lanes twice.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4q + e], 128-bit lane L: element 4L + e of rows 4q .. 4q + 3
  for (int q = 0; q < 16; q += 4) {
    for (int e = 0; e < 2; ++e) {
      const __m512d x = _mm512_castps_pd(t[q + e]), y = _mm512_castps_pd(t[q + 2 + e]);
      r[q + 2 * e] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
      r[q + 2 * e + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 u0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
    const __m512 v0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 u1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_f32x4(u0, u1, 0x88);
    t[4 + e] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    t[8 + e] = _mm512_shuffle_f32x4(u0, u1, 0xDD);
    t[12 + e] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

inline void transpose_square(__m512* r) { transpose16(r); }

// softmax_row on n <= 16 rows (stride kKeyBlock, row i's first visible[i] >= 1 entries real):
// the rows' maxima and sums reduced together (transpose_reduce16) instead of one horizontal
// reduction each. The same m and alpha bits as softmax_row; l sums a row's probabilities in
// another order.
inline void softmax_rows16(float* s, int n, const int64_t* visible, float* m, float* l,
                           float* alpha) {
  static_assert(kKeyBlock == 64, "four vectors per score row");
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 part[16];
  for (int i = 0; i < 16; ++i) {
    if (i >= n) {
      part[i] = neg_inf;
      continue;
    }
    float* row = s + i * kKeyBlock;
    __m512 mx = neg_inf;
    for (int c = 0; c < 4; ++c) {
      const int64_t k = visible[i] - 16 * c;  // real entries in this vector
      __m512 v = _mm512_loadu_ps(row + 16 * c);
      if (k < 16) {
        const __mmask16 real = k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1u);
        v = _mm512_mask_mov_ps(neg_inf, real, v);
        _mm512_storeu_ps(row + 16 * c, v);
      }
      mx = _mm512_max_ps(mx, v);
    }
    part[i] = mx;
  }
  const __mmask16 rows = static_cast<__mmask16>((1u << n) - 1u);
  const __m512 row_max = transpose_reduce16(part, [](__m512 a, __m512 b) {
    return _mm512_max_ps(a, b);
  });
  alignas(64) float m_old[16], m_new[16];
  _mm512_store_ps(m_old, _mm512_mask_loadu_ps(neg_inf, rows, m));
  _mm512_store_ps(m_new, _mm512_max_ps(_mm512_load_ps(m_old), row_max));
  probabilities(s, n, m_old, m_new, m, alpha, part);
  const __m512 sums = transpose_reduce16(part, [](__m512 a, __m512 b) {
    return _mm512_add_ps(a, b);
  });
  alignas(64) float lsum[16];
  _mm512_store_ps(lsum, sums);
  for (int i = 0; i < n; ++i) l[i] = l[i] * alpha[i] + lsum[i];
}
#elif defined(CPU_CAPABILITY_AVX2)
// Transpose-reduce of 8 vectors: lane i of the result is op over the lanes of v[i] (pairs of
// vectors, then quads, then the two 128-bit lanes: 7 combines instead of 8 horizontal
// reductions). Every lane combines its vector's elements in the same tree, whichever i it is.
template <typename Op>
inline __m256 transpose_reduce8(const __m256* v, const Op& op) {
  __m256 pair[4], quad[2];
  for (int i = 0; i < 4; ++i) {
    pair[i] = op(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                 _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(pair[2 * i]), y = _mm256_castps_pd(pair[2 * i + 1]);
    quad[i] = op(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                 _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return op(_mm256_permute2f128_ps(quad[0], quad[1], 0x20),
            _mm256_permute2f128_ps(quad[0], quad[1], 0x31));
}

// r[i] = row i of an 8 x 8 block -> r[j] = its column j (lane i = row i's lane j).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4h + j]: rows 4h .. 4h + 3 of column j (low 128-bit lane) and column j + 4 (high).
  for (int h = 0; h < 2; ++h) {
    const __m256* a = t + 4 * h;
    u[4 * h] = _mm256_shuffle_ps(a[0], a[2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(a[0], a[2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(a[1], a[3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(a[1], a[3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[j + 4] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

inline void transpose_square(__m256* r) { transpose8(r); }

// softmax_row on n <= 8 rows (stride kKeyBlock, row i's first visible[i] >= 1 entries real):
// the rows' maxima and sums reduced together (transpose_reduce8), so the rows' dependency
// chains overlap. The same m and alpha bits as softmax_row; l sums a row's probabilities in
// another order (the same for every row, wherever it sits among the 8).
inline void softmax_rows8(float* s, int n, const int64_t* visible, float* m, float* l,
                          float* alpha) {
  static_assert(kKeyBlock == 64, "eight vectors per score row");
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 part[8];
  for (int i = 0; i < 8; ++i) {
    if (i >= n) {
      part[i] = neg_inf;
      continue;
    }
    float* row = s + i * kKeyBlock;
    __m256 mx = neg_inf;
    for (int c = 0; c < 8; ++c) {
      const int64_t k = visible[i] - 8 * c;  // real entries in this vector
      __m256 v = _mm256_loadu_ps(row + 8 * c);
      if (k < 8) {
        const __m256i real = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(static_cast<int32_t>(std::max<int64_t>(k, 0))), iota);
        v = _mm256_blendv_ps(neg_inf, v, _mm256_castsi256_ps(real));
        _mm256_storeu_ps(row + 8 * c, v);
      }
      mx = _mm256_max_ps(mx, v);
    }
    part[i] = mx;
  }
  const __m256 row_max = transpose_reduce8(part, [](__m256 a, __m256 b) {
    return _mm256_max_ps(a, b);
  });
  alignas(32) float m_old[8], m_new[8];
  for (int i = 0; i < 8; ++i) m_old[i] = i < n ? m[i] : kNegInf;
  _mm256_store_ps(m_new, _mm256_max_ps(_mm256_load_ps(m_old), row_max));
  probabilities(s, n, m_old, m_new, m, alpha, part);
  const __m256 sums = transpose_reduce8(part, [](__m256 a, __m256 b) {
    return _mm256_add_ps(a, b);
  });
  alignas(32) float lsum[8];
  _mm256_store_ps(lsum, sums);
  for (int i = 0; i < n; ++i) l[i] = l[i] * alpha[i] + lsum[i];
}
#endif


// The per-thread buffers of `attend` (grown to the largest call): scores, transposed K and
// row-major V of a block, per-row alpha.
struct Scratch {
  std::vector<float> s, kt, vp, alpha;
};

// Continues the state (m[r], l[r], o[r, :]) of the nq scaled fp32 queries q[r, :] over keys
// 0..key_end of one KV head: key j is the pool row at kbase / vbase + slot_of(j) * slot_stride
// (a valid slot). Block j0's rows below row_lo(j0) see none of its keys and are skipped;
// visible_keys(r, j0, nb) >= 1 is how many of its nb keys row r >= row_lo(j0) sees.
template <typename T, int D, typename SlotOf, typename RowLo, typename VisibleKeys>
void attend(const float* q, int64_t nq, int64_t key_end, const SlotOf& slot_of,
            const RowLo& row_lo, const VisibleKeys& visible_keys, const T* kbase,
            const T* vbase, int64_t slot_stride, float* m, float* l, float* o, Scratch& sc) {
  using Tl = Tiles<D>;
  sc.s.resize(nq * kKeyBlock);
  sc.kt.resize(D * kKeyBlock);
  sc.vp.resize(kKeyBlock * D);
  sc.alpha.resize(nq);
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
  alignas(64) float krow[D];
#endif
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, key_end - j0);
    // Convert the block to fp32: K transposed (keys past nb zero), V row-major.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    // kVec keys at a time: each kVec-dim chunk of their rows transposed in registers.
    for (int64_t g0 = 0; g0 < kKeyBlock && !(kSkipPhases & kSkipVPack); g0 += kVec) {
      const T* kr[kVec];
      const int real = static_cast<int>(std::clamp<int64_t>(nb - g0, 0, kVec));
      for (int i = 0; i < real; ++i) {
        const int64_t slot = slot_of(j0 + g0 + i);
        kr[i] = kbase + slot * slot_stride;
        const T* vr = vbase + slot * slot_stride;
        for (int64_t c = 0; c < D; c += kVec) {
          load_f32<T>(vr + c).store(sc.vp.data() + (g0 + i) * D + c);
        }
      }
      for (int64_t c = 0; c < D; c += kVec) {
        Reg rows[kVec];
        for (int i = 0; i < kVec; ++i) {
          rows[i] = static_cast<Reg>(i < real ? Vec(load_f32<T>(kr[i] + c)) : Vec(0.f));
        }
        transpose_square(rows);
        for (int d = 0; d < kVec; ++d) {
          Vec(rows[d]).store(sc.kt.data() + (c + d) * kKeyBlock + g0);
        }
      }
    }
#else
    for (int64_t jj = 0; jj < nb && !(kSkipPhases & kSkipVPack); ++jj) {
      const int64_t slot = slot_of(j0 + jj);
      const T* kr = kbase + slot * slot_stride;
      const T* vr = vbase + slot * slot_stride;
      for (int64_t c = 0; c < D; c += kVec) {
        load_f32<T>(kr + c).store(krow + c);
        load_f32<T>(vr + c).store(sc.vp.data() + jj * D + c);
      }
      for (int64_t d = 0; d < D; ++d) sc.kt[d * kKeyBlock + jj] = krow[d];
    }
    for (int64_t jj = nb; jj < kKeyBlock; ++jj) {
      for (int64_t d = 0; d < D; ++d) sc.kt[d * kKeyBlock + jj] = 0.f;
    }
#endif
    const int64_t r_lo = row_lo(j0);
    if (r_lo >= nq) continue;
    for (int64_t r0 = r_lo; r0 < nq && !(kSkipPhases & kSkipScores); r0 += Tl::R_S) {
      with_rows<Tl::R_S>(static_cast<int>(std::min<int64_t>(Tl::R_S, nq - r0)), [&](auto rr) {
        Tl::template scores<decltype(rr)::value>(q + r0 * D, sc.kt.data(),
                                                 sc.s.data() + r0 * kKeyBlock);
      });
    }
    // Causal limit, online softmax: probabilities in place, alpha rescales the old rows.
#if defined(CPU_CAPABILITY_AVX512)
    for (int64_t r0 = r_lo; r0 < nq && !(kSkipPhases & kSkipSoftmax); r0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, nq - r0));
      int64_t visible[16];
      for (int i = 0; i < n; ++i) {
        visible[i] = visible_keys(r0 + i, j0, nb);
      }
      softmax_rows16(sc.s.data() + r0 * kKeyBlock, n, visible, m + r0,
                     l + r0, sc.alpha.data() + r0);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    for (int64_t r0 = r_lo; r0 < nq && !(kSkipPhases & kSkipSoftmax); r0 += 8) {
      const int n = static_cast<int>(std::min<int64_t>(8, nq - r0));
      int64_t visible[8];
      for (int i = 0; i < n; ++i) {
        visible[i] = visible_keys(r0 + i, j0, nb);
      }
      softmax_rows8(sc.s.data() + r0 * kKeyBlock, n, visible, m + r0, l + r0,
                    sc.alpha.data() + r0);
    }
#else
    for (int64_t r = r_lo; r < nq && !(kSkipPhases & kSkipSoftmax); ++r) {
      softmax_row(sc.s.data() + r * kKeyBlock, visible_keys(r, j0, nb), m[r], l[r],
                  sc.alpha[r]);
    }
#endif
    for (int64_t r0 = r_lo; r0 < nq && !(kSkipPhases & kSkipPV); r0 += Tl::R_O) {
      with_rows<Tl::R_O>(static_cast<int>(std::min<int64_t>(Tl::R_O, nq - r0)), [&](auto rr) {
        Tl::template accumulate<decltype(rr)::value>(
            sc.s.data() + r0 * kKeyBlock, sc.vp.data(), nb, sc.alpha.data() + r0,
            o + r0 * D);
      });
    }
  }
}

}  // namespace fma_attention
}  // namespace radixrt_cpu
