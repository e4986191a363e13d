// Every decoder layer of one decode step in one call: the same radixrt ops the Python layer loop
// (radixrt/model/llama.py, LlamaDecoderLayer with FusedCpuLayerOps) calls, in the same order on
// the same tensors, so the result is bitwise that of the loop. What it removes is the per-op
// Python cost (module calls, argument parsing: ~100 us per layer, a third of a small batch's
// step), not any arithmetic.
//
//   decode_layers(h, cos, sin, norms, weights, meta, k_buffers, v_buffers, loc, <paged plan>,
//                 num_heads, num_kv_heads, head_dim, eps, scale) -> (h, residual)
//
// Per layer l: norms[2l], norms[2l + 1] are the input / post-attention RMSNorm weights; its four
// matmuls (qkv, o, gate_up, down) are linears 4l .. 4l + 3. Linear i owns weights[5i .. 5i + 5)
// = (a, b, c, dense, bias) and meta[3i .. 3i + 3) = (kind, bits, max_rows):
//   kind 0 (dense):  y = linear(x, a, bias)
//   kind 1 (qgemv):  rows > max_rows and a dense copy: y = linear(x, dense, bias); else
//                    y = qgemv(x, codes a, scale b, offset c, bits) (+ bias)
//   kind 2 (vnni):   the same rule, with y = qgemm_vnni(x, packed a, bits) (+ bias)
// The MLP's down projection takes silu_mul(gate_up); on a vnni linear running its kernel, that
// is qgemm_vnni_silu(gate_up, ...) instead: the SiLU-mul computed while quantizing the
// activations, bitwise qgemm_vnni(silu_mul(gate_up)) (one op and one intermediate fewer).
// The attention of layer l writes this step's K/V at `loc` into k_buffers[l] / v_buffers[l]
// (kv_store) and runs paged_decode over the plan (radixrt/attention/paged_decode.py). An int8
// pool passes its per-layer scales in k_scales / v_scales (empty lists otherwise): then
// kv_store_i8 and paged_decode_i8.
// Returns the last layer's (MLP output, residual stream); their sum is the hidden state.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace radixrt_cpu {
namespace {

using at::Tensor;
using OptTensors = c10::List<std::optional<Tensor>>;

constexpr int64_t kSlotsPerLinear = 5;
constexpr int64_t kMetaPerLinear = 3;
constexpr int64_t kLinearsPerLayer = 4;

// The radixrt ops, looked up once in the dispatcher (they are registered by this library).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                      const Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_mul;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                      const Tensor&, int64_t, int64_t)>
      rope_qk;
  // kv_store's impl takes its two buffers by value (the registered signature must match).
  c10::TypedOperatorHandle<void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&)>
      kv_store;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  int64_t)>
      qgemv;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t)> qgemm_vnni;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t)> qgemm_vnni_silu;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, double)>
      paged_decode;
  c10::TypedOperatorHandle<void(Tensor, Tensor, Tensor, Tensor, const Tensor&, const Tensor&,
                                const Tensor&)>
      kv_store_i8;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
      double)>
      paged_decode_i8;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      return Ops{
          d.findSchemaOrThrow("radixrt::rms_norm", "")
              .typed<Tensor(const Tensor&, const Tensor&, double)>(),
          d.findSchemaOrThrow("radixrt::add_rms_norm", "")
              .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                double)>(),
          d.findSchemaOrThrow("radixrt::silu_mul", "").typed<Tensor(const Tensor&)>(),
          d.findSchemaOrThrow("radixrt::rope_qk", "")
              .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                int64_t, int64_t)>(),
          d.findSchemaOrThrow("radixrt::kv_store", "")
              .typed<void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&)>(),
          d.findSchemaOrThrow("radixrt::qgemv", "")
              .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            int64_t)>(),
          d.findSchemaOrThrow("radixrt::qgemm_vnni", "")
              .typed<Tensor(const Tensor&, const Tensor&, int64_t)>(),
          d.findSchemaOrThrow("radixrt::qgemm_vnni_silu", "")
              .typed<Tensor(const Tensor&, const Tensor&, int64_t)>(),
          d.findSchemaOrThrow("radixrt::paged_decode", "")
              .typed<std::tuple<Tensor, Tensor>(
                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  double)>(),
          d.findSchemaOrThrow("radixrt::kv_store_i8", "")
              .typed<void(Tensor, Tensor, Tensor, Tensor, const Tensor&, const Tensor&,
                          const Tensor&)>(),
          d.findSchemaOrThrow("radixrt::paged_decode_i8", "")
              .typed<std::tuple<Tensor, Tensor>(
                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                  const Tensor&, const Tensor&, double)>(),
      };
    }();
    return ops;
  }
};

std::optional<Tensor> slot(const OptTensors& w, int64_t i) {
  std::optional<Tensor> t = w.get(i);
  if (t.has_value() && !t->defined()) return std::nullopt;
  return t;
}

Tensor required(const OptTensors& w, int64_t i, int64_t linear, const char* what) {
  std::optional<Tensor> t = slot(w, i);
  TORCH_CHECK(t.has_value(), "decode_layers: linear ", linear, " has no ", what);
  return *t;
}

// Linear `i` of the flattened weights on x (the rules of radixrt/model/linear.py); `silu`: on
// silu_mul(x) (x = gate_up), fused into qgemm_vnni's quantization where the vnni kernel runs.
Tensor run_linear(const Ops& ops, const Tensor& x, const OptTensors& w, c10::IntArrayRef meta,
                  int64_t i, bool silu = false) {
  const int64_t kind = meta[i * kMetaPerLinear], bits = meta[i * kMetaPerLinear + 1];
  const int64_t max_rows = meta[i * kMetaPerLinear + 2];
  const int64_t base = i * kSlotsPerLinear;
  const std::optional<Tensor> bias = slot(w, base + 4);
  TORCH_CHECK(kind >= 0 && kind <= 2, "decode_layers: linear ", i, " has unknown kind ", kind);
  const std::optional<Tensor> dense = kind == 0 ? std::nullopt : slot(w, base + 3);
  const bool on_kernel = kind != 0 && !(dense.has_value() && x.size(0) > max_rows);
  if (silu && kind == 2 && on_kernel) {
    const Tensor y = ops.qgemm_vnni_silu.call(x.contiguous(), required(w, base, i, "packed"), bits);
    return bias.has_value() ? y + *bias : y;
  }
  const Tensor a = silu ? ops.silu_mul.call(x) : x;
  if (kind == 0) return at::linear(a, required(w, base, i, "weight"), bias);
  if (!on_kernel) return at::linear(a, *dense, bias);
  Tensor y = kind == 2 ? ops.qgemm_vnni.call(a.contiguous(), required(w, base, i, "packed"), bits)
                       : ops.qgemv.call(a.contiguous(), required(w, base, i, "codes"),
                                        required(w, base + 1, i, "scale"),
                                        required(w, base + 2, i, "offset"), bits);
  return bias.has_value() ? y + *bias : y;
}

std::tuple<Tensor, Tensor> decode_layers(
    const Tensor& h0, const Tensor& cos, const Tensor& sin, at::TensorList norms,
    const OptTensors& weights, c10::IntArrayRef meta, at::TensorList k_buffers,
    at::TensorList v_buffers, at::TensorList k_scales, at::TensorList v_scales,
    const Tensor& loc, const Tensor& kv_indices,
    const Tensor& row_start, const Tensor& row_len, const Tensor& group_start,
    const Tensor& group_len, const Tensor& group_row_ptr, const Tensor& group_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_buffers.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_buffers.size()) == layers,
              "decode_layers: k_buffers and v_buffers must have one entry per layer");
  const bool int8_pool = !k_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(v_scales.size()) == static_cast<int64_t>(k_scales.size()) &&
                  (!int8_pool || static_cast<int64_t>(k_scales.size()) == layers),
              "decode_layers: k_scales and v_scales must be empty or have one entry per layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers,
              "decode_layers: norms must hold 2 weights per layer, got ", norms.size(),
              " for ", layers, " layers");
  const int64_t linears = kLinearsPerLayer * layers;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kSlotsPerLinear * linears,
              "decode_layers: weights must hold ", kSlotsPerLinear * linears, " entries, got ",
              weights.size());
  TORCH_CHECK(static_cast<int64_t>(meta.size()) == kMetaPerLinear * linears,
              "decode_layers: meta must hold ", kMetaPerLinear * linears, " entries, got ",
              meta.size());
  TORCH_CHECK(h0.dim() == 2, "decode_layers: h must be [rows, hidden]");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "decode_layers: head counts and head_dim must be positive");
  const int64_t n = h0.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const Ops& ops = Ops::get();

  Tensor h = h0, residual;
  for (int64_t l = 0; l < layers; ++l) {
    Tensor x;
    if (l == 0) {
      residual = h;
      x = ops.rms_norm.call(h, norms[0], eps);
    } else {
      std::tie(x, residual) = ops.add_rms_norm.call(h, residual, norms[2 * l], eps);
    }
    const int64_t lin = kLinearsPerLayer * l;
    const Tensor qkv = run_linear(ops, x, weights, meta, lin);
    auto [q, k] = ops.rope_qk.call(qkv, cos, sin, num_heads, num_kv_heads);
    const Tensor v = qkv.slice(1, q_size + kv_size).view({n, num_kv_heads, head_dim});
    const Tensor& kb = k_buffers[l];
    const Tensor& vb = v_buffers[l];
    if (int8_pool) ops.kv_store_i8.call(kb, vb, k_scales[l], v_scales[l], loc, k, v);
    else ops.kv_store.call(kb, vb, loc, k, v);
    Tensor o = std::get<0>(
        int8_pool
            ? ops.paged_decode_i8.call(q.contiguous(), kb, vb, k_scales[l], v_scales[l],
                                       kv_indices, row_start, row_len, group_start, group_len,
                                       group_row_ptr, group_rows, scale)
            : ops.paged_decode.call(q.to(kb.scalar_type()).contiguous(), kb, vb, kv_indices,
                                    row_start, row_len,
        group_start, group_len, group_row_ptr, group_rows, scale));
    o = o.to(q.scalar_type()).reshape({n, q_size});
    const Tensor attn_out = run_linear(ops, o, weights, meta, lin + 1);
    std::tie(x, residual) = ops.add_rms_norm.call(attn_out, residual, norms[2 * l + 1], eps);
    const Tensor gate_up = run_linear(ops, x, weights, meta, lin + 2);
    h = run_linear(ops, gate_up, weights, meta, lin + 3, /*silu=*/true);
  }
  return {h, residual};
}

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor[] norms, Tensor?[] weights, "
      "int[] meta, Tensor(a!)[] k_buffers, Tensor(b!)[] v_buffers, Tensor(c!)[] k_scales, "
      "Tensor(d!)[] v_scales, Tensor loc, Tensor kv_indices, "
      "Tensor row_start, Tensor row_len, Tensor group_start, Tensor group_len, "
      "Tensor group_row_ptr, Tensor group_rows, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) { m.impl("decode_layers", &radixrt_cpu::decode_layers); }
