// Extend (prefill) attention on CPU, read in place from radixrt's KV pool.
//
// Request b has P_b = kv_indptr[b+1] - kv_indptr[b] cached keys (pool slots
// kv_indices[kv_indptr[b]:...]) and E_b = qo_indptr[b+1] - qo_indptr[b] new tokens, whose K/V
// are already in the pool at slots loc[qo_indptr[b]:...]. Key j of the request is the prefix
// slot j for j < P_b, else the new slot j - P_b. Query i (token qo_indptr[b] + i) sees keys
// 0..P_b + i: the causal limit is offset by the prefix length. Nothing is gathered and no mask
// tensor exists: the limit is applied per row inside the key blocks that cross it.
//
// Flash-style: a work item is (request, KV head, block of query tokens); its queries are the
// block's tokens x the G query heads of the KV head (GQA folded: every K/V read serves G heads).
// Keys go in blocks of kKeyBlock: a block is converted to fp32 once per item (K transposed to
// [D][kKeyBlock], V as [kKeyBlock][D]), then register-tiled micro-kernels compute the scores
// S = Q Kᵀ and accumulate O += P V. Online softmax (running max m, sum l) and accumulation are fp32
// whatever the pool's dtype; the output is rounded to q's dtype once at the end.
// bf16 pools on CPUs with AVX512-BF16 (__AVX512BF16__, added by the builder when the CPU has it)
// keep Q and K in bf16 pairs and use vdpbf16ps for S and for P V (P rounded to bf16): twice the
// multiply-adds per instruction; prefill is compute-bound, so it pays (decode does not).
// Items are run largest first over the intra-op threads, so both one long request (many query
// blocks) and many short ones keep every thread busy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_util.h"
#include "work_queue.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RADIXRT_EXTEND_BF16_DOT 1
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;

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
// Most query tokens per work item; fewer when that leaves too few items for the threads.
constexpr int64_t kMaxBlockTokens = 64;
constexpr int64_t kMinBlockTokens = 16;
// Below this many (query, key) pairs in the whole call, it runs on the calling thread.
constexpr int64_t kMinParallelWork = 16384;

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


// Online-softmax step of one score row (kKeyBlock entries, `visible` >= 1 of them real):
// s = s * score_scale, masked past `visible`; new running max m, alpha = exp(m_old - m), s
// becomes the probabilities exp(s - m), l = l * alpha + Σ s.
inline void softmax_row(float* s, int64_t visible, float score_scale, float& m, float& l,
                        float& alpha) {
  for (int64_t jj = visible; jj < kKeyBlock; ++jj) s[jj] = kNegInf;
  if (score_scale != 1.f) {
    const Vec sc(score_scale);
    for (int64_t c = 0; c < kKeyBlock; c += kVec) (Vec::loadu(s + c) * sc).store(s + c);
  }
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

#ifdef RADIXRT_EXTEND_BF16_DOT
// bf16 pools on CPUs with AVX512-BF16: scores and P·V by vdpbf16ps (products of bf16 pairs
// summed into fp32), twice the multiply-adds per instruction of fp32 FMA. Q and K stay bf16
// (as in the pool); P is rounded to bf16 for P·V (as torch's bf16 flash attention does).
// Layouts (uint32 = one bf16 pair): q [rows][D/2] pairs along d; kp [D/2][kKeyBlock] pairs
// along d per key; vp [kKeyBlock/2][D] pairs of consecutive keys per d; pp [rows][kKeyBlock/2].
template <int D>
struct Bf16Tiles {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static constexpr int NK = kKeyBlock / 16;  // key vectors per score row
  static constexpr int C_S = largest_divisor(NK, 4);
  static constexpr int R_S = kAcc / C_S;
  static constexpr int C_O = largest_divisor(D / 16, 4);
  static constexpr int R_O = kAcc / C_O;

  template <int R>
  static inline void scores(const uint32_t* q, const uint32_t* kp, float* s) {
    for (int64_t c0 = 0; c0 < kKeyBlock; c0 += C_S * 16) {
      __m512 acc[R][C_S];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_S; ++c) acc[r][c] = _mm512_setzero_ps();
      }
      for (int dp = 0; dp < D / 2; ++dp) {
        __m512bh kv[C_S];
#pragma GCC unroll 4
        for (int c = 0; c < C_S; ++c) {
          kv[c] = (__m512bh)_mm512_loadu_si512(kp + dp * kKeyBlock + c0 + c * 16);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * (D / 2) + dp]));
#pragma GCC unroll 4
          for (int c = 0; c < C_S; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C_S; ++c) _mm512_storeu_ps(s + r * kKeyBlock + c0 + c * 16, acc[r][c]);
      }
    }
  }

  // o[r][:] = o[r][:] * alpha[r] + Σ_{pairs jp < np} pp[r][jp] · vp[jp][:].
  template <int R>
  static inline void accumulate(const uint32_t* pp, const uint32_t* vp, int64_t np,
                                const float* alpha, float* o) {
    for (int64_t c0 = 0; c0 < D; c0 += C_O * 16) {
      __m512 acc[R][C_O];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
        for (int c = 0; c < C_O; ++c) {
          acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c0 + c * 16), a);
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
              (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * (kKeyBlock / 2) + jp]));
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
#endif

// Whether bf16 pools use the vdpbf16ps path (when compiled in); benchmarks switch it.
std::atomic<bool> g_bf16_dot{true};

bool extend_attention_bf16_dot(bool enable) {
#ifdef RADIXRT_EXTEND_BF16_DOT
  return g_bf16_dot.exchange(enable);
#else
  (void)enable;
  return false;
#endif
}

struct Item {
  int64_t cost;  // (query, key) pairs, for ordering (largest first)
  int32_t req;
  int32_t kv_head;
  int32_t t0, t1;  // the request's query tokens [t0, t1)
};

// Per-thread scratch of one work item.
struct Scratch {
  std::vector<float> q, o, s, kt, vp, m, l, alpha;
  std::vector<uint32_t> q2, k2, v2, p2;  // bf16-pair buffers of the vdpbf16ps path
};

template <typename T, int D>
void extend_impl(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                 const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& loc,
                 const Tensor& qo_indptr, float scale, Tensor& out) {
  using Tl = Tiles<D>;
  const int64_t B = kv_indptr.size(0) - 1;
  const int64_t H = q.size(1), Hkv = k_buffer.size(1), G = H / Hkv;
  const int64_t num_slots = k_buffer.size(0), stride = Hkv * D;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kb = k_buffer.data_ptr<T>();
  const T* vb = v_buffer.data_ptr<T>();
  const int32_t* pre_idx = kv_indices.data_ptr<int32_t>();
  const int32_t* new_idx = loc.data_ptr<int32_t>();
  const int64_t* kptr = kv_indptr.data_ptr<int64_t>();
  const int64_t* qptr = qo_indptr.data_ptr<int64_t>();

  // Query blocks: at most kMaxBlockTokens tokens, fewer (down to kMinBlockTokens) until there
  // are a few items per thread; a request's blocks are of (nearly) equal size.
  int64_t total_tokens = 0;
  for (int64_t b = 0; b < B; ++b) total_tokens += qptr[b + 1] - qptr[b];
  const int64_t threads = at::get_num_threads();
  int64_t block = kMaxBlockTokens;
  while (block > kMinBlockTokens && Hkv * ((total_tokens + block - 1) / block) < 4 * threads) {
    block /= 2;
  }
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t e = qptr[b + 1] - qptr[b], p = kptr[b + 1] - kptr[b];
    if (e == 0) continue;
    const int64_t nblk = (e + block - 1) / block, per = (e + nblk - 1) / nblk;
    for (int64_t t0 = 0; t0 < e; t0 += per) {
      const int64_t t1 = std::min(e, t0 + per);
      const int64_t cost = (t1 - t0) * (p + (t0 + t1) / 2 + 1) * G;
      for (int64_t h = 0; h < Hkv; ++h) {
        items.push_back({cost, static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(t0), static_cast<int32_t>(t1)});
      }
    }
  }

  // Row r of the item = token (t0 + r / G), query head h * G + r % G: o / l in T.
  auto write_out = [&](const Item& it, Scratch& sc, int64_t nq) {
    const int64_t b = it.req, h = it.kv_head;
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t t = r / G, g = r % G;
      T* dst = op + ((qptr[b] + it.t0 + t) * H + h * G + g) * D;
      const Vec inv(1.f / sc.l[r]);  // l >= 1: the row's maximum contributes exp(0)
      const float* src = sc.o.data() + r * D;
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t c = 0; c < D; c += kVec) (Vec::loadu(src + c) * inv).store(dst + c);
      } else {
        for (int64_t c = 0; c < D; c += 2 * kVec) {
          if (c + 2 * kVec <= D) {
            from_f32<T>(Vec::loadu(src + c) * inv, Vec::loadu(src + c + kVec) * inv).store(dst + c);
          } else {
            store_f32<T>(dst + c, Vec::loadu(src + c) * inv);
          }
        }
      }
    }
  };

#ifdef RADIXRT_EXTEND_BF16_DOT
  const bool bf16_dot = g_bf16_dot.load(std::memory_order_relaxed);
  // Same block structure as the fp32 path, in bf16 pairs (layouts in Bf16Tiles).
  auto run_bf16_dot = [&](const Item& it, Scratch& sc, int64_t nq, int64_t p_len,
                          int64_t key_end, const auto& slot_of) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
    using Bt = Bf16Tiles<D>;
    const int64_t b = it.req, h = it.kv_head;
    constexpr int64_t DP = D / 2, KP = kKeyBlock / 2;
    sc.q2.resize(nq * DP);
    sc.k2.assign(DP * kKeyBlock, 0u);
    sc.v2.resize(KP * D);
    sc.p2.resize(nq * KP);
    const int64_t nt = it.t1 - it.t0;
    for (int64_t t = 0; t < nt; ++t) {
      std::memcpy(sc.q2.data() + t * G * DP, qp + ((qptr[b] + it.t0 + t) * H + h * G) * D,
                  G * D * sizeof(T));
    }
    for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
      const int64_t nb = std::min(kKeyBlock, key_end - j0), np = (nb + 1) / 2;
      for (int64_t jj = 0; jj < nb; ++jj) {
        const uint32_t* kr =
            reinterpret_cast<const uint32_t*>(kb + slot_of(j0 + jj) * stride + h * D);
        for (int64_t dp = 0; dp < DP; ++dp) sc.k2[dp * kKeyBlock + jj] = kr[dp];
      }
      for (int64_t jj = nb; jj < kKeyBlock; ++jj) {
        for (int64_t dp = 0; dp < DP; ++dp) sc.k2[dp * kKeyBlock + jj] = 0u;
      }
      for (int64_t i = 0; i < np; ++i) {
        const T* va = vb + slot_of(j0 + 2 * i) * stride + h * D;
        const T* vbb = 2 * i + 1 < nb ? vb + slot_of(j0 + 2 * i + 1) * stride + h * D : nullptr;
        Bt::pack_v_pair(va, vbb, sc.v2.data() + i * D);
      }
      const int64_t t_lo = std::max<int64_t>(0, j0 - p_len - it.t0);
      const int64_t r_lo = t_lo * G;
      if (r_lo >= nq) continue;
      for (int64_t r0 = r_lo; r0 < nq; r0 += Bt::R_S) {
        with_rows<Bt::R_S>(static_cast<int>(std::min<int64_t>(Bt::R_S, nq - r0)), [&](auto rr) {
          Bt::template scores<decltype(rr)::value>(sc.q2.data() + r0 * DP, sc.k2.data(),
                                                   sc.s.data() + r0 * kKeyBlock);
        });
      }
      for (int64_t r = r_lo; r < nq; ++r) {
        float* srow = sc.s.data() + r * kKeyBlock;
        const int64_t visible = std::min(nb, p_len + it.t0 + r / G - j0 + 1);  // >= 1
        softmax_row(srow, visible, scale, sc.m[r], sc.l[r], sc.alpha[r]);
        uint32_t* prow = sc.p2.data() + r * KP;
        for (int64_t c = 0; c < kKeyBlock; c += 32) {
          const __m512bh pb =
              _mm512_cvtne2ps_pbh(_mm512_loadu_ps(srow + c + 16), _mm512_loadu_ps(srow + c));
          _mm512_storeu_si512(prow + c / 2, (__m512i)pb);
        }
      }
      for (int64_t r0 = r_lo; r0 < nq; r0 += Bt::R_O) {
        with_rows<Bt::R_O>(static_cast<int>(std::min<int64_t>(Bt::R_O, nq - r0)), [&](auto rr) {
          Bt::template accumulate<decltype(rr)::value>(
              sc.p2.data() + r0 * KP, sc.v2.data(), np, sc.alpha.data() + r0,
              sc.o.data() + r0 * D);
        });
      }
    }
    }  // T is BFloat16
  };
#endif

  auto work = [&](const Item& it, Scratch& sc) {
    const int64_t b = it.req, h = it.kv_head;
    const int64_t p_len = kptr[b + 1] - kptr[b];
    const int32_t* pidx = pre_idx + kptr[b];
    const int32_t* nidx = new_idx + qptr[b];
    const int64_t nt = it.t1 - it.t0, nq = nt * G;
    sc.q.resize(nq * D);
    sc.o.assign(nq * D, 0.f);
    sc.s.resize(nq * kKeyBlock);
    sc.kt.resize(D * kKeyBlock);
    sc.vp.resize(kKeyBlock * D);
    sc.m.assign(nq, kNegInf);
    sc.l.assign(nq, 0.f);
    sc.alpha.resize(nq);
    const int64_t key_end = p_len + it.t1;  // keys of the last token: 0..p_len + t1 - 1
    auto slot_of = [&](int64_t j) {
      const int64_t slot = j < p_len ? pidx[j] : nidx[j - p_len];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "extend_attention: kv slot ", slot,
                  " out of range [0, ", num_slots, ")");
      return slot;
    };
#ifdef RADIXRT_EXTEND_BF16_DOT
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (bf16_dot) {
        run_bf16_dot(it, sc, nq, p_len, key_end, slot_of);
        write_out(it, sc, nq);
        return;
      }
    }
#endif
    {
      // Row r = token (t0 + r / G), query head h * G + r % G; scaled, fp32.
      for (int64_t t = 0; t < nt; ++t) {
        const T* src = qp + ((qptr[b] + it.t0 + t) * H + h * G) * D;
        float* dst = sc.q.data() + t * G * D;
        const Vec vs(scale);
        for (int64_t e = 0; e < G * D; e += kVec) (load_f32<T>(src + e) * vs).store(dst + e);
      }
      alignas(64) float krow[D];
      for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
        const int64_t nb = std::min(kKeyBlock, key_end - j0);
        // Convert the block to fp32: K transposed, V row-major.
        for (int64_t jj = 0; jj < nb; ++jj) {
          const int64_t j = j0 + jj;
          const int64_t slot = slot_of(j);
          const T* kr = kb + slot * stride + h * D;
          const T* vr = vb + slot * stride + h * D;
          for (int64_t c = 0; c < D; c += kVec) {
            load_f32<T>(kr + c).store(krow + c);
            load_f32<T>(vr + c).store(sc.vp.data() + jj * D + c);
          }
          for (int64_t d = 0; d < D; ++d) sc.kt[d * kKeyBlock + jj] = krow[d];
        }
        for (int64_t jj = nb; jj < kKeyBlock; ++jj) {
          for (int64_t d = 0; d < D; ++d) sc.kt[d * kKeyBlock + jj] = 0.f;
        }
        // Rows whose token sees no key of this block are skipped (a suffix of tokens is active).
        const int64_t t_lo = std::max<int64_t>(0, j0 - p_len - it.t0);
        const int64_t r_lo = t_lo * G;
        if (r_lo >= nq) continue;
        for (int64_t r0 = r_lo; r0 < nq; r0 += Tl::R_S) {
          with_rows<Tl::R_S>(static_cast<int>(std::min<int64_t>(Tl::R_S, nq - r0)), [&](auto rr) {
            Tl::template scores<decltype(rr)::value>(sc.q.data() + r0 * D, sc.kt.data(),
                                                     sc.s.data() + r0 * kKeyBlock);
          });
        }
        // Causal limit, online softmax: probabilities in place, alpha rescales the old rows.
        for (int64_t r = r_lo; r < nq; ++r) {
          const int64_t visible = std::min(nb, p_len + it.t0 + r / G - j0 + 1);  // >= 1
          softmax_row(sc.s.data() + r * kKeyBlock, visible, 1.f, sc.m[r], sc.l[r], sc.alpha[r]);
        }
        for (int64_t r0 = r_lo; r0 < nq; r0 += Tl::R_O) {
          with_rows<Tl::R_O>(static_cast<int>(std::min<int64_t>(Tl::R_O, nq - r0)), [&](auto rr) {
            Tl::template accumulate<decltype(rr)::value>(
                sc.s.data() + r0 * kKeyBlock, sc.vp.data(), nb, sc.alpha.data() + r0,
                sc.o.data() + r0 * D);
          });
        }
      }
    }
    write_out(it, sc, nq);
  };

  run_largest_first(items, kMinParallelWork, [&](const Item& it) {
    thread_local Scratch sc;  // grows to the largest item a thread has run
    work(it, sc);
  });
}

template <typename T>
void dispatch_head_dim(int64_t D, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& idx, const Tensor& kptr, const Tensor& loc,
                       const Tensor& qptr, float scale, Tensor& out) {
  switch (D) {
    case 16:
      return extend_impl<T, 16>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 32:
      return extend_impl<T, 32>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 64:
      return extend_impl<T, 64>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 96:
      return extend_impl<T, 96>(q, k, v, idx, kptr, loc, qptr, scale, out);
    case 128:
      return extend_impl<T, 128>(q, k, v, idx, kptr, loc, qptr, scale, out);
    default:
      TORCH_CHECK(false, "extend_attention: unsupported head_dim ", D);
  }
}

void check_index(const Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(),
              "extend_attention: ", name, " must be a contiguous 1-D ", dtype, " CPU tensor");
}

Tensor extend_attention(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                        const Tensor& kv_indices, const Tensor& kv_indptr, const Tensor& loc,
                        const Tensor& qo_indptr, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "extend_attention: q must be contiguous [N, H, D]");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.is_contiguous() &&
                  v_buffer.sizes() == k_buffer.sizes() && v_buffer.is_contiguous(),
              "extend_attention: k_buffer / v_buffer must be contiguous [slots, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() &&
                  q.scalar_type() == v_buffer.scalar_type(),
              "extend_attention: q, k_buffer and v_buffer must have one dtype");
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu() && v_buffer.device().is_cpu(),
              "extend_attention: CPU tensors only");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_buffer.size(1);
  TORCH_CHECK(k_buffer.size(2) == D, "extend_attention: head_dim of q and the pool differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "extend_attention: heads (", H,
              ") must be a multiple of kv_heads (", Hkv, ")");
  check_index(kv_indices, "kv_indices", at::kInt);
  check_index(loc, "loc", at::kInt);
  check_index(kv_indptr, "kv_indptr", at::kLong);
  check_index(qo_indptr, "qo_indptr", at::kLong);
  const int64_t B = kv_indptr.numel() - 1;
  TORCH_CHECK(B >= 0 && qo_indptr.numel() == B + 1,
              "extend_attention: kv_indptr and qo_indptr must both have batch + 1 entries");
  TORCH_CHECK(loc.numel() == N, "extend_attention: loc must have one slot per query token");
  const int64_t* kp = kv_indptr.data_ptr<int64_t>();
  const int64_t* qp = qo_indptr.data_ptr<int64_t>();
  TORCH_CHECK(B == 0 || (kp[0] == 0 && qp[0] == 0 && kp[B] == kv_indices.numel() && qp[B] == N),
              "extend_attention: indptrs must run from 0 to len(kv_indices) / num tokens");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(kp[b] <= kp[b + 1] && qp[b] <= qp[b + 1],
                "extend_attention: indptrs must be non-decreasing");
  }
  TORCH_CHECK(scale > 0, "extend_attention: scale must be positive");
  Tensor out = at::empty_like(q);
  if (N == 0) return out;
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc, qo_indptr,
                               s, out);
      break;
    case at::kBFloat16:
      dispatch_head_dim<at::BFloat16>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc,
                                      qo_indptr, s, out);
      break;
    case at::kHalf:
      dispatch_head_dim<at::Half>(D, q, k_buffer, v_buffer, kv_indices, kv_indptr, loc,
                                  qo_indptr, s, out);
      break;
    default:
      TORCH_CHECK(false, "extend_attention: dtype must be float32, bfloat16 or float16, got ",
                  q.scalar_type());
  }
  return out;
}

std::vector<int64_t> extend_attention_head_dims() { return {16, 32, 64, 96, 128}; }

std::string extend_attention_isa() { return RADIXRT_STR(CPU_CAPABILITY); }

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def(
      "extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor kv_indices, "
      "Tensor kv_indptr, Tensor loc, Tensor qo_indptr, float scale) -> Tensor");
  m.def("extend_attention_head_dims() -> int[]", &radixrt_cpu::extend_attention_head_dims);
  m.def("extend_attention_isa() -> str", &radixrt_cpu::extend_attention_isa);
  // Benchmarks / tests: bf16 pools through vdpbf16ps (true, the default where compiled in) or
  // fp32 FMA; returns the previous setting (always false without AVX512-BF16).
  m.def("extend_attention_bf16_dot(bool enable) -> bool",
        &radixrt_cpu::extend_attention_bf16_dot);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("extend_attention", &radixrt_cpu::extend_attention);
}
