// silu(gate) * up with ATen's rounding, the one copy of that arithmetic: radixrt::silu_mul
// (fused_ops.cpp) stores it, qgemm_vnni.cpp's SiLU-mul input quantizes it, so
// qgemm_vnni_silu(gate_up) is bitwise qgemm_vnni(silu_mul(gate_up)).
//
// As torch's `F.silu(gate) * up` in T: silu(x) = x / (1 + exp(-x)) in fp32, rounded to T, times
// up, rounded to T. ATen's cpu_kernel_vec runs the vectorised silu (at::vec's exp) over whole
// chunks of 2 * Vectorized<T>::size() elements of a row and the scalar one (std::exp) on the
// rest, so which path an element takes depends on its index and the row width `inter`:
// elements [0, silu_mul_vec_end<T>(inter)) the vector one, 2 * kVec at a time from index 0 (each
// element's value depends on the path only, not on how many lanes are converted at once).
//
// There is no a * b + c here, so FP contraction (on in qgemm_vnni.cpp, off in fused_ops.cpp)
// cannot change a result.

#pragma once

#include "vec_util.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace radixrt_cpu {

// End of the vectorised part of a row of `inter` elements (a multiple of 2 * kVec).
template <typename T>
inline int64_t silu_mul_vec_end(int64_t inter) {
  const int64_t chunk = 2 * at::vec::Vectorized<T>::size();
  static_assert(2 * at::vec::Vectorized<T>::size() % (2 * kVec) == 0);
  return inter / chunk * chunk;
}

// silu(x) = x / (1 + exp(-x)) of 2 * kVec fp32 lanes, rounded to T: the vector path's
// arithmetic, in place.
template <typename T>
inline void silu_rounded_pair(Vec& a, Vec& b) {
  a = a / (Vec(1.f) + a.neg().exp());
  b = b / (Vec(1.f) + b.neg().exp());
  round_pair<T>(a, b);
}

#if defined(CPU_CAPABILITY_AVX512)
// The vector path's silu rounded to bf16, for every bf16 input by its 16 bits: that value is a
// function of those bits alone, so the table is bitwise the arithmetic (tests/
// test_fused_ops.py compares the two over all 65536 inputs). Built on first use, read-only
// after; one extra entry because a gather reads 4 bytes. A gather of 16 entries in place of
// at::vec's exp and a division (AMX Xeon, stop 68): silu_mul 512 x 1536 257 -> 116 us,
// amx_linear_silu 512 x [3072, 576] over 30 weights 1042 -> 897 us a call.
inline const uint16_t* silu_bf16_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 1, 0);
    alignas(64) uint16_t bits[2 * kVec];
    alignas(64) float out[2 * kVec];
    for (int64_t base = 0; base < 65536; base += 2 * kVec) {
      for (int64_t j = 0; j < 2 * kVec; ++j) bits[j] = static_cast<uint16_t>(base + j);
      const auto* x = reinterpret_cast<const at::BFloat16*>(bits);
      Vec a = load_f32<at::BFloat16>(x), b = load_f32<at::BFloat16>(x + kVec);
      silu_rounded_pair<at::BFloat16>(a, b);
      a.store(out);
      b.store(out + kVec);
      for (int64_t j = 0; j < 2 * kVec; ++j) {
        uint32_t u;
        std::memcpy(&u, out + j, 4);
        t[base + j] = static_cast<uint16_t>(u >> 16);  // exact: out[j] is a bf16 value
      }
    }
    return t;
  }();
  return table.data();
}

// kVec table entries for the bf16 inputs at g, as fp32.
RADIXRT_HOT_INLINE Vec silu_bf16_lookup(const uint16_t* table, const at::BFloat16* g) {
  const __m512i idx =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  const __m512i v = _mm512_i32gather_epi32(idx, table, 2);
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
}
#endif

// 2 * kVec elements from gate / up (vector path): silu(gate) rounded to T, times up, as lo
// (the first kVec) and hi; the products are not yet rounded to T (store_pair<T> or
// round_pair<T> does that).
template <typename T>
inline void silu_times_up(const T* gate, const T* up, Vec& lo, Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint16_t* table = silu_bf16_table();
    lo = silu_bf16_lookup(table, gate) * load_f32<T>(up);
    hi = silu_bf16_lookup(table, gate + kVec) * load_f32<T>(up + kVec);
    return;
  }
#endif
  Vec s0 = load_f32<T>(gate), s1 = load_f32<T>(gate + kVec);
  silu_rounded_pair<T>(s0, s1);
  lo = s0 * load_f32<T>(up);
  hi = s1 * load_f32<T>(up + kVec);
}

// One element (scalar path), likewise not yet rounded to T.
template <typename T>
inline float silu_times_up_scalar(T gate, T up) {
  const float x = static_cast<float>(gate);
  const float s = round_to<T>(x / (1.0f + std::exp(-x)));
  return s * static_cast<float>(up);
}

}  // namespace radixrt_cpu
