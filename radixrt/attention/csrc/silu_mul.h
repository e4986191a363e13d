// silu(gate) * up with ATen's rounding, the one copy of that arithmetic: radixrt::silu_mul
// (fused_ops.cpp) stores it, qgemm_vnni.cpp's SiLU-mul input quantizes it, so
// qgemm_vnni_silu(gate_up) is bitwise qgemm_vnni(silu_mul(gate_up)).
//
// As torch's `F.silu(gate) * up` in T: silu(x) = x / (1 + exp(-x)) in fp32, rounded to T, times
// up, rounded to T. ATen's cpu_kernel_vec runs the vectorised silu (at::vec's exp) over whole
// chunks of 2 * Vectorized<T>::size() elements of a row and the scalar one (std::exp) on the
// rest, so which path an element takes depends on its index and the row width `inter`:
// elements [0, silu_mul_vec_end<T>(inter)) the vector one, kVec at a time from index 0.
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
  return inter / chunk * chunk;
}

// kVec elements from gate / up (vector path): silu(gate) rounded to T, times up; the product
// is not yet rounded to T (store_f32<T> or round_vec<T> does that).
template <typename T>
inline Vec silu_times_up(const T* gate, const T* up) {
  const Vec x = load_f32<T>(gate);
  const Vec s = round_vec<T>(x / (Vec(1.f) + x.neg().exp()));
  return s * load_f32<T>(up);
}

// One element (scalar path), likewise not yet rounded to T.
template <typename T>
inline float silu_times_up_scalar(T gate, T up) {
  const float x = static_cast<float>(gate);
  const float s = round_to<T>(x / (1.0f + std::exp(-x)));
  return s * static_cast<float>(up);
}

}  // namespace radixrt_cpu
