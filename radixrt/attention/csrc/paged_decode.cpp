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
// Cascade: a group's shared prefix keys are read once per (group chunk, KV head) for all of the
// chunk's query rows; each row then continues the same online softmax over its own keys.
// GQA: query head h uses KV head h / (heads / kv_heads); K/V are never expanded.
//
// Vectorized with at::vec::Vectorized<float>; the instruction set is the one this file is
// compiled for (CPU_CAPABILITY_AVX512 / CPU_CAPABILITY_AVX2 / generic), chosen by the builder
// (radixrt/attention/cpu_kernels.py) from the machine's CPU flags.

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
#include <limits>
#include <string>
#include <vector>

namespace radixrt_cpu {
namespace {

using at::Tensor;
// Keys per online-softmax step: scores of a block are computed, then the running max is
// updated once per block (not once per key).
constexpr int64_t kBlock = 32;
static_assert(kBlock % kVec == 0, "key block must be a whole number of vectors");
// Most query rows per cascade work item (rows of one group are split into chunks so that
// there are enough items for every thread).
constexpr int64_t kMaxChunkRows = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many (query, key) pairs in a phase, the phase runs on the calling thread: waking
// the other threads costs more than the work (tens of microseconds at most), and far more when
// the machine is oversubscribed and a woken thread has to wait for a time slice.
constexpr int64_t kMinParallelWork = 16384;

// Online softmax of `nq` fp32 queries (already scaled) over a list of pool slots of one KV head.
// Keys go in blocks of kBlock; within a block, queries go in tiles of TQ whose accumulators stay
// in vector registers while each key row is loaded (and converted to fp32) once per tile.
template <typename T, int D>
struct KeyScan {
  static_assert(D % kVec == 0, "head_dim must be a whole number of vectors");
  static constexpr int NV = D / kVec;
  static constexpr int TQ = std::max(1, std::min(4, 12 / NV));

  const T* kbase;  // k_buffer + kv_head * D
  const T* vbase;  // v_buffer + kv_head * D
  int64_t stride;  // elements per slot: kv_heads * D
  int64_t num_slots;

  // Runs keys idx[0..n) through the state (m[i], l[i], acc[i, :]) of each query q[i, :].
  void run(const float* q, int64_t nq, const int32_t* idx, int64_t n, float* m, float* l,
           float* acc) const {
    const T* krow[kBlock];
    const T* vrow[kBlock];
    alignas(64) float scores[TQ][kBlock];
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t nb = std::min(kBlock, n - j0);
      for (int64_t jj = 0; jj < nb; ++jj) {
        const int64_t slot = idx[j0 + jj];
        TORCH_CHECK(slot >= 0 && slot < num_slots, "paged_decode: kv slot ", slot,
                    " out of range [0, ", num_slots, ")");
        krow[jj] = kbase + slot * stride;
        vrow[jj] = vbase + slot * stride;
      }
      // Start fetching the next block's rows while this one is computed.
      const int64_t next_end = std::min(n, j0 + 2 * kBlock);
      for (int64_t j = j0 + nb; j < next_end; ++j) {
        const int64_t slot = idx[j];
        if (slot >= 0 && slot < num_slots) {
          prefetch_row(kbase + slot * stride, D * sizeof(T));
          prefetch_row(vbase + slot * stride, D * sizeof(T));
        }
      }
      for (int64_t t0 = 0; t0 < nq; t0 += TQ) {
        const int64_t tq = std::min<int64_t>(TQ, nq - t0);
        const float* qt = q + t0 * D;
        // Scores of the tile's queries against the block's keys.
        for (int64_t jj = 0; jj < nb; ++jj) {
          Vec kv[NV];
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) kv[c] = load_f32<T>(krow[jj] + c * kVec);
#pragma GCC unroll 4
          for (int t = 0; t < TQ; ++t) {
            if (t < tq) {
              Vec a = Vec::loadu(qt + t * D) * kv[0];
#pragma GCC unroll 16
              for (int c = 1; c < NV; ++c) {
                a = at::vec::fmadd(Vec::loadu(qt + t * D + c * kVec), kv[c], a);
              }
              scores[t][jj] = hsum(a);
            }
          }
        }
        // Online softmax: new running max, rescale factor, probabilities in place.
        float alpha[TQ];
        for (int t = 0; t < tq; ++t) {
          float* s = scores[t];
          for (int64_t jj = nb; jj < kBlock; ++jj) s[jj] = kNegInf;
          Vec mx = Vec::loadu(s);
          for (int64_t c = kVec; c < kBlock; c += kVec) mx = at::vec::maximum(mx, Vec::loadu(s + c));
          const int64_t i = t0 + t;
          const float m_new = std::max(m[i], hmax(mx));
          alpha[t] = std::exp(m[i] - m_new);  // 0 while m[i] is -inf
          const Vec vm(m_new);
          Vec sum(0.f);
          for (int64_t c = 0; c < kBlock; c += kVec) {
            Vec p = (Vec::loadu(s + c) - vm).exp_u20();  // exp(-inf) = 0 for padding
            p.store(s + c);
            sum = sum + p;
          }
          l[i] = l[i] * alpha[t] + hsum(sum);
          m[i] = m_new;
        }
        // acc = acc * alpha + p @ V, accumulators in registers.
        Vec av[TQ][NV];
#pragma GCC unroll 4
        for (int t = 0; t < TQ; ++t) {
          if (t < tq) {
            const Vec va(alpha[t]);
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) av[t][c] = Vec::loadu(acc + (t0 + t) * D + c * kVec) * va;
          }
        }
        for (int64_t jj = 0; jj < nb; ++jj) {
          Vec vv[NV];
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) vv[c] = load_f32<T>(vrow[jj] + c * kVec);
#pragma GCC unroll 4
          for (int t = 0; t < TQ; ++t) {
            if (t < tq) {
              const Vec p(scores[t][jj]);
#pragma GCC unroll 16
              for (int c = 0; c < NV; ++c) av[t][c] = at::vec::fmadd(p, vv[c], av[t][c]);
            }
          }
        }
#pragma GCC unroll 4
        for (int t = 0; t < TQ; ++t) {
          if (t < tq) {
#pragma GCC unroll 16
            for (int c = 0; c < NV; ++c) av[t][c].store(acc + (t0 + t) * D + c * kVec);
          }
        }
      }
    }
  }
};

// One unit of parallel work: either a request row's own keys (for one KV head), or a chunk of a
// group's rows against the group's shared prefix (for one KV head).
struct Item {
  int64_t cost;  // keys x queries, for ordering (largest first)
  int32_t group;  // -1 for a row item
  int32_t first;  // row item: the row; group item: first index into group_rows
  int32_t last;  // group item: one past the last index into group_rows
  int32_t kv_head;
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
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* rl = row_len.data_ptr<int64_t>();
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t* gl = group_len.data_ptr<int64_t>();
  const int64_t* gptr = group_row_ptr.data_ptr<int64_t>();
  const int64_t* grows = group_rows.data_ptr<int64_t>();

  const T* kb = k_buffer.data_ptr<T>();
  const T* vb = v_buffer.data_ptr<T>();
  auto scan_for = [&](int64_t h) {
    return KeyScan<T, D>{kb + h * D, vb + h * D, Hkv * D, k_buffer.size(0)};
  };
  // Query i of a (row, kv head) pair is query head h * G + i, scaled to fp32.
  auto load_queries = [&](int64_t b, int64_t h, float* dst) {
    const T* src = qp + (b * H + h * G) * D;
    for (int64_t e = 0; e < G * D; ++e) dst[e] = static_cast<float>(src[e]) * scale;
  };

  // Phase 1: shared prefixes. State of (row b, head) saved for the row's own pass.
  std::vector<uint8_t> grouped(B, 0);
  std::vector<float> pre_m, pre_l, pre_acc;
  if (num_groups > 0) {
    pre_m.assign(B * H, kNegInf);
    pre_l.assign(B * H, 0.f);
    pre_acc.assign(B * H * D, 0.f);
    std::vector<Item> items;
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t r0 = gptr[g], r1 = gptr[g + 1];
      TORCH_CHECK(gs[g] >= 0 && gl[g] >= 0 && gs[g] + gl[g] <= kv_indices.size(0),
                  "paged_decode: group ", g, " keys out of kv_indices");
      for (int64_t r = r0; r < r1; ++r) {
        TORCH_CHECK(grows[r] >= 0 && grows[r] < B && !grouped[grows[r]],
                    "paged_decode: group_rows must be distinct batch rows");
        grouped[grows[r]] = 1;
      }
    }
    // Split each group's rows into chunks so every thread has work; a chunk reads the prefix
    // once for all of its rows.
    const int64_t threads = at::get_num_threads();
    const int64_t per_group = std::max<int64_t>(1, (2 * threads + num_groups * Hkv - 1) /
                                                       (num_groups * Hkv));
    const int64_t max_rows = std::max<int64_t>(1, kMaxChunkRows * 3 / std::max<int64_t>(G, 1));
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t r0 = gptr[g], n = gptr[g + 1] - r0;
      if (n == 0 || gl[g] == 0) continue;
      int64_t chunk = std::max<int64_t>(4, (n + per_group - 1) / per_group);
      chunk = std::min(chunk, max_rows);
      for (int64_t c = 0; c < n; c += chunk) {
        const int64_t c1 = std::min(n, c + chunk);
        for (int64_t h = 0; h < Hkv; ++h) {
          items.push_back({gl[g] * (c1 - c) * G, static_cast<int32_t>(g),
                           static_cast<int32_t>(r0 + c), static_cast<int32_t>(r0 + c1),
                           static_cast<int32_t>(h)});
        }
      }
    }
    run_largest_first(items, kMinParallelWork, [&](const Item& it) {
      thread_local std::vector<float> qbuf, mbuf, lbuf, abuf;
      const int64_t rows = it.last - it.first, nq = rows * G;
      qbuf.resize(nq * D);
      mbuf.assign(nq, kNegInf);
      lbuf.assign(nq, 0.f);
      abuf.assign(nq * D, 0.f);
      for (int64_t r = 0; r < rows; ++r) load_queries(grows[it.first + r], it.kv_head, &qbuf[r * G * D]);
      scan_for(it.kv_head)
          .run(qbuf.data(), nq, idx + gs[it.group], gl[it.group], mbuf.data(), lbuf.data(),
               abuf.data());
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = grows[it.first + r] * H + it.kv_head * G;
        for (int64_t i = 0; i < G; ++i) {
          pre_m[base + i] = mbuf[r * G + i];
          pre_l[base + i] = lbuf[r * G + i];
          std::copy_n(&abuf[(r * G + i) * D], D, &pre_acc[(base + i) * D]);
        }
      }
    });
  }

  // Phase 2: every row's own keys, continuing from its prefix state; then normalize.
  std::vector<Item> items;
  items.reserve(B * Hkv);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rs[b] >= 0 && rl[b] >= 0 && rs[b] + rl[b] <= kv_indices.size(0),
                "paged_decode: row ", b, " keys out of kv_indices");
    for (int64_t h = 0; h < Hkv; ++h) {
      items.push_back({rl[b] * G, -1, static_cast<int32_t>(b), 0, static_cast<int32_t>(h)});
    }
  }
  run_largest_first(items, kMinParallelWork, [&](const Item& it) {
    thread_local std::vector<float> qbuf, mbuf, lbuf, abuf;
    const int64_t b = it.first, h = it.kv_head;
    qbuf.resize(G * D);
    load_queries(b, h, qbuf.data());
    const int64_t base = b * H + h * G;
    if (grouped[b]) {
      mbuf.assign(pre_m.begin() + base, pre_m.begin() + base + G);
      lbuf.assign(pre_l.begin() + base, pre_l.begin() + base + G);
      abuf.assign(pre_acc.begin() + base * D, pre_acc.begin() + (base + G) * D);
    } else {
      mbuf.assign(G, kNegInf);
      lbuf.assign(G, 0.f);
      abuf.assign(G * D, 0.f);
    }
    scan_for(h).run(qbuf.data(), G, idx + rs[b], rl[b], mbuf.data(), lbuf.data(),
                             abuf.data());
    for (int64_t i = 0; i < G; ++i) {
      T* o = op + (base + i) * D;
      const float li = lbuf[i];
      if (li > 0.f) {
        const float inv = 1.f / li;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(abuf[i * D + d] * inv);
        lp[base + i] = mbuf[i] + std::log(li);
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(0.f);
        lp[base + i] = kNegInf;
      }
    }
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
  // One call per dtype (T deduced from a zero of that type).
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
