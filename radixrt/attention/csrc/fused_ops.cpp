// Fused element-wise ops of a decoder layer (CPU): the small ops between the matmuls and the
// attention, each one pass over its rows instead of several torch kernels and temporaries.
//
//   rms_norm(x, weight, eps) -> out;  add_rms_norm(x, residual, weight, eps) -> (out, x + residual)
//   add_rms_norm_(x, residual, weight, eps): the same in place (residual <- x + residual, x <- out)
//       out = RMSNorm(x or x + residual) * weight, HF's rounding order: normalise in fp32, round to the
//       model dtype, then multiply by weight (fp32: (r * inv) * w, as F.rms_norm).
//   silu_mul(gate_up [n, 2I]) -> [n, I]: silu(gate) * up, each op rounded to the dtype.
//   rope_qk(qkv [n, >= (Hq + Hkv) * D], cos [n, D], sin [n, D], Hq, Hkv) -> (q [n,Hq,D], k [n,Hkv,D])
//       rotate-half RoPE with the cache layout of radixrt/model/rope.py (cos duplicated over both
//       halves, sin with its first half negated): x * cos + roll(x, D/2) * sin, each op rounded.
//   kv_store(k_buffer, v_buffer, loc, k, v): k_buffer[loc[i]] = k[i] (and v), strided sources and
//   pool buffers (any slot / head strides); fp32 k / v into a float16 pool (a narrowed pool) are
//   rounded to nearest even as torch's .to(torch.float16) rounds them.
//
// Numerics: every op reproduces the rounding of the torch code it replaces (radixrt/model/llama.py,
// rope.py): the same intermediate roundings to the model dtype, the sum of squares in the order of
// ATen's vectorised inner sum (see sum_squares_like_aten), silu as x / (1 + exp(-x)) with at::vec's exp on the
// vectorised part and std::exp on the loop remainder, as ATen's cpu_kernel_vec does (silu_mul.h,
// shared with qgemm_vnni.cpp's SiLU-mul input). Compiled for
// the same instruction set as torch's dispatch (torch.backends.cpu.get_cpu_capability()), results
// are bitwise those of the torch path; `fused_ops_isa()` says which one this build is, so callers
// can tell. FP contraction is off in this file: an a*b+c contracted to an fma would round once
// where torch rounds twice.
//
// Rows are independent (no op mixes rows), so every result is batch invariant. Rows are split
// over threads only above kMinParallelElems elements.

#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "kv_pool_layout.h"
#include "silu_mul.h"
#include "team.h"
#include "vec_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;
// Below this many elements an op runs on the calling thread (waking threads costs more). At
// 16384 a 64-row decode step's norms and RoPE take both threads (Zen 5, with the scheduler's
// brief OpenMP waiting: whole step 1.03x faster than at 131072); 8 rows stay on one.
constexpr int64_t kMinParallelElems = 16384;

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t r = 0;
  uint64_t v = static_cast<uint64_t>(x) - 1;
  while (v) {
    ++r;
    v >>= 1;
  }
  return r;
}

// Lanes of ATen's float sum: its reduction kernels are registered with REGISTER_DISPATCH, which
// leaves the AVX512 slot empty, so AVX512 CPUs run the AVX2 build (Vectorized<float> of 8), and
// the DEFAULT build's Vectorized<float> is 32 bytes too.
constexpr int64_t kSumLanes = 8;

// Eight fp32 lanes of sum_squares_like_aten's accumulators: one AVX register where the build
// has AVX2 (GCC had left the scalar lane loops as loads and stores of an array: a 512 x 576
// add_rms_norm_ took 75 us with its rows in the caches, 68 with the register), else an array.
// Lane by lane the same roundings either way (a product, then a sum).
#if defined(__AVX2__)
struct Lanes8 {
  __m256 v;
  static Lanes8 zero() { return {_mm256_setzero_ps()}; }
  static Lanes8 squares(const float* p) {
    const __m256 x = _mm256_loadu_ps(p);
    return {_mm256_mul_ps(x, x)};
  }
  Lanes8 operator+(const Lanes8& o) const { return {_mm256_add_ps(v, o.v)}; }
  void store(float* out) const { _mm256_storeu_ps(out, v); }
};
#else
struct Lanes8 {
  float v[kSumLanes];
  static Lanes8 zero() { return {}; }
  static Lanes8 squares(const float* p) {
    Lanes8 a;
    for (int64_t l = 0; l < kSumLanes; ++l) a.v[l] = p[l] * p[l];
    return a;
  }
  Lanes8 operator+(const Lanes8& o) const {
    Lanes8 a;
    for (int64_t l = 0; l < kSumLanes; ++l) a.v[l] = v[l] + o.v[l];
    return a;
  }
  void store(float* out) const { std::copy_n(v, kSumLanes, out); }
};
#endif

// Sum of x[i]^2 (fp32) over a row, in the order of ATen's `vectorized_inner_sum` over the
// materialised squares (SumKernel.cpp): `row_sum` over whole 8-lane vectors with 4 interleaved
// accumulators, each a 4-level cascade of 2^level_power steps (`multi_row_sum`); then the
// scalar remainder into a scalar that starts at 0, then the lanes in order.
inline float sum_squares_like_aten(const float* x, int64_t n) {
  constexpr int64_t L = kSumLanes;
  constexpr int64_t ilp = 4;
  constexpr int64_t levels = 4;
  const int64_t vec_size = n / L;
  const int64_t size_ilp = vec_size / ilp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size_ilp) / levels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  Lanes8 acc[levels][ilp];
  for (int64_t j = 0; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) acc[j][k] = Lanes8::zero();
  auto sq = [x](int64_t v) { return Lanes8::squares(x + v * L); };
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int64_t k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + sq(i * ilp + k);
    }
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = Lanes8::zero();
      }
      const int64_t mask = level_mask << (j * level_power);
      if ((i & mask) != 0) break;
    }
  }
  for (; i < size_ilp; ++i) {
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + sq(i * ilp + k);
  }
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + acc[j][k];
  Lanes8 part = acc[0][0];
  for (int64_t v = size_ilp * ilp; v < vec_size; ++v) part = part + sq(v);
  for (int64_t k = 1; k < ilp; ++k) part = part + acc[0][k];
  float total = 0.f;
  for (int64_t k = vec_size * L; k < n; ++k) {
    const float sq1 = x[k] * x[k];
    total = total + sq1;
  }
  alignas(32) float lanes[L];
  part.store(lanes);
  for (int64_t l = 0; l < L; ++l) total = total + lanes[l];
  return total;
}

template <typename F>
void for_rows(int64_t rows, int64_t elems_per_row, const F& f) {
  if (TeamMember* m = team_member()) {  // this member's rows, then the team meets
    if (m->whole_rows) {  // every row, into this member's own memory (team.h): no meeting
      m->whole_rows = false;
      if (rows > 0) f(0, rows);
      return;
    }
    const auto [lo, hi] = m->rows(rows);
    if (lo < hi) f(lo, hi);
    if (m->rows_stay) {  // the next op reads these rows on this member only (team.h)
      m->rows_stay = false;
      return;
    }
    m->barrier();
    return;
  }
  const int64_t total = rows * std::max<int64_t>(1, elems_per_row);
  if (total < kMinParallelElems || rows < 2) {
    f(0, rows);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kMinParallelElems / std::max<int64_t>(1, elems_per_row) / 2);
  at::parallel_for(0, rows, grain, f);
}

// Calls f(T{}) for T = float, at::BFloat16 or at::Half (the model dtypes), else raises.
template <typename F>
void dispatch_dtype(at::ScalarType st, const char* op, const F& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    default:
      TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", st);
  }
}

void check_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(1) == 1, name, " must be contiguous in its last dimension");
}

// ---------------------------------------------------------------------------------------------
// add_rms_norm

template <typename T>
void add_rms_norm_impl(const Tensor& x, const Tensor* residual, const Tensor& weight, double eps,
                       Tensor& out, Tensor& res_out) {
  const int64_t n = x.size(0), d = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = residual ? res_out.data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  const float fd = static_cast<float>(d);
  for_rows(n, d, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(2 * d);
    float* f = buf.data();
    float* wf = f + d;  // the weight in fp32 (exact), converted once for the rows
    int64_t i = 0;
    for (; i + kVec <= d; i += kVec) load_f32<T>(wp + i).store(wf + i);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * xs;
      // residual stream in T, kept in fp32 (exact) for the norm
      i = 0;
      if (rp) {
        const T* rr = rp + r * rs;
        T* sr = sp + r * d;
        for (; i + kVec <= d; i += kVec) {
          store_rounded<T>(sr + i, load_f32<T>(xr + i) + load_f32<T>(rr + i)).store(f + i);
        }
        for (; i < d; ++i) {
          const float s = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          sr[i] = static_cast<T>(s);
          f[i] = s;
        }
      } else {
        for (; i + kVec <= d; i += kVec) load_f32<T>(xr + i).store(f + i);
        for (; i < d; ++i) f[i] = static_cast<float>(xr[i]);
      }
      float var = sum_squares_like_aten(f, d) / fd;
      var = var + feps;
      const float inv = 1.f / std::sqrt(var);
      const Vec vinv(inv);
      T* orow = op + r * d;
      i = 0;
      for (; i + kVec <= d; i += kVec) {
        // fp32: (r * inv) * w; other dtypes: round(r * inv) to T, then * w rounded to T
        const Vec y = round_vec<T>(Vec::loadu(f + i) * vinv);
        store_f32<T>(orow + i, y * Vec::loadu(wf + i));
      }
      for (; i < d; ++i) {
        const float y = round_to<T>(f[i] * inv);
        orow[i] = static_cast<T>(y * static_cast<float>(wp[i]));
      }
    }
  });
}

// The checks of every norm op: x [n, d] rows, weight [d], residual (if any) x's shape and dtype.
void check_norm_args(const Tensor& x, const Tensor* residual, const Tensor& weight) {
  check_rows(x, "rms_norm: x");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous(),
              "rms_norm: weight must be contiguous [", d, "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype ",
              weight.scalar_type(), " != x dtype ", x.scalar_type());
  if (residual != nullptr) {
    check_rows(*residual, "add_rms_norm: residual");
    TORCH_CHECK(residual->size(0) == n && residual->size(1) == d,
                "add_rms_norm: residual shape must equal x's");
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "add_rms_norm: residual dtype ",
                residual->scalar_type(), " != x dtype ", x.scalar_type());
  }
}

Tensor rms_norm_into(const Tensor& x, const Tensor* residual, const Tensor& weight, double eps,
                     Tensor& res_out) {
  check_norm_args(x, residual, weight);
  Tensor out = team_empty({x.size(0), x.size(1)}, x.options());
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto t) {
    add_rms_norm_impl<decltype(t)>(x, residual, weight, eps, out, res_out);
  });
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor unused;
  return rms_norm_into(x, nullptr, weight, eps, unused);
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual,
                                        const Tensor& weight, double eps) {
  Tensor res_out = team_empty({x.size(0), x.size(1)}, x.options());
  Tensor out = rms_norm_into(x, &residual, weight, eps, res_out);
  return {out, res_out};
}

// add_rms_norm in place: residual = x + residual, then x = rms_norm(that). Both are rows the
// caller has just produced and reads no more, so the stores land in lines the loads brought in
// (a fresh output's stores each fetched a line from memory first: a 512 x 576 bf16 call in a
// prefill took 134 us against 69 with its outputs in the caches). Row r is read whole before
// any of its elements is written, so the results are bitwise add_rms_norm's.
void add_rms_norm_inplace(Tensor x, Tensor residual, const Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(),
              "add_rms_norm_: x and residual must be contiguous");
  TORCH_CHECK(x.data_ptr() != residual.data_ptr(),
              "add_rms_norm_: x and residual must not share memory");
  check_norm_args(x, &residual, weight);
  dispatch_dtype(x.scalar_type(), "add_rms_norm_", [&](auto t) {
    add_rms_norm_impl<decltype(t)>(x, &residual, weight, eps, x, residual);
  });
}

// ---------------------------------------------------------------------------------------------
// silu_mul

template <typename T>
void silu_mul_impl(const Tensor& gu, Tensor& out) {
  const int64_t n = gu.size(0), inter = gu.size(1) / 2;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gu.stride(0);
  const int64_t vec_end = silu_mul_vec_end<T>(inter);  // see silu_mul.h
  for_rows(n, 3 * inter, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
      for (; i < vec_end; i += 2 * kVec) {
        Vec lo, hi;
        silu_times_up<T>(g + i, u + i, lo, hi);
        store_pair<T>(o + i, lo, hi);
      }
      for (; i < inter; ++i) o[i] = static_cast<T>(silu_times_up_scalar<T>(g[i], u[i]));
    }
  });
}

Tensor silu_mul(const Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up width must be even");
  Tensor out = team_empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_dtype(gate_up.scalar_type(), "silu_mul",
                 [&](auto t) { silu_mul_impl<decltype(t)>(gate_up, out); });
  return out;
}

// ---------------------------------------------------------------------------------------------
// rope_qk

template <typename T>
inline void rope_head(const T* x, const T* c, const T* s, T* o, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t base = half * h, other = (1 - half) * h;
    int64_t i = 0;
    for (; i + kVec <= h; i += kVec) {
      const Vec a = round_vec<T>(load_f32<T>(x + base + i) * load_f32<T>(c + base + i));
      const Vec b = round_vec<T>(load_f32<T>(x + other + i) * load_f32<T>(s + base + i));
      store_f32<T>(o + base + i, a + b);
    }
    for (; i < h; ++i) {
      const float a = round_to<T>(static_cast<float>(x[base + i]) * static_cast<float>(c[base + i]));
      const float b = round_to<T>(static_cast<float>(x[other + i]) * static_cast<float>(s[base + i]));
      o[base + i] = static_cast<T>(a + b);
    }
  }
}

// rope_head for a head whose half is whole vectors, with the row's cos / sin already in fp32
// (converted once for all its heads) and each x element loaded once: the same arithmetic, element
// by element (a 512-row prefill's rope_qk on the AMX Xeon, stop 68: see the README).
template <typename T>
inline void rope_head_vec(const T* x, const float* c, const float* s, T* o, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; i += kVec) {
    const Vec x0 = load_f32<T>(x + i), x1 = load_f32<T>(x + h + i);
    const Vec a0 = round_vec<T>(x0 * Vec::loadu(c + i));
    const Vec b0 = round_vec<T>(x1 * Vec::loadu(s + i));
    store_f32<T>(o + i, a0 + b0);
    const Vec a1 = round_vec<T>(x1 * Vec::loadu(c + h + i));
    const Vec b1 = round_vec<T>(x0 * Vec::loadu(s + h + i));
    store_f32<T>(o + h + i, a1 + b1);
  }
}

constexpr int64_t kRopeVecMaxDim = 256;  // rope_head_vec's widest head (its fp32 cos / sin rows)

template <typename T>
void rope_qk_impl(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t hq,
                  int64_t hkv, int64_t d, Tensor& q, Tensor& k) {
  const int64_t n = qkv.size(0);
  const T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  const bool vec_heads = (d / 2) % kVec == 0 && d <= kRopeVecMaxDim;
  for_rows(n, (hq + hkv) * d, [&](int64_t r0, int64_t r1) {
    alignas(64) float cf[kRopeVecMaxDim], sf[kRopeVecMaxDim];
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = xp + r * xs;
      const T* c = cp + r * cs;
      const T* s = sp + r * ss;
      if (vec_heads) {
        for (int64_t i = 0; i < d; i += kVec) {
          load_f32<T>(c + i).store(cf + i);
          load_f32<T>(s + i).store(sf + i);
        }
        for (int64_t hh = 0; hh < hq; ++hh)
          rope_head_vec<T>(x + hh * d, cf, sf, qp + (r * hq + hh) * d, d);
        for (int64_t hh = 0; hh < hkv; ++hh)
          rope_head_vec<T>(x + (hq + hh) * d, cf, sf, kp + (r * hkv + hh) * d, d);
        continue;
      }
      for (int64_t hh = 0; hh < hq; ++hh) rope_head<T>(x + hh * d, c, s, qp + (r * hq + hh) * d, d);
      for (int64_t hh = 0; hh < hkv; ++hh)
        rope_head<T>(x + (hq + hh) * d, c, s, kp + (r * hkv + hh) * d, d);
    }
  });
}

std::tuple<Tensor, Tensor> rope_qk(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                   int64_t num_q_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rope_qk: qkv");
  check_rows(cos, "rope_qk: cos");
  check_rows(sin, "rope_qk: sin");
  const int64_t n = qkv.size(0), d = cos.size(1);
  TORCH_CHECK(d % 2 == 0 && sin.size(1) == d, "rope_qk: cos/sin must be [n, head_dim], even");
  TORCH_CHECK(cos.size(0) == n && sin.size(0) == n, "rope_qk: cos/sin rows != qkv rows");
  TORCH_CHECK(qkv.size(1) >= (num_q_heads + num_kv_heads) * d, "rope_qk: qkv too narrow");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_qk: cos/sin dtype must equal qkv's");
  Tensor q = team_empty({n, num_q_heads, d}, qkv.options());
  Tensor k = team_empty({n, num_kv_heads, d}, qkv.options());
  dispatch_dtype(qkv.scalar_type(), "rope_qk", [&](auto t) {
    rope_qk_impl<decltype(t)>(qkv, cos, sin, num_q_heads, num_kv_heads, d, q, k);
  });
  return {q, k};
}

// ---------------------------------------------------------------------------------------------
// kv_store

// The slot list of a pool op, checked against the pool's slot count (contiguous copy).
Tensor checked_slots(const Tensor& loc, int64_t slots, const char* op) {
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1, op, ": slots must be int64 [n]");
  Tensor c = loc.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < slots, op, ": slot ", p[i], " out of range [0, ", slots,
                ")");
  }
  return c;
}

// An int8 pool: int8 K/V buffers and their float32 [slots, kv_heads] scales, K and V alike.
void check_i8_pool(const Tensor& k_buffer, const Tensor& v_buffer, const Tensor& k_scale,
                   const Tensor& v_scale, const char* op) {
  check_kv_buffers(k_buffer, v_buffer, op);
  TORCH_CHECK(k_buffer.scalar_type() == at::kChar, op, ": the pool must be int8");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && k_scale.dim() == 2 &&
                  k_scale.size(0) == k_buffer.size(0) && k_scale.size(1) == k_buffer.size(1) &&
                  v_scale.sizes() == k_scale.sizes() && v_scale.strides() == k_scale.strides(),
              op, ": k_scale / v_scale must be float32 [slots, kv_heads] alike");
}

// One fp32 row of d elements rounded to half (nearest even, as torch's conversion).
inline void row_to_half(const float* src, at::Half* dst, int64_t d) {
  int64_t e = 0;
#if defined(__F16C__)
  for (; e + 8 <= d; e += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), h);
  }
#endif
  for (; e < d; ++e) dst[e] = static_cast<at::Half>(src[e]);
}

// kv_store of fp32 k / v into a float16 pool.
void kv_store_narrowed(Tensor& k_buffer, Tensor& v_buffer, const Tensor& loc_c, const Tensor& k,
                       const Tensor& v) {
  const int64_t n = loc_c.size(0), heads = k_buffer.size(1), d = k_buffer.size(2);
  const int64_t* lp = loc_c.data_ptr<int64_t>();
  at::Half* kb = k_buffer.data_ptr<at::Half>();
  at::Half* vb = v_buffer.data_ptr<at::Half>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t b0 = k_buffer.stride(0), b1 = k_buffer.stride(1);
  for_rows(n, 2 * heads * d, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        row_to_half(kp + i * k.stride(0) + h * k.stride(1), kb + lp[i] * b0 + h * b1, d);
        row_to_half(vp + i * v.stride(0) + h * v.stride(1), vb + lp[i] * b0 + h * b1, d);
      }
    }
  });
}

void kv_store(Tensor k_buffer, Tensor v_buffer, const Tensor& loc, const Tensor& k,
              const Tensor& v) {
  check_kv_buffers(k_buffer, v_buffer, "kv_store");
  const Tensor loc_c = checked_slots(loc, k_buffer.size(0), "kv_store");
  const int64_t n = loc.size(0), heads = k_buffer.size(1), d = k_buffer.size(2);
  TORCH_CHECK(v_buffer.scalar_type() == k_buffer.scalar_type(),
              "kv_store: k_buffer and v_buffer must have one dtype");
  const bool narrowed = k_buffer.scalar_type() == at::kHalf && k.scalar_type() == at::kFloat;
  for (const Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == heads && t->size(2) == d,
                "kv_store: k/v must be [n, kv_heads, head_dim]");
    TORCH_CHECK(t->scalar_type() == k_buffer.scalar_type() ||
                    (narrowed && t->scalar_type() == at::kFloat),
                "kv_store: k/v dtype must be the pool's (or float32 into a float16 pool)");
    TORCH_CHECK(t->stride(2) == 1, "kv_store: k/v must be contiguous in head_dim");
  }
  if (narrowed) return kv_store_narrowed(k_buffer, v_buffer, loc_c, k, v);
  const int64_t* lp = loc_c.data_ptr<int64_t>();
  const int64_t es = k_buffer.element_size();
  const int64_t row_bytes = d * es;
  const int64_t slot_bytes = k_buffer.stride(0) * es, head_bytes = k_buffer.stride(1) * es;
  char* kb = static_cast<char*>(k_buffer.data_ptr());
  char* vb = static_cast<char*>(v_buffer.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k0 = k.stride(0) * es, k1 = k.stride(1) * es;
  const int64_t v0 = v.stride(0) * es, v1 = v.stride(1) * es;
  for_rows(n, 2 * heads * d, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t dst = lp[i] * slot_bytes;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(kb + dst + h * head_bytes, kp + i * k0 + h * k1, row_bytes);
        std::memcpy(vb + dst + h * head_bytes, vp + i * v0 + h * v1, row_bytes);
      }
    }
  });
}

// kv_store_i8(k_buffer, v_buffer, k_scale, v_scale, loc, k, v): each (token, KV head) row x of
// k (and v) quantized into an int8 pool: scale = max|x| / 127, codes round(x * (127 / max|x|))
// (nearest even; all zeros when max|x| = 0), as radixrt/mem/kv_quant.py computes them in torch.

template <typename S>
void quantize_row(const S* x, int64_t d, int8_t* codes, float* scale) {
#if defined(CPU_CAPABILITY_AVX512)
  // Whole vectors (head dims 16..256 in steps of 16): the same products, and the conversion
  // rounds to nearest even as nearbyint does in the default rounding mode, so the same codes
  // (~4x faster than the scalar loops, a decode step's 3 us a layer at 8 rows).
  if (d % 16 == 0 && d <= 256) {
    __m512 v[16];
    __m512 mx = _mm512_setzero_ps();
    const int64_t n = d / 16;
    for (int64_t i = 0; i < n; ++i) {
      v[i] = load_f32<S>(x + 16 * i);  // Vec of 16 on this build
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v[i]));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int64_t i = 0; i < n; ++i) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * i),
                       _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(c, lo), hi)));
    }
    *scale = amax / 127.f;
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::abs(static_cast<float>(x[e])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t e = 0; e < d; ++e) {
    const float c = std::nearbyint(static_cast<float>(x[e]) * inv);
    codes[e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
  }
  *scale = amax / 127.f;
}

void kv_store_i8(Tensor k_buffer, Tensor v_buffer, Tensor k_scale, Tensor v_scale,
                 const Tensor& loc, const Tensor& k, const Tensor& v) {
  check_i8_pool(k_buffer, v_buffer, k_scale, v_scale, "kv_store_i8");
  const Tensor loc_c = checked_slots(loc, k_buffer.size(0), "kv_store_i8");
  const int64_t n = loc.size(0), heads = k_buffer.size(1), d = k_buffer.size(2);
  for (const Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == heads && t->size(2) == d,
                "kv_store_i8: k/v must be [n, kv_heads, head_dim]");
    TORCH_CHECK(t->scalar_type() == k.scalar_type(), "kv_store_i8: k and v must have one dtype");
    TORCH_CHECK(t->stride(2) == 1, "kv_store_i8: k/v must be contiguous in head_dim");
  }
  const int64_t* lp = loc_c.data_ptr<int64_t>();
  int8_t* kb = k_buffer.data_ptr<int8_t>();
  int8_t* vb = v_buffer.data_ptr<int8_t>();
  float* ks = k_scale.data_ptr<float>();
  float* vs = v_scale.data_ptr<float>();
  const int64_t b0 = k_buffer.stride(0), b1 = k_buffer.stride(1);
  const int64_t s0 = k_scale.stride(0), s1 = k_scale.stride(1);
  auto run = [&](auto zero) {
    using S = decltype(zero);
    const S* kp = k.data_ptr<S>();
    const S* vp = v.data_ptr<S>();
    for_rows(n, 2 * heads * d, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          quantize_row(kp + i * k.stride(0) + h * k.stride(1), d, kb + lp[i] * b0 + h * b1,
                       ks + lp[i] * s0 + h * s1);
          quantize_row(vp + i * v.stride(0) + h * v.stride(1), d, vb + lp[i] * b0 + h * b1,
                       vs + lp[i] * s0 + h * s1);
        }
      }
    });
  };
  switch (k.scalar_type()) {
    case at::kFloat:
      return run(0.f);
    case at::kBFloat16:
      return run(at::BFloat16(0.f));
    case at::kHalf:
      return run(at::Half(0.f));
    default:
      TORCH_CHECK(false, "kv_store_i8: k/v must be float32, bfloat16 or float16");
  }
}

// kv_read_i8(k_buffer, v_buffer, k_scale, v_scale, slots, dtype) -> (k, v): the rows of an int8
// pool at `slots`, dequantized (codes * scale, rounded once to dtype) into contiguous
// [n, kv_heads, head_dim] tensors; bitwise radixrt/mem/kv_quant.py's dequantize_rows.

template <typename T>
void dequantize_row(const int8_t* codes, float scale, int64_t d, T* out) {
  for (int64_t e = 0; e < d; ++e) out[e] = static_cast<T>(static_cast<float>(codes[e]) * scale);
}

std::tuple<Tensor, Tensor> kv_read_i8(const Tensor& k_buffer, const Tensor& v_buffer,
                                      const Tensor& k_scale, const Tensor& v_scale,
                                      const Tensor& slots, at::ScalarType dtype) {
  check_i8_pool(k_buffer, v_buffer, k_scale, v_scale, "kv_read_i8");
  const Tensor sl = checked_slots(slots, k_buffer.size(0), "kv_read_i8");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t n = slots.numel(), heads = k_buffer.size(1), d = k_buffer.size(2);
  Tensor k = team_empty({n, heads, d}, k_buffer.options().dtype(dtype));
  Tensor v = team_empty({n, heads, d}, k_buffer.options().dtype(dtype));
  const int8_t* kb = k_buffer.data_ptr<int8_t>();
  const int8_t* vb = v_buffer.data_ptr<int8_t>();
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  const int64_t b0 = k_buffer.stride(0), b1 = k_buffer.stride(1);
  const int64_t s0 = k_scale.stride(0), s1 = k_scale.stride(1);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    T* ko = k.data_ptr<T>();
    T* vo = v.data_ptr<T>();
    for_rows(n, 2 * heads * d, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t c = sp[i] * b0 + h * b1, sc = sp[i] * s0 + h * s1;
          dequantize_row(kb + c, ks[sc], d, ko + (i * heads + h) * d);
          dequantize_row(vb + c, vs[sc], d, vo + (i * heads + h) * d);
        }
      }
    });
  };
  switch (dtype) {
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
      TORCH_CHECK(false, "kv_read_i8: dtype must be float32, bfloat16 or float16");
  }
  return {k, v};
}

std::string fused_ops_isa() {
#if defined(CPU_CAPABILITY)
  return RADIXRT_STR(CPU_CAPABILITY);
#else
  return "DEFAULT";
#endif
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads)"
        " -> (Tensor, Tensor)");
  m.def("kv_store(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()");
  m.def("kv_store_i8(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor loc, Tensor k, Tensor v) -> ()");
  m.def("kv_read_i8(Tensor k_buffer, Tensor v_buffer, Tensor k_scale, Tensor v_scale, "
        "Tensor slots, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("fused_ops_isa() -> str", &radixrt_cpu::fused_ops_isa);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("rms_norm", &radixrt_cpu::rms_norm);
  m.impl("add_rms_norm", &radixrt_cpu::add_rms_norm);
  m.impl("add_rms_norm_", &radixrt_cpu::add_rms_norm_inplace);
  m.impl("silu_mul", &radixrt_cpu::silu_mul);
  m.impl("rope_qk", &radixrt_cpu::rope_qk);
  m.impl("kv_store", &radixrt_cpu::kv_store);
  m.impl("kv_store_i8", &radixrt_cpu::kv_store_i8);
  m.impl("kv_read_i8", &radixrt_cpu::kv_read_i8);
}
