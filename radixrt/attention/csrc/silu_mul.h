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

namespace radixrt_cpu {

// End of the vectorised part of a row of `inter` elements (a multiple of 2 * kVec).
template <typename T>
inline int64_t silu_mul_vec_end(int64_t inter) {
  const int64_t chunk = 2 * at::vec::Vectorized<T>::size();
  static_assert(2 * at::vec::Vectorized<T>::size() % (2 * kVec) == 0);
  return inter / chunk * chunk;
}

// 2 * kVec elements from gate / up (vector path): silu(gate) rounded to T, times up, as lo
// (the first kVec) and hi; the products are not yet rounded to T (store_pair<T> or
// round_pair<T> does that).
template <typename T>
inline void silu_times_up(const T* gate, const T* up, Vec& lo, Vec& hi) {
  const Vec x0 = load_f32<T>(gate), x1 = load_f32<T>(gate + kVec);
  Vec s0 = x0 / (Vec(1.f) + x0.neg().exp());
  Vec s1 = x1 / (Vec(1.f) + x1.neg().exp());
  round_pair<T>(s0, s1);
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
