// Paged decode attention on CPU, read in place from radixrt's KV pool.
//
// One new query token per request row. Row b attends, per KV head, over the keys
//   [shared prefix of its group, if any]  ++  kv_indices[row_start[b] : row_start[b] + row_len[b]]
// where every key is a slot of the pool buffers k_buffer / v_buffer [slots, kv_heads, head_dim].
// Nothing is gathered: each key row is read (and converted to fp32) straight from the pool.
//
// Numerics: q is scaled and converted to fp32; scores, the online softmax (running max m, sum l)
// and the V accumulation are fp32 whatever the pool's dtype. Outputs: the attention output in q's
// dtype and the natural-log log-sum-exp of the scaled scores (m + log l) in fp32, so callers can
// merge partial results by log-sum-exp. A row with no key at all gets output 0 and LSE -inf.
//
// Work: a row's own keys are one work item per KV head, or several ("parts": consecutive key
// ranges) when the batch has too few items to keep the threads busy; a cascade group's shared
// prefix is one item per (chunk of the group's rows, KV head), reading the prefix once for all of
// the chunk's rows. Every item leaves a partial state (m, l, unnormalized acc) per query; the
// thread that finishes the last item of a (row, KV head) merges its partials by log-sum-exp in a
// fixed order (prefix, then parts in key order) and writes the output. Parts depend on the batch
// only, never on the thread count, so results are bitwise the same for any number of threads.
// GQA: query head h uses KV head h / (heads / kv_heads); K/V are never expanded.
//
// Inner loop: keys go in blocks of one vector width (16 keys with AVX-512, 8 with AVX2); a tile
// of up to 4 queries of one row keeps its accumulators in registers over a run of blocks. The
// block's scores come out as one vector per query: each key's 64-wide product is reduced by a
// transpose-add tree over the block (no per-key horizontal sum), then the block's max, exp and
// sum are vector operations. Instruction set: the one this file is compiled for
// (CPU_CAPABILITY_AVX512 / CPU_CAPABILITY_AVX2 / generic at::vec), chosen by the builder
// (radixrt/attention/cpu_kernels.py) from the machine's CPU flags.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#ifndef RADIXRT_SPAN
#define RADIXRT_SPAN 64
#endif
#ifndef RADIXRT_PREFETCH
#define RADIXRT_PREFETCH 2
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;

constexpr int kVec = static_cast<int>(Vec::size());
static_assert(kVec % 4 == 0, "the key reduction works in groups of 4 keys");
// Keys per block: one vector of scores per query.
constexpr int kBlock = kVec;
// Most queries a tile keeps in registers.
constexpr int kMaxTile = 4;
// Keys a tile runs through before the next tile of the same item: their K/V rows (all KV heads)
// are still in L1/L2 when the next tile reads them.
constexpr int64_t kSpan = RADIXRT_SPAN;
// Blocks ahead whose K/V rows are prefetched (slots are arbitrary: the hardware cannot guess).
constexpr int64_t kPrefetchBlocks = RADIXRT_PREFETCH;
// Rows are split into parts of at least this many keys, and only while the batch has fewer
// than kWantItems (row, KV head) items.
constexpr int64_t kMinPartKeys = 256;
constexpr int64_t kWantItems = 32;
// Most query rows per cascade work item.
constexpr int64_t kMaxChunkRows = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many (query, key) pairs in a call, it runs on the calling thread: waking the other
// threads costs more than the work (tens of microseconds at most), and far more when the
// machine is oversubscribed and a woken thread has to wait for a time slice.
constexpr int64_t kMinParallelWork = 16384;

#define RADIXRT_STR2(x) #x
#define RADIXRT_STR(x) RADIXRT_STR2(x)

template <typename T>
inline Vec load_f32(const T* p);
template <>
inline Vec load_f32<float>(const float* p) {
  return Vec::loadu(p);
}
template <>
inline Vec load_f32<at::BFloat16>(const at::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
template <>
inline Vec load_f32<at::Half>(const at::Half* p) {
  Vec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

// Horizontal sum / max (the generic Vectorized's reduce_add / reduce_max do not compile).
inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  alignas(64) float a[kVec];
  v.store(a);
  float s = 0.f;
  for (int i = 0; i < kVec; ++i) s += a[i];
  return s;
#endif
}

inline float hmax(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_max();
#else
  alignas(64) float a[kVec];
  v.store(a);
  float m = a[0];
  for (int i = 1; i < kVec; ++i) m = std::max(m, a[i]);
  return m;
#endif
}

// Transpose-add reduction of a block's per-key product vectors, in two steps.
// quad(p0..p3): 128-bit lane L of the result holds [sum_L p0, sum_L p1, sum_L p2, sum_L p3],
// sum_L = the sum of p's four floats in lane L (generic: lanes 0..3 hold the full sums).
// combine(e[kVec / 4]): lane j of the result = the full sum of key j's products.
#if defined(CPU_CAPABILITY_AVX512)
inline Vec quad(const Vec& a, const Vec& b, const Vec& c, const Vec& d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
}
inline __m512 fold_lanes(__m512 x, __m512 y) {  // [x0+x1, x2+x3, y0+y1, y2+y3] (128-bit lanes)
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline Vec combine(const Vec* e) {
  return fold_lanes(fold_lanes(e[0], e[1]), fold_lanes(e[2], e[3]));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline Vec quad(const Vec& a, const Vec& b, const Vec& c, const Vec& d) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256d abd = _mm256_castps_pd(ab), cdd = _mm256_castps_pd(cd);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, cdd)),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(abd, cdd)));
}
inline Vec combine(const Vec* e) {
  const __m256 x = e[0], y = e[1];
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
#else
inline Vec quad(const Vec& a, const Vec& b, const Vec& c, const Vec& d) {
  alignas(64) float out[kVec] = {};
  out[0] = hsum(a);
  out[1] = hsum(b);
  out[2] = hsum(c);
  out[3] = hsum(d);
  return Vec::loadu(out);
}
inline Vec combine(const Vec* e) {
  alignas(64) float out[kVec], part[kVec];
  for (int g = 0; g < kVec / 4; ++g) {
    e[g].store(part);
    for (int i = 0; i < 4; ++i) out[g * 4 + i] = part[i];
  }
  return Vec::loadu(out);
}
#endif

// Partial softmax state of `nq` queries: m[nq], l[nq], acc[nq * D] (acc not yet divided by l).
template <int D>
struct State {
  float* p;
  int64_t nq;
  float* m() const { return p; }
  float* l() const { return p + nq; }
  float* acc() const { return p + 2 * nq; }
  static constexpr int64_t floats(int64_t nq) { return nq * (D + 2); }
};

// The pool's K/V (one layer), and the online softmax of query tiles over lists of its slots.
template <typename T, int D>
struct PoolScan {
  static_assert(D % kVec == 0, "head_dim must be a whole number of vectors");
  static constexpr int NV = D / kVec;
  // Queries per tile: accumulators (TQ * NV vectors) stay in registers.
  static constexpr int TQ = std::max(1, std::min(kMaxTile, 16 / NV));

  const T* kbase;  // k_buffer
  const T* vbase;  // v_buffer
  int64_t kv_heads;
  int64_t num_slots;

  int64_t stride() const { return kv_heads * D; }  // elements per slot

  // Pointers to KV head h's rows of keys idx[0..n) (n <= kBlock); the rest repeat the first
  // (their scores are masked). Checks every slot.
  void rows(const int32_t* idx, int n, int64_t h, const T** kr, const T** vr) const {
    for (int j = 0; j < n; ++j) {
      const int64_t slot = idx[j];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "paged_decode: kv slot ", slot,
                  " out of range [0, ", num_slots, ")");
      kr[j] = kbase + slot * stride() + h * D;
      vr[j] = vbase + slot * stride() + h * D;
    }
    for (int j = n; j < kBlock; ++j) {
      kr[j] = kr[0];
      vr[j] = vr[0];
    }
  }

  // Starts loading the whole K and V rows (every KV head) of keys idx[0..n) into the caches.
  void prefetch(const int32_t* idx, int64_t n) const {
    const int64_t bytes = stride() * static_cast<int64_t>(sizeof(T));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = idx[j];
      if (slot < 0 || slot >= num_slots) continue;  // reported when the key is read
      const char* k = reinterpret_cast<const char*>(kbase + slot * stride());
      const char* v = reinterpret_cast<const char*>(vbase + slot * stride());
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 3);
        __builtin_prefetch(v + off, 0, 3);
      }
    }
  }

  // Scores s[t] (lane j: q_t . k_j) of NQ queries q[t * D ...] against one block of keys.
  template <int NQ>
  static inline void scores(const float* q, const T* const* kr, Vec* s) {
    Vec e[NQ][kVec / 4];
    for (int g = 0; g < kVec / 4; ++g) {
      Vec part[NQ][4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const T* k = kr[g * 4 + j];
        const Vec k0 = load_f32<T>(k);
#pragma GCC unroll 4
        for (int t = 0; t < NQ; ++t) part[t][j] = Vec::loadu(q + t * D) * k0;
#pragma GCC unroll 16
        for (int c = 1; c < NV; ++c) {
          const Vec kc = load_f32<T>(k + c * kVec);
#pragma GCC unroll 4
          for (int t = 0; t < NQ; ++t) {
            part[t][j] = at::vec::fmadd(Vec::loadu(q + t * D + c * kVec), kc, part[t][j]);
          }
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < NQ; ++t) e[t][g] = quad(part[t][0], part[t][1], part[t][2], part[t][3]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < NQ; ++t) s[t] = combine(e[t]);
  }

  // Runs NQ queries (fp32, scaled, q[t * D ...]) of KV head h over keys idx[0..n): state
  // queries first.. of st, continued, or started when `fresh`. `lead` > 0: this pass is the
  // first over these keys and prefetches whole K/V rows ahead, up to key idx[lead).
  template <int NQ>
  void tile(int64_t h, const float* q, const int32_t* idx, int64_t n, const State<D>& st,
            int64_t first, bool fresh, int64_t lead) const {
    float m[NQ];
    Vec lv[NQ];
    Vec acc[NQ][NV];
    const Vec zero(0.f);
#pragma GCC unroll 4
    for (int t = 0; t < NQ; ++t) {
      const int64_t i = first + t;
      m[t] = fresh ? kNegInf : st.m()[i];
      lv[t] = Vec::set(zero, Vec(fresh ? 0.f : st.l()[i]), 1);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        acc[t][c] = fresh ? zero : Vec::loadu(st.acc() + i * D + c * kVec);
      }
    }
    const T* kr[kBlock];
    const T* vr[kBlock];
    alignas(64) float p[NQ][kBlock];
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int nb = static_cast<int>(std::min<int64_t>(kBlock, n - j0));
      rows(idx + j0, nb, h, kr, vr);
      const int64_t ahead = j0 + kPrefetchBlocks * kBlock;
      if (ahead < lead) prefetch(idx + ahead, std::min<int64_t>(kBlock, lead - ahead));
      Vec s[NQ];
      scores<NQ>(q, kr, s);
#pragma GCC unroll 4
      for (int t = 0; t < NQ; ++t) {
        if (nb < kBlock) s[t] = Vec::set(Vec(kNegInf), s[t], nb);
        const float m_new = std::max(m[t], hmax(s[t]));
        if (m_new > m[t]) {  // rescale what was accumulated under the old max
          const Vec alpha(std::exp(m[t] - m_new));  // 0 while m[t] is -inf
          lv[t] = lv[t] * alpha;
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) acc[t][c] = acc[t][c] * alpha;
          m[t] = m_new;
        }
        const Vec pt = (s[t] - Vec(m[t])).exp_u20();  // exp(-inf) = 0 for the padding
        lv[t] = lv[t] + pt;
        pt.store(p[t]);
      }
      for (int j = 0; j < nb; ++j) {
        Vec vv[NV];
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) vv[c] = load_f32<T>(vr[j] + c * kVec);
#pragma GCC unroll 4
        for (int t = 0; t < NQ; ++t) {
          const Vec pj(p[t][j]);
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) acc[t][c] = at::vec::fmadd(pj, vv[c], acc[t][c]);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NQ; ++t) {
      const int64_t i = first + t;
      st.m()[i] = m[t];
      st.l()[i] = hsum(lv[t]);
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) acc[t][c].store(st.acc() + i * D + c * kVec);
    }
  }

  void tile_any(int nq, int64_t h, const float* q, const int32_t* idx, int64_t n,
                const State<D>& st, int64_t first, bool fresh, int64_t lead) const {
    static_assert(TQ >= 1 && TQ <= 4, "tiles of 1 to 4 queries");
    switch (nq) {
      case 1:
        return tile<1>(h, q, idx, n, st, first, fresh, lead);
      case 2:
        if constexpr (TQ >= 2) return tile<2>(h, q, idx, n, st, first, fresh, lead);
        break;
      case 3:
        if constexpr (TQ >= 3) return tile<3>(h, q, idx, n, st, first, fresh, lead);
        break;
      case 4:
        if constexpr (TQ >= 4) return tile<4>(h, q, idx, n, st, first, fresh, lead);
        break;
    }
    TORCH_CHECK(false, "paged_decode: internal tile size ", nq);
  }

  // Runs every query head of each of `rows` query rows over keys idx[0..n), writing (not
  // continuing) their states: row r's H = kv_heads * G scaled queries are q_rows(r), its state
  // st_rows(r). Keys go in spans of kSpan; a span's rows of all KV heads (one contiguous slot
  // row each) are read from memory once, by KV head 0's pass, and from the caches by the rest.
  template <typename QRow, typename StRow>
  void run(int64_t rows, int64_t G, const QRow& q_rows, const StRow& st_rows, const int32_t* idx,
           int64_t n) const {
    const bool one_tile = rows == 1 && kv_heads == 1 && G <= TQ;
    const int64_t span = one_tile ? std::max<int64_t>(n, 1) : kSpan;
    for (int64_t j0 = 0; j0 < n || j0 == 0; j0 += span) {
      const int64_t len = std::max<int64_t>(0, std::min(span, n - j0));
      if (j0 == 0) prefetch(idx, std::min<int64_t>(n, kPrefetchBlocks * kBlock));
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* q = q_rows(r);
          const State<D> st = st_rows(r);
          for (int64_t t0 = 0; t0 < G; t0 += TQ) {
            const int nq = static_cast<int>(std::min<int64_t>(TQ, G - t0));
            const int64_t first = h * G + t0;
            tile_any(nq, h, q + first * D, idx + j0, len, st, first, j0 == 0,
                     h == 0 && r == 0 && t0 == 0 ? n - j0 : 0);
          }
        }
      }
    }
  }
};

// Output and LSE of G queries from their partial states st[0..np), merged by log-sum-exp in
// order. out: G * D values of T; lse: G floats.
template <typename T, int D>
void merge_states(const State<D>* st, int64_t np, int64_t G, T* out, float* lse) {
  for (int64_t i = 0; i < G; ++i) {
    float mx = kNegInf;
    for (int64_t k = 0; k < np; ++k) mx = std::max(mx, st[k].m()[i]);
    T* o = out + i * D;
    if (mx == kNegInf) {  // no key at all
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(0.f);
      lse[i] = kNegInf;
      continue;
    }
    Vec acc[D / kVec];
    for (int c = 0; c < D / kVec; ++c) acc[c] = Vec(0.f);
    float l = 0.f;
    for (int64_t k = 0; k < np; ++k) {
      const float mk = st[k].m()[i];
      if (mk == kNegInf) continue;
      const float w = std::exp(mk - mx);
      l += st[k].l()[i] * w;
      const float* a = st[k].acc() + i * D;
      for (int c = 0; c < D / kVec; ++c) acc[c] = at::vec::fmadd(Vec(w), Vec::loadu(a + c * kVec), acc[c]);
    }
    const Vec inv(1.f / l);
    alignas(64) float buf[D];
    for (int c = 0; c < D / kVec; ++c) (acc[c] * inv).store(buf + c * kVec);
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(buf[d]);
    lse[i] = mx + std::log(l);
  }
}

// One unit of parallel work, for every KV head: a part of a row's own keys, or a chunk of a
// group's rows against the group's shared prefix.
struct Item {
  int64_t cost;  // keys x queries, for ordering (largest first)
  int32_t group;  // -1 for a row part
  int32_t first;  // row part: the row; group chunk: first index into group_rows
  int32_t last;  // row part: the part number; group chunk: one past the last index
};

template <typename T, int D>
void paged_decode_impl(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                       const Tensor& kv_indices, const Tensor& row_start, const Tensor& row_len,
                       const Tensor& group_start, const Tensor& group_len,
                       const Tensor& group_row_ptr, const Tensor& group_rows, float scale,
                       Tensor& out, Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t Hkv = k_buffer.size(1);
  const int64_t G = H / Hkv;
  const int64_t num_groups = group_start.size(0);
  const int64_t num_idx = kv_indices.size(0);
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* rl = row_len.data_ptr<int64_t>();
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t* gl = group_len.data_ptr<int64_t>();
  const int64_t* gptr = group_row_ptr.data_ptr<int64_t>();
  const int64_t* grows = group_rows.data_ptr<int64_t>();

  // Per row: its group (-1: none) and its parts (own keys split into whole blocks).
  std::vector<int32_t> group_of(B, -1);
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(gs[g] >= 0 && gl[g] >= 0 && gs[g] + gl[g] <= num_idx,
                "paged_decode: group ", g, " keys out of kv_indices");
    for (int64_t r = gptr[g]; r < gptr[g + 1]; ++r) {
      TORCH_CHECK(grows[r] >= 0 && grows[r] < B && group_of[grows[r]] < 0,
                  "paged_decode: group_rows must be distinct batch rows");
      group_of[grows[r]] = static_cast<int32_t>(g);
    }
  }
  const int64_t want_parts = std::max<int64_t>(1, (kWantItems + B - 1) / B);
  std::vector<int64_t> parts(B), part_keys(B), state_base(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rs[b] >= 0 && rl[b] >= 0 && rs[b] + rl[b] <= num_idx,
                "paged_decode: row ", b, " keys out of kv_indices");
    const int64_t split = std::max<int64_t>(1, std::min(want_parts, rl[b] / kMinPartKeys));
    part_keys[b] = std::max<int64_t>(kBlock, ((rl[b] + split - 1) / split + kBlock - 1) /
                                                 kBlock * kBlock);
    parts[b] = std::max<int64_t>(1, (rl[b] + part_keys[b] - 1) / part_keys[b]);
    // Row b's states: [prefix (if grouped)] + parts.
    state_base[b + 1] = state_base[b] + (group_of[b] >= 0 ? 1 : 0) + parts[b];
  }

  // Partial states (every query head of a row): row b's k-th is states[state_base[b] + k].
  const int64_t per_state = State<D>::floats(H);
  std::unique_ptr<float[]> states(new float[state_base[B] * per_state]);
  auto state = [&](int64_t b, int64_t k) {
    return State<D>{states.get() + (state_base[b] + k) * per_state, H};
  };
  // Items still to finish per row; the thread finishing the last one merges.
  std::unique_ptr<std::atomic<int32_t>[]> remaining(new std::atomic<int32_t>[B]);
  for (int64_t b = 0; b < B; ++b) {
    remaining[b].store(static_cast<int32_t>(state_base[b + 1] - state_base[b]),
                       std::memory_order_relaxed);
  }

  // Queries scaled to fp32 once: row b's are qs[b * H * D ...].
  std::unique_ptr<float[]> qs(new float[B * H * D]);
  {
    const T* qp = q.data_ptr<T>();
    for (int64_t e = 0; e < B * H * D; ++e) qs[e] = static_cast<float>(qp[e]) * scale;
  }

  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  auto finish = [&](int64_t b) {
    if (remaining[b].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    State<D> st[kWantItems + 1];
    const int64_t np = state_base[b + 1] - state_base[b];
    for (int64_t k = 0; k < np; ++k) st[k] = state(b, k);
    merge_states<T, D>(st, np, H, op + b * H * D, lp + b * H);
  };

  std::vector<Item> items;
  items.reserve(B * 2);
  // Split each group's rows into chunks so every thread has work; a chunk reads the prefix once
  // for all of its rows. (Chunking does not change any row's result.)
  const int64_t threads = at::get_num_threads();
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t r0 = gptr[g], n = gptr[g + 1] - r0;
    if (n == 0) continue;
    const int64_t per_group = std::max<int64_t>(1, (2 * threads + num_groups - 1) / num_groups);
    const int64_t max_rows = std::max<int64_t>(1, kMaxChunkRows * 9 / std::max<int64_t>(H, 1));
    const int64_t chunk =
        std::min(std::max<int64_t>(4, (n + per_group - 1) / per_group), max_rows);
    for (int64_t c = 0; c < n; c += chunk) {
      const int64_t c1 = std::min(n, c + chunk);
      items.push_back({gl[g] * (c1 - c) * H, static_cast<int32_t>(g),
                       static_cast<int32_t>(r0 + c), static_cast<int32_t>(r0 + c1)});
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < parts[b]; ++k) {
      const int64_t n = std::min(part_keys[b], rl[b] - k * part_keys[b]);
      items.push_back({std::max<int64_t>(n, 0) * H, -1, static_cast<int32_t>(b),
                       static_cast<int32_t>(k)});
    }
  }

  const PoolScan<T, D> scan{k_buffer.data_ptr<T>(), v_buffer.data_ptr<T>(), Hkv,
                            k_buffer.size(0)};
  auto work = [&](const Item& it) {
    if (it.group < 0) {
      const int64_t b = it.first, k = it.last;
      const int64_t k0 = k * part_keys[b];
      const int64_t n = std::max<int64_t>(0, std::min(part_keys[b], rl[b] - k0));
      const int64_t slot = (group_of[b] >= 0 ? 1 : 0) + k;
      scan.run(1, G, [&](int64_t) { return qs.get() + b * H * D; },
               [&](int64_t) { return state(b, slot); }, idx + rs[b] + k0, n);
      finish(b);
    } else {
      const int64_t* rows = grows + it.first;
      scan.run(it.last - it.first, G, [&](int64_t r) { return qs.get() + rows[r] * H * D; },
               [&](int64_t r) { return state(rows[r], 0); }, idx + gs[it.group],
               gl[it.group]);
      for (int64_t r = 0; r < it.last - it.first; ++r) finish(rows[r]);
    }
  };

  // Largest first; equal costs keep their order. Each thread takes the next item.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  int64_t total = 0;
  for (const Item& it : items) total += it.cost;
  const int64_t workers = total < kMinParallelWork ? 1 : std::min<int64_t>(threads, n_items);
  if (workers <= 1) {
    for (const Item& it : items) work(it);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) work(items[i]);
  });
}

template <typename T>
void dispatch_head_dim(int64_t D, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& idx, const Tensor& rs, const Tensor& rl, const Tensor& gs,
                       const Tensor& gl, const Tensor& gp, const Tensor& gr, float scale,
                       Tensor& out, Tensor& lse) {
#define RADIXRT_HEAD_DIM_CASE(DIM)                                                          \
  case DIM:                                                                                 \
    return paged_decode_impl<T, DIM>(q, k, v, idx, rs, rl, gs, gl, gp, gr, scale, out, lse);
  switch (D) {
    RADIXRT_HEAD_DIM_CASE(16)
    RADIXRT_HEAD_DIM_CASE(32)
    RADIXRT_HEAD_DIM_CASE(64)
    RADIXRT_HEAD_DIM_CASE(80)
    RADIXRT_HEAD_DIM_CASE(96)
    RADIXRT_HEAD_DIM_CASE(128)
    RADIXRT_HEAD_DIM_CASE(256)
    default:
      TORCH_CHECK(false, "paged_decode: unsupported head_dim ", D);
  }
#undef RADIXRT_HEAD_DIM_CASE
}

void check_index(const Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 &&
                  t.is_contiguous(),
              "paged_decode: ", name, " must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(numel < 0 || t.numel() == numel, "paged_decode: ", name, " must have ", numel,
              " elements, got ", t.numel());
}

std::tuple<Tensor, Tensor> paged_decode(const Tensor& q, const Tensor& k_buffer,
                                        const Tensor& v_buffer, const Tensor& kv_indices,
                                        const Tensor& row_start, const Tensor& row_len,
                                        const Tensor& group_start, const Tensor& group_len,
                                        const Tensor& group_row_ptr, const Tensor& group_rows,
                                        double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_decode: q must be contiguous [B, H, D]");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.is_contiguous() &&
                  v_buffer.sizes() == k_buffer.sizes() && v_buffer.is_contiguous(),
              "paged_decode: k_buffer / v_buffer must be contiguous [slots, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() &&
                  q.scalar_type() == v_buffer.scalar_type(),
              "paged_decode: q, k_buffer and v_buffer must have one dtype");
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu() && v_buffer.device().is_cpu(),
              "paged_decode: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_buffer.size(1);
  TORCH_CHECK(k_buffer.size(2) == D, "paged_decode: head_dim of q and the pool differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_decode: heads (", H,
              ") must be a multiple of kv_heads (", Hkv, ")");
  TORCH_CHECK(kv_indices.device().is_cpu() && kv_indices.scalar_type() == at::kInt &&
                  kv_indices.dim() == 1 && kv_indices.is_contiguous(),
              "paged_decode: kv_indices must be a contiguous 1-D int32 CPU tensor");
  check_index(row_start, "row_start", B);
  check_index(row_len, "row_len", B);
  check_index(group_start, "group_start", -1);
  const int64_t num_groups = group_start.numel();
  check_index(group_len, "group_len", num_groups);
  check_index(group_row_ptr, "group_row_ptr", num_groups + 1);
  check_index(group_rows, "group_rows", -1);
  const int64_t* gp = group_row_ptr.data_ptr<int64_t>();
  TORCH_CHECK(gp[0] == 0 && gp[num_groups] == group_rows.numel(),
              "paged_decode: group_row_ptr must run from 0 to len(group_rows)");
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(gp[g] <= gp[g + 1], "paged_decode: group_row_ptr must be non-decreasing");
  }
  TORCH_CHECK(scale > 0, "paged_decode: scale must be positive");

  Tensor out = at::empty_like(q);
  Tensor lse = at::empty({B, H}, q.options().dtype(at::kFloat));
  if (B == 0) return {out, lse};
  const float s = static_cast<float>(scale);
  auto run = [&](auto zero) {
    dispatch_head_dim<decltype(zero)>(D, q, k_buffer, v_buffer, kv_indices, row_start, row_len,
                                      group_start, group_len, group_row_ptr, group_rows, s, out,
                                      lse);
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      run(0.f);
      break;
    case at::kBFloat16:
      run(at::BFloat16(0.f));
      break;
    case at::kHalf:
      run(at::Half(0.f));
      break;
    default:
      TORCH_CHECK(false, "paged_decode: dtype must be float32, bfloat16 or float16, got ",
                  q.scalar_type());
  }
  return {out, lse};
}

std::vector<int64_t> paged_decode_head_dims() { return {16, 32, 64, 80, 96, 128, 256}; }

std::string paged_decode_isa() { return RADIXRT_STR(CPU_CAPABILITY); }

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY(radixrt, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor kv_indices, "
      "Tensor row_start, Tensor row_len, Tensor group_start, Tensor group_len, "
      "Tensor group_row_ptr, Tensor group_rows, float scale) -> (Tensor, Tensor)");
  m.def("paged_decode_head_dims() -> int[]", &radixrt_cpu::paged_decode_head_dims);
  m.def("paged_decode_isa() -> str", &radixrt_cpu::paged_decode_isa);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("paged_decode", &radixrt_cpu::paged_decode);
}
