// The layouts of radixrt's KV pool buffers that the CPU kernels reading or writing them in place
// accept (paged_decode.cpp, extend_attention.cpp, fused_ops.cpp's kv_store): K and V
// `[slots, kv_heads, D]` with the same sizes and strides and D contiguous. Slot and head strides
// are free: the CPU pool is head-major (slot stride D), CUDA pools slot-major
// (radixrt/mem/memory_pool.py); kernels address row (slot, head) at
// slot * stride(0) + head * stride(1).

#pragma once

#include <ATen/ATen.h>

namespace radixrt_cpu {

inline void check_kv_buffers(const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                             const char* op) {
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.stride(2) == 1 &&
                  v_buffer.sizes() == k_buffer.sizes() && v_buffer.strides() == k_buffer.strides(),
              op, ": k_buffer / v_buffer must be [slots, kv_heads, D] alike, D contiguous");
}

}  // namespace radixrt_cpu
