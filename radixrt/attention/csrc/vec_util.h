// Vector helpers shared by radixrt's CPU kernels (paged_decode.cpp, fused_ops.cpp,
// extend_attention.cpp, qgemm_vnni.cpp): fp32 loads/stores of float / bfloat16 / half data,
// rounding to them, horizontal reductions, prefetch. Built on at::vec::Vectorized<float>, whose instruction set is the one
// the including file is compiled for (CPU_CAPABILITY_AVX512 / _AVX2 / generic).
//
// Invariant: every helper reads or writes exactly Vec::size() elements at `p` (no tails).

#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace radixrt_cpu {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();

#define RADIXRT_STR2(x) #x
#define RADIXRT_STR(x) RADIXRT_STR2(x)

// For helpers called inside the scans' inner loops. GCC's own choice is not stable: when
// 29447ab moved two inline expressions of the AVX-512 decode scan into `exp_masked` and
// `KeyScan::prefetch_pair`, GCC stopped inlining them and the scan ran 0.71-0.73x (stop 68).
#define RADIXRT_HOT_INLINE __attribute__((always_inline)) inline

// Vec::size() elements of T at p, converted to fp32.
template <typename T>
inline Vec load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    Vec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
  } else {
    static_assert(std::is_same_v<T, at::Half>, "float, BFloat16 or Half");
    Vec out;
    at::vec::load_fp32_from_fp16(p, out);
    return out;
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bfloat16 rounding in one instruction (vcvtneps2bf16: round to nearest even, like torch's
// software conversion) where the two agree: everywhere but denormal inputs (the instruction
// reads them as zero) and NaNs (whose bits torch's conversions choose). A vector holding either
// takes the software path, so results are bitwise what they were for every input. Fewer
// instructions per rounding for the norms', RoPE's and SiLU's several roundings per element
// (batch 8 on Zen 5: add_rms_norm 2.3 -> 2.0 us a call, rope_qk 2.2 -> 1.7).
#define RADIXRT_NATIVE_BF16 1
inline bool native_bf16_exact(__m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0;  // QNaN, denormal, SNaN
}
inline __m256i native_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#endif

// Two float vectors rounded to one vector of T (round to nearest even, as torch's conversions).
template <typename T>
inline at::vec::Vectorized<T> from_f32(const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(RADIXRT_NATIVE_BF16)
    if (native_bf16_exact(a) && native_bf16_exact(b)) {
      return at::vec::Vectorized<T>((__m512i)_mm512_cvtne2ps_pbh(b, a));  // a low, b high
    }
#endif
    return at::vec::convert_float_bfloat16(a, b);
  } else {
    return at::vec::convert_float_half(a, b);
  }
}

// The first Vec::size() elements of a vector of T, as fp32.
template <typename T>
inline Vec low_to_f32(const at::vec::Vectorized<T>& v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return std::get<0>(at::vec::convert_bfloat16_float(v));
  } else {
    return std::get<0>(at::vec::convert_half_float(v));
  }
}

// Round Vec::size() floats to T and store them at p.
template <typename T>
inline void store_f32(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
#if defined(RADIXRT_NATIVE_BF16)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (native_bf16_exact(v)) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), native_bf16(v));
        return;
      }
    }
#endif
    from_f32<T>(v, v).store(p, kVec);
  }
}

// The value `x` takes once stored in T (identity for float).
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// The values `v` takes once stored in T (identity for float): load_f32(store_f32(v)).
template <typename T>
inline Vec round_vec(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#if defined(RADIXRT_NATIVE_BF16)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (native_bf16_exact(v)) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(native_bf16(v)), 16));
      }
    }
#endif
    return low_to_f32<T>(from_f32<T>(v, v));
  }
}

// Stores v rounded to T at p and returns the stored values as fp32: store_f32 then round_vec in
// one conversion (the same bits, denormals and NaNs included).
template <typename T>
inline Vec store_rounded(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
    return v;
  } else {
#if defined(RADIXRT_NATIVE_BF16)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (native_bf16_exact(v)) {
        const __m256i b = native_bf16(v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      }
    }
#endif
    const at::vec::Vectorized<T> t = from_f32<T>(v, v);
    t.store(p, kVec);
    return low_to_f32<T>(t);
  }
}

// Two vectors rounded to T, in one conversion (both halves of a vector of T): the same values
// as round_vec on each (rounding is per element).
template <typename T>
inline void round_pair(Vec& a, Vec& b) {
  if constexpr (!std::is_same_v<T, float>) {
    const at::vec::Vectorized<T> t = from_f32<T>(a, b);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      std::tie(a, b) = at::vec::convert_bfloat16_float(t);
    } else {
      std::tie(a, b) = at::vec::convert_half_float(t);
    }
  }
}

// 2 * kVec floats rounded to T and stored at p (a, then b): store_f32 of each, one conversion.
template <typename T>
inline void store_pair(T* p, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kVec);
  } else {
    from_f32<T>(a, b).store(p);
  }
}

// Horizontal sum / max (the generic Vectorized's reduce_add / reduce_max do not compile).
inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  alignas(64) float a[kVec];
  v.store(a);
  float s = 0.f;
  for (int64_t i = 0; i < kVec; ++i) s += a[i];
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
  for (int64_t i = 1; i < kVec; ++i) m = std::max(m, a[i]);
  return m;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// 2^t per lane for finite t (0 below about -150): t = n + r with n = round(t) and r in
// [-0.5, 0.5] (exact), a degree-5 polynomial for 2^r (coefficients fitted for relative
// error; at most 2.4e-7 evaluated in fp32, against exp_u20's 20 ulp), scaled by 2^n with
// vscalefps. 8 instructions against exp_u20's 19 with its multiply by log2(e), which callers
// fold into the fused multiply-subtract that forms t.
RADIXRT_HOT_INLINE __m512 exp2_poly5(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.001327616861090064f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.009675540961325169f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05550714209675789f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022120237350464f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931469440460205f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
constexpr float kLog2e = 1.4426950408889634f;

// exp(x) per lane where `keep` is set, 0 elsewhere (padding lanes, whose x may be -inf).
RADIXRT_HOT_INLINE __m512 exp_masked(__mmask16 keep, __m512 x) {
  return _mm512_maskz_mov_ps(keep, exp2_poly5(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e))));
}
#endif

// Prefetch `bytes` starting at p, one line at a time: into L2 (prefetcht2) or, with `l1`, into
// every level (prefetcht0). Which one pays depends on the CPU (paged_decode.cpp, prefetch_l1).
RADIXRT_HOT_INLINE void prefetch_row(const void* p, int64_t bytes, bool l1 = false) {
  const char* c = static_cast<const char*>(p);
  if (l1) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
    return;
  }
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

}  // namespace radixrt_cpu
