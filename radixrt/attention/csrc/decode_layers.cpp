// Every decoder layer of one decode step (and of an extend step: extend_step, at the end) in one
// call: the same radixrt ops the Python layer loop
// (radixrt/model/llama.py, LlamaDecoderLayer with FusedCpuLayerOps) calls, in the same order on
// the same tensors, so the result is bitwise that of the loop. What it removes is the per-op
// Python cost (module calls, argument parsing: ~100 us per layer, a third of a small batch's
// step), not any arithmetic.
//
//   decode_layers(h, cos, sin, norms, weights, meta, k_buffers, v_buffers, loc, <paged plan>,
//                 num_heads, num_kv_heads, head_dim, eps, scale) -> (h, residual)
//
// Per layer l: norms[2l], norms[2l + 1] are the input / post-attention RMSNorm weights; its four
// matmuls (qkv, o, gate_up, down) are linears 4l .. 4l + 3. Linear i owns weights[6i .. 6i + 6)
// = (a, b, c, dense, bias, packed) and meta[3i .. 3i + 3) = (kind, bits, max_rows):
//   kind 0 (dense):  y = linear(x, a, bias)
//   kind 1 (qgemv):  rows > max_rows and a dense copy: y = linear(x, dense, bias); else
//                    y = qgemv(x, codes a, scale b, offset c, bits) (+ bias)
//   kind 2 (vnni):   the same rule, with y = qgemm_vnni(x, packed a, bits) (+ bias)
//   kind 3 (vnni, two terms): kind 2 with qgemm_vnni(..., terms=2) (the vnni-hilo kernel)
// `packed`, when given, is the dense weight (a for kind 0, else dense) packed
// (radixrt/model/prepack.py): in radixrt's AMX layout (5-D), a dense linear of up to
// kAmxMaxRows rows runs radixrt::amx_linear on it; in oneDNN's, one of up to kPackedMaxRows
// rows runs mkldnn::_linear_pointwise on it, bitwise linear(x, weight, bias) there.
// The MLP's down projection takes silu_mul(gate_up); on a vnni linear running its kernel, that
// is qgemm_vnni_silu(gate_up, ...) instead: the SiLU-mul computed while quantizing the
// activations, bitwise qgemm_vnni(silu_mul(gate_up)) (one op and one intermediate fewer). A
// gate_up on an AMX-packed weight runs radixrt::amx_linear_silu instead (the SiLU-mul in its
// epilogue, bitwise silu_mul(amx_linear)), and the down projection takes its output as is.
// The attention of layer l writes this step's K/V at `loc` into k_buffers[l] / v_buffers[l]
// (kv_store) and runs paged_decode over the plan (radixrt/attention/paged_decode.py). An int8
// pool passes its per-layer scales in k_scales / v_scales (empty lists otherwise): then
// kv_store_i8 and paged_decode_i8.
// Returns the last layer's (MLP output, residual stream); their sum is the hidden state.
// decode_step (at the end) adds the embedding, the RoPE rows and the final norm around it; it
// takes everything that is the same from step to step (weights, pool buffers, constants) in one
// DecodeStack, built once, so a step converts only its batch's tensors (the ~800 list entries
// of the weights and buffers cost ~0.1 ms a step to convert, cold).
//
// A team (`team`, one pass, 2+ intra-op threads, every linear on the vnni kernel or dense on an
// AMX-packed weight: team_row_limit): every thread
// runs the whole layer loop inside one parallel region and the ops split their work among the
// team, meeting at spin barriers (team.h), instead of a parallel region per op with the norms,
// RoPE and kv_store on one thread. Each op computes each output as it does alone, so the result
// is bitwise the same. Zen 5, 2 vCPUs, 8 rows: 0.88-0.90x the step time whether the two vCPUs
// shared a cache or not (bench/results/2026-11-25-s28-decode-team.md). `norms_whole`: whether
// each member runs the RMSNorms and the activation quantization of qkv and gate_up on every row
// (one meeting fewer per norm, more arithmetic and crossings; TeamMember::norms_whole): 1
// always, 0 never, -1 where the team's first two threads share no cache, probed as each team
// forms (TeamMember::probe_placement): whole rows were -0.05 ms a batch-8 step far, +0.04 near
// (bench/results/2026-11-25-s34-team-norms-whole.md). `far_split`: whether a team of two runs the
// step as two micro-batches instead (below), one per member: -1 where the probe finds its
// threads far apart (placement.h kMicrobatchRoundTripNs) and the step has kFarMicrobatchRows
// rows or more, 1 always (2+ rows), 0 never; radixrt::decode_team_microbatch_steps counts them.
// In a team's matmuls and attention a member that has run its share takes the others' last
// items (TeamMember::run_items; radixrt::decode_team_steal turns it off and counts the items
// taken): 0.98-0.99x the step with every member on its share alone, 0.95x with a process beside
// the server taking 300 us of a core every 2.3 ms (bench/results/2026-12-01-s41-*).
//
// Micro-batches (`split` > 0, rows >= 2): rows [0, split) and [split, rows) run as two
// micro-batches, each through every layer on its own thread of one parallel region, the ops
// inside on that thread alone (a nested region runs on its caller). The second starts once the
// first has finished its first layer's attention, so that, layer after layer, one micro-batch's
// paged decode (memory-bound: it streams K/V) tends to run while the other's matmuls
// (compute-bound) do: a 64-row step on 2 cores took 0.87-0.91x the time of one 64-row pass
// (bench/results/2026-11-25-s24-decode-microbatches.md). Every op computes each row as it
// would in the whole batch, so the result is bitwise the unsplit one. A shared-prefix group
// with rows in both micro-batches becomes a group in each (its prefix is read by both).

#include <torch_headers.h>  // first: precompiled by the build
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include "team.h"
#include "work_queue.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace radixrt_cpu {
namespace {

using at::Tensor;
using OptTensors = c10::List<std::optional<Tensor>>;

constexpr int64_t kSlotsPerLinear = 6;
// Rows up to which a dense linear takes its packed weight: oneDNN's layout
// (prepack.PACKED_MAX_ROWS), the AMX one (prepack.AMX_MAX_ROWS).
constexpr int64_t kPackedMaxRows = 256;
constexpr int64_t kAmxMaxRows = 1024;
constexpr int64_t kMetaPerLinear = 3;
// A linear's kind, meta[3i] (radixrt/model/decode_layers.py KIND_*): dense, radixrt's qgemv
// kernel, the vnni kernel.
constexpr int64_t kKindDense = 0, kKindQgemv = 1, kKindVnni = 2, kKindVnniHilo = 3;
constexpr int64_t kLinearsPerLayer = 4;
// A micro-batch's thread waiting for the other: pause-spins before yielding the core.
constexpr int64_t kSpinsBeforeYield = 2000;

// The radixrt ops, looked up once in the dispatcher (they are registered by this library).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                      const Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<void(Tensor, Tensor, const Tensor&, double)> add_rms_norm_;
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
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)> qgemm_vnni;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)>
      qgemm_vnni_silu;
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
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, const Tensor&, double)>
      extend_attention;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      return Ops{
          d.findSchemaOrThrow("radixrt::rms_norm", "")
              .typed<Tensor(const Tensor&, const Tensor&, double)>(),
          d.findSchemaOrThrow("radixrt::add_rms_norm", "")
              .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                double)>(),
          d.findSchemaOrThrow("radixrt::add_rms_norm_", "")
              .typed<void(Tensor, Tensor, const Tensor&, double)>(),
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
              .typed<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)>(),
          d.findSchemaOrThrow("radixrt::qgemm_vnni_silu", "")
              .typed<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)>(),
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
          d.findSchemaOrThrow("radixrt::extend_attention", "")
              .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const Tensor&, double)>(),
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

// Whether `packed` is in radixrt's AMX layout (else oneDNN's).
bool amx_packed(const Tensor& packed) { return packed.dim() == 5; }

// linear(x, weight, bias) on `packed`: radixrt::amx_linear on the AMX layout, else
// mkldnn::_linear_pointwise on oneDNN's.
Tensor packed_linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias) {
  if (amx_packed(packed)) {
    static const auto amx =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("radixrt::amx_linear", "")
            .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>();
    return amx.call(x, packed, bias);
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Whether a call of `rows` rows to linear `i` runs on its dense weight (kind 0, or a dense copy
// above max_rows) rather than its quantized kernel (the rule of radixrt/model/linear.py).
bool on_dense(const OptTensors& w, c10::IntArrayRef meta, int64_t i, int64_t rows) {
  const int64_t kind = meta[i * kMetaPerLinear], max_rows = meta[i * kMetaPerLinear + 2];
  return kind == kKindDense || (slot(w, i * kSlotsPerLinear + 3).has_value() && rows > max_rows);
}

// Linear `i` of the flattened weights on x (the rules of radixrt/model/linear.py); `silu`: on
// silu_mul(x) (x = gate_up), fused into qgemm_vnni's quantization where the vnni kernel runs.
Tensor run_linear(const Ops& ops, const Tensor& x, const OptTensors& w, c10::IntArrayRef meta,
                  int64_t i, bool silu = false) {
  const int64_t kind = meta[i * kMetaPerLinear], bits = meta[i * kMetaPerLinear + 1];
  const int64_t base = i * kSlotsPerLinear;
  const std::optional<Tensor> bias = slot(w, base + 4);
  TORCH_CHECK(kind >= kKindDense && kind <= kKindVnniHilo, "decode_layers: linear ", i,
              " has unknown kind ", kind);
  const std::optional<Tensor> dense = kind == kKindDense ? std::nullopt : slot(w, base + 3);
  const bool on_kernel = !on_dense(w, meta, i, x.size(0));
  const bool vnni = kind == kKindVnni || kind == kKindVnniHilo;
  const int64_t terms = kind == kKindVnniHilo ? 2 : 1;
  if (silu && vnni && on_kernel) {
    const Tensor y =
        ops.qgemm_vnni_silu.call(x.contiguous(), required(w, base, i, "packed"), bits, terms);
    return bias.has_value() ? y + *bias : y;
  }
  const Tensor a = silu ? ops.silu_mul.call(x) : x;
  if (kind == kKindDense || !on_kernel) {
    const std::optional<Tensor> packed = slot(w, base + 5);
    if (packed.has_value() &&
        a.size(0) <= (amx_packed(*packed) ? kAmxMaxRows : kPackedMaxRows))
      return packed_linear(a, *packed, bias);
    return at::linear(a, kind == kKindDense ? required(w, base, i, "weight") : *dense, bias);
  }
  Tensor y = vnni
                 ? ops.qgemm_vnni.call(a.contiguous(), required(w, base, i, "packed"), bits, terms)
                 : ops.qgemv.call(a.contiguous(), required(w, base, i, "codes"),
                                  required(w, base + 1, i, "scale"),
                                  required(w, base + 2, i, "offset"), bits);
  return bias.has_value() ? y + *bias : y;
}

// The MLP's gate_up (linear i) on x: (silu_mul of it, true) where the call takes the dense
// weight, AMX-packed in whole [gate | up] block pairs, at any row count
// (radixrt::amx_linear_silu: the SiLU-mul in the linear's epilogue, bitwise
// silu_mul(amx_linear)), else (gate_up, false), the SiLU-mul left to the down projection (the
// rules of LinearWeight.silu_mul in radixrt/model/linear.py).
std::pair<Tensor, bool> run_gate_up(const Ops& ops, const Tensor& x, const OptTensors& w,
                                    c10::IntArrayRef meta, int64_t i) {
  const int64_t base = i * kSlotsPerLinear;
  const std::optional<Tensor> packed = slot(w, base + 5);
  if (on_dense(w, meta, i, x.size(0)) && packed.has_value() && amx_packed(*packed) &&
      packed->size(0) % 2 == 0) {
    static const auto fused =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("radixrt::amx_linear_silu", "")
            .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&)>();
    return {fused.call(x, *packed, slot(w, base + 4)), true};
  }
  return {run_linear(ops, x, w, meta, i), false};
}

// The paged plan of one micro-batch: its rows' own keys and the shared-prefix groups it reads.
struct Plan {
  Tensor kv_indices, row_start, row_len, group_start, group_len, group_row_ptr, group_rows;
  // Some row attends to a slot another row of the step stores (`step_dependencies`): the
  // attention then waits for every row's kv_store (no member keeps its rows through it).
  bool rows_depend = false;

  // Rows [r0, r1) of this plan, numbered from 0: each group keeps the rows it has there (a
  // group with none is dropped). kv_indices is shared.
  Plan rows(int64_t r0, int64_t r1) const {
    TORCH_CHECK(group_row_ptr.numel() == group_start.numel() + 1,
                "decode_layers: group_row_ptr must have one entry more than group_start");
    const Tensor gp = group_row_ptr.contiguous(), gr = group_rows.contiguous();
    const Tensor gs = group_start.contiguous(), gl = group_len.contiguous();
    const int64_t* ptr = gp.data_ptr<int64_t>();
    const int64_t* grows = gr.data_ptr<int64_t>();
    std::vector<int64_t> starts, lens, ptrs{0}, members;
    for (int64_t g = 0; g < gs.numel(); ++g) {
      TORCH_CHECK(ptr[g] >= 0 && ptr[g] <= ptr[g + 1] && ptr[g + 1] <= gr.numel(),
                  "decode_layers: group_row_ptr out of range at group ", g);
      for (int64_t i = ptr[g]; i < ptr[g + 1]; ++i) {
        if (grows[i] >= r0 && grows[i] < r1) members.push_back(grows[i] - r0);
      }
      if (static_cast<int64_t>(members.size()) > ptrs.back()) {
        starts.push_back(gs.data_ptr<int64_t>()[g]);
        lens.push_back(gl.data_ptr<int64_t>()[g]);
        ptrs.push_back(static_cast<int64_t>(members.size()));
      }
    }
    auto ints = [](const std::vector<int64_t>& v) {
      return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong));
    };
    return {kv_indices, row_start.slice(0, r0, r1).contiguous(),
            row_len.slice(0, r0, r1).contiguous(), ints(starts), ints(lens), ints(ptrs),
            ints(members), rows_depend};
  }
};

// dep[b]: row b's keys end with the slot row b - 1 stores this step (`loc[b - 1]`) before its
// own. That is how a request computing several tokens in one decode step looks (ForwardBatch:
// consecutive rows over one request-to-token row, row i attending to the tokens of rows
// before it): row b reads K/V that another row stores in the same layer, so the two must not
// be split between threads that do not meet between kv_store and the attention.
std::vector<uint8_t> step_dependencies(const Plan& plan, const Tensor& loc) {
  const int64_t n = loc.numel();
  std::vector<uint8_t> dep(static_cast<size_t>(std::max<int64_t>(n, 0)), 0);
  if (n < 2) return dep;
  const Tensor rs = plan.row_start.contiguous(), rl = plan.row_len.contiguous();
  const Tensor kv = plan.kv_indices.contiguous();
  const Tensor lc = loc.to(at::kLong).contiguous();
  const int64_t* start = rs.data_ptr<int64_t>();
  const int64_t* len = rl.data_ptr<int64_t>();
  const int32_t* keys = kv.data_ptr<int32_t>();
  const int64_t* slot = lc.data_ptr<int64_t>();
  const int64_t total = kv.numel();
  for (int64_t b = 1; b < n; ++b) {
    const int64_t at_ = start[b] + len[b] - 2;
    if (len[b] >= 2 && at_ >= 0 && at_ < total && keys[at_] == slot[b - 1]) dep[b] = 1;
  }
  return dep;
}

// The micro-batch boundary nearest `want` (in [1, n)) that no dependency crosses (`dep`), or 0
// when every boundary does.
int64_t independent_split(const std::vector<uint8_t>& dep, int64_t want) {
  const int64_t n = static_cast<int64_t>(dep.size());
  if (want <= 0) return 0;
  for (int64_t d = 0; d < n; ++d) {
    for (const int64_t b : {want - d, want + d}) {
      if (b >= 1 && b < n && !dep[static_cast<size_t>(b)]) return b;
    }
  }
  return 0;
}

// Arguments shared by every layer of the step.
struct Stack {
  const Tensor &cos, &sin;
  at::TensorList norms;
  const OptTensors& weights;
  c10::IntArrayRef meta;
  at::TensorList k_buffers, v_buffers, k_scales, v_scales;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t team_rows;  // the most rows a team pass may take (team_row_limit)
};

// How far a micro-batch has got: attentions finished (`kDone` once it has left the layers,
// however it left).
struct alignas(64) Progress {
  static constexpr int64_t kDone = std::numeric_limits<int64_t>::max();
  std::atomic<int64_t> attentions{0};

  void wait_for(int64_t target) const {
    for (int64_t spins = 0; attentions.load(std::memory_order_acquire) < target; ++spins) {
      if (spins >= kSpinsBeforeYield) {
        std::this_thread::yield();
      } else {
#if defined(__x86_64__) || defined(_M_X64)
        _mm_pause();
#endif
      }
    }
  }
};

// Whether a team's attention over `plan` gives each member exactly the (row, kv head) items of
// its own rows (m.rows, the split of RoPE, kv_store and the matmuls' activation quantization),
// so that kv_store before it and the attention itself end without the team meeting: no
// shared-prefix groups (a group's items read every member's queries), the queries already in
// the pool's dtype (`q_as_pool`: else each member converts all of them first), and the work
// queue's cost split (work_queue.h, for_each_row_item: row by row, KV head, then part, with cost
// keys x queries) falling on the row split. The same on every member (the same plan).
bool attention_keeps_rows(const TeamMember& m, const Plan& plan, int64_t rows, int64_t kv_heads,
                          int64_t group_size, bool q_as_pool) {
  if (m.size < 2 || !q_as_pool || plan.group_start.numel() > 0) return false;
  const Tensor rl = plan.row_len.contiguous();
  const int64_t* len = rl.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < rows; ++b) total += len[b] * group_size * kv_heads;
  if (total < min_parallel_attention_work()) return false;  // then the first member runs all
  int64_t before = 0, id = 0;
  bool keeps = true;
  for_each_row_item(len, rows, kv_heads, m.size,
                    [&](int64_t b, int64_t, int64_t, int64_t keys, const RowSplit&) {
    while (team_rows(id, rows, m.size).second <= b) ++id;  // the member whose rows hold b
    const int64_t cost = keys * group_size;
    keeps = keeps && team_share_owner(before, cost, total, m.size) == id;
    before += cost;
  });
  return keeps;
}

// q as paged_decode and extend_attention take it over the pool kb: as is on a float16 pool
// under fp32 queries (narrowed), else in kb's dtype (paged_decode.queries_for_pool in Python).
Tensor for_pool(const Tensor& q, const Tensor& kb) {
  const bool narrowed = q.scalar_type() == at::kFloat && kb.scalar_type() == at::kHalf;
  return narrowed ? q : q.to(kb.scalar_type());
}

// The attention of an extend step (extend_step), in place of paged_decode over a Plan: the
// extend op over its plan (`ext`: kv_indices, kv_indptr, loc, qo_indptr; each token sees its
// request's prefix slots, then the step's slots up to its own), or, in a mixed step, the
// paged-decode op over `dec` for the one-token rows' queries (token rows `dec_tok`) and the
// extend op over the others' sub-batch (token rows `ext_tok`; `ext` empty when there are none).
// The same calls on the same queries as TorchNativeBackend.forward (radixrt/attention/
// torch_native.py), so bitwise its output. Only pools of the model's dtype, or float16 under a
// float32 model (narrowed: both ops take fp32 queries over it as they are) (checked).
struct ExtendAttention {
  std::vector<Tensor> ext;  // 4 tensors, or none
  Tensor dec_tok, ext_tok;  // int64 token rows (mixed steps; ext_tok undefined without ext)
  std::optional<Plan> dec;  // a mixed step's (its presence makes the step mixed)

  Tensor extend(const Ops& ops, const Tensor& q, const Tensor& kb, const Tensor& vb,
                double scale) const {
    return ops.extend_attention
        .call(for_pool(q, kb).contiguous(), kb, vb, ext[0], ext[1], ext[2], ext[3], scale)
        .to(q.scalar_type());
  }

  Tensor run(const Ops& ops, const Tensor& q, const Tensor& kb, const Tensor& vb,
             double scale) const {
    if (!dec.has_value()) return extend(ops, q, kb, vb, scale);
    Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
    const Plan& p = *dec;
    const Tensor o = std::get<0>(ops.paged_decode.call(
        for_pool(q.index_select(0, dec_tok), kb).contiguous(), kb, vb, p.kv_indices,
        p.row_start, p.row_len, p.group_start, p.group_len, p.group_row_ptr, p.group_rows,
        scale));
    out.index_copy_(0, dec_tok, o.to(q.scalar_type()));
    if (!ext.empty()) {
      out.index_copy_(0, ext_tok, extend(ops, q.index_select(0, ext_tok), kb, vb, scale));
    }
    return out;
  }
};

// Every layer over rows [r0, r1) of the step (h0, loc, cos / sin rows), reporting each finished
// attention in `progress` (may be null). `ext`: an extend step's attention instead of `plan`'s
// paged decode (rows are tokens; no team, rows [0, n)); its norms then run in place
// (add_rms_norm_, as the Python loop's: the stores land in the lines the loads brought in).
std::tuple<Tensor, Tensor> run_layers(const Stack& st, const Tensor& h0, const Tensor& loc,
                                      const Plan& plan, int64_t r0, int64_t r1,
                                      Progress* progress,
                                      const ExtendAttention* ext = nullptr) {
  struct Finish {  // kDone on every way out, so a waiting peer never waits on an error
    Progress* p;
    ~Finish() {
      if (p) p->attentions.store(Progress::kDone, std::memory_order_release);
    }
  } finish{progress};
  const int64_t layers = static_cast<int64_t>(st.k_buffers.size());
  const bool int8_pool = !st.k_scales.empty();
  // The attention takes q as it is on an int8 pool, a pool of the model's dtype, or a float16
  // pool under a float32 model (narrowed); else q in the pool's dtype.
  const at::ScalarType pool_type = st.k_buffers[0].scalar_type();
  const bool q_as_is = int8_pool || h0.scalar_type() == pool_type ||
                       (h0.scalar_type() == at::kFloat && pool_type == at::kHalf);
  const int64_t n = r1 - r0;
  const int64_t q_size = st.num_heads * st.head_dim, kv_size = st.num_kv_heads * st.head_dim;
  const Tensor cos = st.cos.slice(0, r0, r1), sin = st.sin.slice(0, r0, r1);
  const Tensor rloc = loc.slice(0, r0, r1);
  const Ops& ops = Ops::get();
  const double eps = st.eps;

  Tensor h = h0.slice(0, r0, r1), residual;
  RADIXRT_TEAM_PHASE(0);
  TeamMember* member = team_member();
  const bool attn_keeps_rows =
      member != nullptr && !plan.rows_depend &&
      attention_keeps_rows(*member, plan, n, st.num_kv_heads, st.num_heads / st.num_kv_heads,
                           q_as_is);
  // Before each RMSNorm and the matmul after it: where the team runs them whole on every member
  // (norms_whole), each member computes every row of both and the team meets once, after the
  // matmul's tiles; else each member takes its rows (rows_stay) and the matmul meets after its
  // quantization too. The norm reads only whole_rows / rows_stay; the matmul reads and clears
  // quantize_whole, so both are set here.
  auto before_norm = [&] {
    if (member == nullptr) return;
    if (member->norms_whole) {
      member->whole_rows = true;
      member->quantize_whole = true;
    } else {
      member->rows_stay = true;
    }
  };
  for (int64_t l = 0; l < layers; ++l) {
    if (member != nullptr) member->next_layer();
    Tensor x;
    RADIXRT_TEAM_PHASE(1);
    before_norm();
    if (l == 0) {
      residual = h;
      x = ops.rms_norm.call(h, st.norms[0], eps);
    } else if (ext != nullptr) {
      ops.add_rms_norm_.call(h, residual, st.norms[2 * l], eps);
      x = h;
    } else {
      std::tie(x, residual) = ops.add_rms_norm.call(h, residual, st.norms[2 * l], eps);
    }
    const int64_t lin = kLinearsPerLayer * l;
    RADIXRT_TEAM_PHASE(2);
    const Tensor qkv = run_linear(ops, x, st.weights, st.meta, lin);
    // kv_store splits the rows as rope_qk does: each member stores the K rows it rotated, so
    // the team need not meet between the two (v is qkv's, complete at the matmul's barrier).
    if (member != nullptr) member->rows_stay = true;
    RADIXRT_TEAM_PHASE(3);
    auto [q, k] = ops.rope_qk.call(qkv, cos, sin, st.num_heads, st.num_kv_heads);
    const Tensor v = qkv.slice(1, q_size + kv_size).view({n, st.num_kv_heads, st.head_dim});
    const Tensor& kb = st.k_buffers[l];
    const Tensor& vb = st.v_buffers[l];
    // Where the attention keeps each member's rows, neither it nor kv_store meets the team: a
    // member attends with the queries and K/V it stored, and the o projection quantizes its
    // rows of the output.
    RADIXRT_TEAM_PHASE(4);
    if (attn_keeps_rows) member->rows_stay = true;
    if (int8_pool) ops.kv_store_i8.call(kb, vb, st.k_scales[l], st.v_scales[l], rloc, k, v);
    else ops.kv_store.call(kb, vb, rloc, k, v);
    if (attn_keeps_rows) member->rows_stay = true;
    RADIXRT_TEAM_PHASE(5);
    Tensor o = ext != nullptr ? ext->run(ops, q, kb, vb, st.scale) : std::get<0>(
        int8_pool
            ? ops.paged_decode_i8.call(q.contiguous(), kb, vb, st.k_scales[l], st.v_scales[l],
                                       plan.kv_indices, plan.row_start, plan.row_len,
                                       plan.group_start, plan.group_len, plan.group_row_ptr,
                                       plan.group_rows, st.scale)
            : ops.paged_decode.call(for_pool(q, kb).contiguous(), kb, vb,
                                    plan.kv_indices, plan.row_start, plan.row_len,
                                    plan.group_start, plan.group_len, plan.group_row_ptr,
                                    plan.group_rows, st.scale));
    if (progress) progress->attentions.store(l + 1, std::memory_order_release);
    o = o.to(q.scalar_type()).reshape({n, q_size});
    RADIXRT_TEAM_PHASE(6);
    const Tensor attn_out = run_linear(ops, o, st.weights, st.meta, lin + 1);
    RADIXRT_TEAM_PHASE(7);
    before_norm();
    if (ext != nullptr) {
      ops.add_rms_norm_.call(attn_out, residual, st.norms[2 * l + 1], eps);
      x = attn_out;
    } else {
      std::tie(x, residual) = ops.add_rms_norm.call(attn_out, residual, st.norms[2 * l + 1], eps);
    }
    RADIXRT_TEAM_PHASE(8);
    const auto [act, activated] = run_gate_up(ops, x, st.weights, st.meta, lin + 2);
    RADIXRT_TEAM_PHASE(9);
    h = run_linear(ops, act, st.weights, st.meta, lin + 3, /*silu=*/!activated);
  }
  RADIXRT_TEAM_PHASE(0);
  return {h, residual};
}

// The step-invariant arguments of decode_layers agree with each other (entries per layer).
void check_stack(at::TensorList norms, const OptTensors& weights, c10::IntArrayRef meta,
                 at::TensorList k_buffers, at::TensorList v_buffers, at::TensorList k_scales,
                 at::TensorList v_scales, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim) {
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
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "decode_layers: head counts and head_dim must be positive");
}

// The most rows a team pass (team.h) may take over these linears: -1 unless every linear is
// without a bias and on the vnni kernel or dense with an AMX-packed weight (radixrt::amx_linear
// splits its N blocks among the team; a gate_up needs whole [gate | up] block pairs for
// amx_linear_silu): a qgemv or another dense linear would run whole on every member. The cap
// is kAmxMaxRows (above it dense calls leave the packed weight), and a vnni linear's dense copy
// that is not AMX-packed caps it at its max_rows (above it the copy would run whole on every
// member). The same for every step of a stack: DecodeStack computes it once.
int64_t team_row_limit(const OptTensors& weights, c10::IntArrayRef meta) {
  int64_t limit = std::numeric_limits<int64_t>::max();
  const int64_t linears = static_cast<int64_t>(meta.size()) / kMetaPerLinear;
  for (int64_t i = 0; i < linears; ++i) {
    const int64_t kind = meta[i * kMetaPerLinear];
    if (kind == kKindQgemv) return -1;
    if (slot(weights, i * kSlotsPerLinear + 4).has_value()) return -1;  // a bias
    const std::optional<Tensor> packed = slot(weights, i * kSlotsPerLinear + 5);
    const bool gate_up = i % kLinearsPerLayer == 2;
    const bool team_dense = packed.has_value() && amx_packed(*packed) &&
                            (!gate_up || packed->size(0) % 2 == 0);
    if (kind == kKindDense) {
      if (!team_dense) return -1;
      limit = std::min(limit, kAmxMaxRows);
    } else if (slot(weights, i * kSlotsPerLinear + 3).has_value()) {
      limit = std::min(limit, team_dense ? kAmxMaxRows : meta[i * kMetaPerLinear + 2]);
    }
  }
  return limit;
}

// team_row_limit for Python (`DecodeLayers.team_rows`): the same rule, not restated there.
int64_t decode_team_rows(const OptTensors& weights, c10::IntArrayRef meta) {
  TORCH_CHECK(meta.size() % kMetaPerLinear == 0 &&
                  static_cast<int64_t>(weights.size()) ==
                      static_cast<int64_t>(meta.size()) / kMetaPerLinear * kSlotsPerLinear,
              "decode_team_rows: weights and meta must describe the same linears");
  return team_row_limit(weights, meta);
}

// Whether one pass over `rows` rows can run as a team: within the stack's team_rows, on 2+
// intra-op threads, not inside another parallel region.
bool team_fits(const Stack& st, int64_t rows) {
  return rows >= 1 && rows <= st.team_rows && !at::in_parallel_region() &&
         at::get_num_threads() >= 2;
}

// Bytes of one layer's op outputs over `rows` rows in a team (an upper bound of what the ops
// take with team_empty; the arena has one such half per layer parity).
int64_t team_layer_bytes(const Stack& st, int64_t rows, int64_t hidden, int64_t es) {
  const int64_t q_size = st.num_heads * st.head_dim, kv_size = st.num_kv_heads * st.head_dim;
  const Tensor& down = *slot(st.weights, (kLinearsPerLayer - 1) * kSlotsPerLinear);
  const int64_t inter = down.size(1) * 32;
  const int64_t padded = (rows + 7) / 8 * 8;
  const int64_t outputs = rows * es * (4 * hidden + (q_size + 2 * kv_size) + 2 * q_size +
                                       kv_size + 2 * hidden + 2 * inter);
  const int64_t attention = rows * st.num_heads * (st.head_dim + 3) * 4;
  const int64_t acts = padded * 2 * (2 * hidden + q_size + inter) + 4096;
  return outputs + attention + acts + 64 * 64;
}

// Bytes of paged_decode's row-part states (row_split, work_queue.h) over `plan`'s rows in a
// team of `threads`, 0 where no row splits: an upper bound for a smaller team, which splits no
// more. A layer's attention takes them with team_empty, beside team_layer_bytes.
int64_t row_parts_bytes(const Stack& st, const Plan& plan, int64_t rows, int64_t threads) {
  const Tensor rl = plan.row_len.contiguous();
  const int64_t* len = rl.data_ptr<int64_t>();
  int64_t parts = 0;
  for (int64_t b = 0; b < std::min(rows, rl.numel()); ++b) {
    const RowSplit sp = row_split(len[b], rows, st.num_kv_heads, threads);
    if (sp.parts > 1) parts += sp.parts;
  }
  return parts == 0 ? 0 : parts * st.num_heads * (st.head_dim + 2) * 4 + 64;
}

// Team steps run as two micro-batches because the team's threads were far apart (team_splits),
// since the process started (radixrt::decode_team_microbatch_steps; monotonic).
std::atomic<int64_t>& team_microbatch_steps() {
  static std::atomic<int64_t> steps{0};
  return steps;
}

int64_t decode_team_microbatch_steps() { return team_microbatch_steps().load(); }

// Sets whether a team's members take each other's items (team.h, TeamStealSettings: `mode` 1
// or 0) and the test delay of its last member's own items (`slow_us`, 0 in use); -1 leaves
// either. Returns the previous [mode, slow_us] and the items taken so far. Between steps only.
std::vector<int64_t> decode_team_steal(int64_t mode, int64_t slow_us) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "decode_team_steal: mode must be -1, 0 or 1, got ", mode);
  TORCH_CHECK(slow_us >= -1 && slow_us <= 1000000,
              "decode_team_steal: slow_us must be in [-1, 1e6], got ", slow_us);
  TeamStealSettings& s = team_steal_settings();
  std::vector<int64_t> previous{s.mode.load(), s.slow_us.load(), s.taken.load()};
  if (mode >= 0) s.mode.store(mode);
  if (slow_us >= 0) s.slow_us.store(slow_us);
  return previous;
}

// Two micro-batches of one step: rows [0, split) and [split, rows), each through every layer
// (run_layers) on its own thread. The second starts once the first has finished its first
// attention (see the top of the file). `run(i)` is micro-batch i's thread's part.
struct MicroBatches {
  const Stack& st;
  const Tensor& h0;
  const Tensor& loc;
  const Plan& plan;
  int64_t bounds[3];
  Progress first;  // the first micro-batch's; the second's is awaited by no one
  std::tuple<Tensor, Tensor> out[2];

  MicroBatches(const Stack& st_, const Tensor& h0_, const Tensor& loc_, const Plan& plan_,
               int64_t split)
      : st(st_), h0(h0_), loc(loc_), plan(plan_), bounds{0, split, h0_.size(0)} {}

  void run(int64_t i) {
    // The first marks its progress done on every way out, an error in its rows' plan included
    // (run_layers marks it only once it runs), so the second never waits on an error.
    struct Done {
      Progress* p;
      ~Done() {
        if (p) p->attentions.store(Progress::kDone, std::memory_order_release);
      }
    } done{i == 0 ? &first : nullptr};
    const Plan rows = plan.rows(bounds[i], bounds[i + 1]);
    if (i == 1) first.wait_for(1);  // the first's first attention done (or it left)
    out[i] = run_layers(st, h0, loc, rows, bounds[i], bounds[i + 1], i == 0 ? &first : nullptr);
  }

  std::tuple<Tensor, Tensor> result() const {
    return {at::cat({std::get<0>(out[0]), std::get<0>(out[1])}),
            at::cat({std::get<1>(out[0]), std::get<1>(out[1])})};
  }
};

// Whether a team of `size` whose placement probe said `placement` runs an `n`-row step as two
// micro-batches (`far_split`: 1 always where it can, 0 never, -1 where its threads are far
// apart, placement.h).
bool team_splits(int64_t far_split, int64_t size, int64_t n, TeamMember::Placement placement) {
  if (size != 2 || n < 2 || far_split == 0) return false;
  return far_split > 0 || (placement == TeamMember::kFarApart && n >= kFarMicrobatchRows);
}

// One pass as a team: every intra-op thread runs every layer (run_layers), the ops sharing their
// work among the team; the result is bitwise the per-op-region pass (each op computes each
// output as it does there). Returns copies (the next step reuses the arena). A team of two
// whose probe finds its threads far apart (team_splits) runs the step as two micro-batches
// instead, one per member, outside the team (bitwise alike too), split at `micro_split` (0:
// no boundary is free of dependencies, run_stack: never split).
std::tuple<Tensor, Tensor> run_team(const Stack& st, const Tensor& h0, const Tensor& loc,
                                    const Plan& plan, int64_t norms_whole, int64_t far_split,
                                    int64_t micro_split) {
  const int64_t n = h0.size(0), threads = at::get_num_threads();
  const int64_t bytes = team_layer_bytes(st, n, h0.size(1), h0.element_size()) +
                        row_parts_bytes(st, plan, n, threads);
  const int64_t half = (bytes + 63) & ~int64_t{63};
  Team team(threads, half, team_arena(Team::arena_size(threads, half)));
  std::tuple<Tensor, Tensor> out;
  MicroBatches micro(st, h0, loc, plan, micro_split > 0 ? micro_split : n / 2);
  std::atomic<bool> split{false};
  const at::ThreadLocalState tls;  // the caller's (inference mode, dispatch keys) on each thread
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    const at::ThreadLocalStateGuard guard(tls);
    TeamMember member(team, b, e);
    try {
      const bool probe = norms_whole < 0 || far_split < 0;
      const TeamMember::Placement placement =
          probe ? member.probe_placement() : TeamMember::kNear;
      if (micro_split > 0 && team_splits(far_split, member.size, n, placement)) {
        if (member.id == 0) split.store(true, std::memory_order_relaxed);
        micro.run(member.id);  // no TeamScope: its ops run on this thread alone
        return;
      }
      const TeamScope scope(member);
      member.norms_whole = norms_whole < 0 ? placement != TeamMember::kNear : norms_whole > 0;
      TeamStealSettings& steal = team_steal_settings();
      member.steal = steal.mode.load(std::memory_order_relaxed) != 0;
      if (member.id == member.size - 1) member.slow_us = steal.slow_us.load();
      auto r = run_layers(st, h0, loc, plan, 0, n, nullptr);
      if (member.taken > 0) steal.taken.fetch_add(member.taken, std::memory_order_relaxed);
      if (member.id == 0) out = std::move(r);
    } catch (...) {
      team.failed.store(true, std::memory_order_relaxed);
      throw;
    }
  });
  if (split.load(std::memory_order_relaxed)) {
    team_microbatch_steps().fetch_add(1, std::memory_order_relaxed);
    return micro.result();
  }
  return {std::get<0>(out).clone(), std::get<1>(out).clone()};
}

// Every layer over the step's rows of `plan` on a checked stack (check_stack), as one pass (a
// team where `team` and it fits) or two micro-batches (`split`).
std::tuple<Tensor, Tensor> run_stack(const Stack& st, const Tensor& h0, const Tensor& loc,
                                     const Plan& plan_in, int64_t split, bool team,
                                     int64_t norms_whole, int64_t far_split) {
  TORCH_CHECK(h0.dim() == 2, "decode_layers: h must be [rows, hidden]");
  const int64_t n = h0.size(0);
  TORCH_CHECK(split >= 0 && split < std::max<int64_t>(n, 1),
              "decode_layers: split must be in [0, rows), got ", split, " for ", n, " rows");
  TORCH_CHECK(plan_in.row_start.numel() == n && plan_in.row_len.numel() == n && loc.numel() == n,
              "decode_layers: row_start, row_len and loc must have one entry per row");
  // Rows that read each other's new K/V (several tokens of one request) stay on one side of a
  // micro-batch boundary, and a team meets before attending to them.
  Plan plan = plan_in;
  int64_t half = n / 2;
  const std::vector<uint8_t> dep = step_dependencies(plan, loc);
  plan.rows_depend = std::find(dep.begin(), dep.end(), uint8_t{1}) != dep.end();
  if (plan.rows_depend) {
    split = independent_split(dep, split);
    half = independent_split(dep, half);
  }
  if (split == 0) {
    if (team && team_fits(st, n)) {
      return run_team(st, h0, loc, plan, norms_whole, far_split, half);
    }
    return run_layers(st, h0, loc, plan, 0, n, nullptr);
  }
  MicroBatches micro(st, h0, loc, plan, split);
  const at::ThreadLocalState tls;  // the caller's (inference mode, dispatch keys) on each thread
  at::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) {
    const at::ThreadLocalStateGuard guard(tls);
    for (int64_t i = b; i < e; ++i) micro.run(i);
  });
  return micro.result();
}

std::tuple<Tensor, Tensor> decode_layers(
    const Tensor& h0, const Tensor& cos, const Tensor& sin, at::TensorList norms,
    const OptTensors& weights, c10::IntArrayRef meta, at::TensorList k_buffers,
    at::TensorList v_buffers, at::TensorList k_scales, at::TensorList v_scales,
    const Tensor& loc, const Tensor& kv_indices,
    const Tensor& row_start, const Tensor& row_len, const Tensor& group_start,
    const Tensor& group_len, const Tensor& group_row_ptr, const Tensor& group_rows,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
    int64_t split, bool team, int64_t norms_whole, int64_t far_split) {
  check_stack(norms, weights, meta, k_buffers, v_buffers, k_scales, v_scales, num_heads,
              num_kv_heads, head_dim);
  const Stack st{cos, sin, norms, weights, meta, k_buffers, v_buffers, k_scales, v_scales,
                 num_heads, num_kv_heads, head_dim, eps, scale,
                 team ? team_row_limit(weights, meta) : -1};
  return run_stack(st, h0, loc,
                   {kv_indices, row_start, row_len, group_start, group_len, group_row_ptr,
                    group_rows},
                   split, team, norms_whole, far_split);
}

// What a decode step takes that does not change from step to step: the model's embedding,
// RoPE tables, final norm and every layer's norms / linears (decode_layers' flattened lists),
// the KV pool's buffers (and an int8 pool's scales), the head shape. Checked once, when built;
// it holds references to those tensors (no copies), so the step writes the pool's own buffers.
struct DecodeStack : torch::CustomClassHolder {
  Tensor embed, cos_table, sin_table, final_norm;
  double final_eps;
  std::vector<Tensor> norms;
  OptTensors weights;
  std::vector<int64_t> meta;
  std::vector<Tensor> k_buffers, v_buffers, k_scales, v_scales;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t team_rows;  // team_row_limit of the linears, computed once

  DecodeStack(Tensor embed_, Tensor cos_table_, Tensor sin_table_, Tensor final_norm_,
              double final_eps_, std::vector<Tensor> norms_, OptTensors weights_,
              std::vector<int64_t> meta_, std::vector<Tensor> k_buffers_,
              std::vector<Tensor> v_buffers_, std::vector<Tensor> k_scales_,
              std::vector<Tensor> v_scales_, int64_t num_heads_, int64_t num_kv_heads_,
              int64_t head_dim_, double eps_, double scale_)
      : embed(std::move(embed_)), cos_table(std::move(cos_table_)),
        sin_table(std::move(sin_table_)), final_norm(std::move(final_norm_)),
        final_eps(final_eps_), norms(std::move(norms_)), weights(std::move(weights_)),
        meta(std::move(meta_)), k_buffers(std::move(k_buffers_)),
        v_buffers(std::move(v_buffers_)), k_scales(std::move(k_scales_)),
        v_scales(std::move(v_scales_)), num_heads(num_heads_), num_kv_heads(num_kv_heads_),
        head_dim(head_dim_), eps(eps_), scale(scale_) {
    check_stack(norms, weights, meta, k_buffers, v_buffers, k_scales, v_scales, num_heads,
                num_kv_heads, head_dim);
    TORCH_CHECK(embed.dim() == 2 && cos_table.dim() == 2 && sin_table.dim() == 2,
                "DecodeStack: embed, cos_table and sin_table must be 2-D");
    team_rows = team_row_limit(weights, meta);
  }
};

// A step's first rows from its DecodeStack: the embedding rows of `ids` and the RoPE table rows
// of `positions` (F.embedding and index_select, as the model's Python has them), and the
// Stack over them (the DecodeStack was checked when built). Outlives the Stack it makes.
struct StepRows {
  Tensor h0, cos, sin;

  StepRows(const DecodeStack& s, const Tensor& ids, const Tensor& positions)
      : h0(at::embedding(s.embed, ids)),
        cos(at::index_select(s.cos_table, 0, positions)),
        sin(at::index_select(s.sin_table, 0, positions)) {}

  Stack stack(const DecodeStack& s, int64_t team_rows) const {
    return Stack{cos, sin, s.norms, s.weights, s.meta, s.k_buffers, s.v_buffers, s.k_scales,
                 s.v_scales, s.num_heads, s.num_kv_heads, s.head_dim, s.eps, s.scale, team_rows};
  }
};

// The whole decode step up to the LM head: embedding rows of `ids`, RoPE rows of `positions`,
// decode_layers, the final RMSNorm. The same ops as the model's Python around decode_layers
// (F.embedding, index_select of the cos / sin tables, add_rms_norm), so bitwise that; what it
// saves is their Python cost, paid cold every step (the step has just streamed its weights and
// K/V through the caches).
Tensor decode_step(const c10::intrusive_ptr<DecodeStack>& s, const Tensor& ids,
                   const Tensor& positions, const Tensor& loc, const Tensor& kv_indices,
                   const Tensor& row_start, const Tensor& row_len, const Tensor& group_start,
                   const Tensor& group_len, const Tensor& group_row_ptr,
                   const Tensor& group_rows, int64_t split, bool team,
                   int64_t norms_whole, int64_t far_split) {
  TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.numel() == positions.numel(),
              "decode_step: ids and positions must be 1-D with one entry per row");
  const StepRows in(*s, ids, positions);
  const auto [h, residual] = run_stack(
      in.stack(*s, s->team_rows), in.h0, loc,
      {kv_indices, row_start, row_len, group_start, group_len, group_row_ptr, group_rows}, split,
      team, norms_whole, far_split);
  return std::get<0>(Ops::get().add_rms_norm.call(h, residual, s->final_norm, s->final_eps));
}

// An extend step (a prefill, or a mixed step: extend rows and one-token decode rows) through
// every layer in one call: the embedding rows of `ids`, the RoPE rows of `positions`, each
// layer's K/V stored at `loc` (every token's slot) and attended to as ExtendAttention says
// (`ext`: the extend op's 4 plan tensors, or none in a mixed step without extend rows;
// `dec_tok` / `ext_tok` / `dec_plan` (paged_decode's 7): a mixed step's split). The ops run
// one after the other, each with its own parallel region (no team, no micro-batches). Returns
// the last layer's (MLP output, residual) of every token: the caller norms the rows it needs
// (the model's Python after its own loop), so the result is bitwise that loop's. A pool of the
// model's dtype, or float16 under a float32 model (an int8 pool takes the loop).
std::tuple<Tensor, Tensor> extend_step(const c10::intrusive_ptr<DecodeStack>& s,
                                       const Tensor& ids, const Tensor& positions,
                                       const Tensor& loc, at::TensorList ext,
                                       const std::optional<Tensor>& dec_tok,
                                       const std::optional<Tensor>& ext_tok,
                                       at::TensorList dec_plan) {
  TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && loc.dim() == 1 &&
                  ids.numel() == positions.numel() && ids.numel() == loc.numel(),
              "extend_step: ids, positions and loc must be 1-D with one entry per token");
  TORCH_CHECK(ids.numel() > 0, "extend_step: no tokens");
  TORCH_CHECK(s->k_scales.empty(), "extend_step: an int8 pool takes the layer loop");
  const at::ScalarType pool_type = s->k_buffers[0].scalar_type();
  TORCH_CHECK(pool_type == s->embed.scalar_type() ||
                  (pool_type == at::kHalf && s->embed.scalar_type() == at::kFloat),
              "extend_step: the pool's dtype ", pool_type, " is neither the model's ",
              s->embed.scalar_type(), " nor float16 under float32");
  TORCH_CHECK(ext.empty() || ext.size() == 4,
              "extend_step: ext must hold (kv_indices, kv_indptr, loc, qo_indptr) or nothing");
  const int64_t n = ids.numel();
  ExtendAttention attn;
  attn.ext = ext.vec();
  if (dec_tok.has_value()) {
    TORCH_CHECK(dec_plan.size() == 7,
                "extend_step: a mixed step's dec_plan must hold paged_decode's 7 plan tensors");
    TORCH_CHECK(ext_tok.has_value() == !ext.empty(),
                "extend_step: ext_tok must be given exactly when ext is");
    attn.dec_tok = dec_tok->to(at::kLong);
    attn.dec = Plan{dec_plan[0], dec_plan[1], dec_plan[2], dec_plan[3],
                    dec_plan[4], dec_plan[5], dec_plan[6]};
    TORCH_CHECK(attn.dec_tok.dim() == 1 && attn.dec->row_start.numel() == attn.dec_tok.numel(),
                "extend_step: dec_plan must have one row per dec_tok entry");
    int64_t rows = attn.dec_tok.numel();
    if (ext_tok.has_value()) {
      attn.ext_tok = ext_tok->to(at::kLong);
      TORCH_CHECK(attn.ext_tok.dim() == 1, "extend_step: ext_tok must be 1-D");
      rows += attn.ext_tok.numel();
    }
    TORCH_CHECK(rows == n, "extend_step: dec_tok and ext_tok must cover the ", n,
                " tokens once, got ", rows, " entries");
  } else {
    TORCH_CHECK(!ext.empty() && !ext_tok.has_value() && dec_plan.empty(),
                "extend_step: a step without dec_tok takes ext alone");
  }
  const StepRows in(*s, ids, positions);
  static const Plan none{};
  return run_layers(in.stack(*s, -1), in.h0, loc, none, 0, n, nullptr, &attn);
}

#if RADIXRT_TEAM_WAITS
// bench/team_waits.py: [member][phase] barrier wait in ns, then [member][phase] barrier counts,
// summed since the last reset (see team.h).
std::vector<int64_t> team_waits_read(bool reset) {
  std::vector<int64_t> out;
  for (auto* table : {&team_waits.ns, &team_waits.count}) {
    for (auto& row : *table) {
      for (auto& v : row) out.push_back(reset ? v.exchange(0) : v.load());
    }
  }
  return out;
}
#endif

}  // namespace
}  // namespace radixrt_cpu

TORCH_LIBRARY_FRAGMENT(radixrt, m) {
#if RADIXRT_TEAM_WAITS
  m.def("team_waits(bool reset) -> int[]", &radixrt_cpu::team_waits_read);
#endif
  m.class_<radixrt_cpu::DecodeStack>("DecodeStack")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, double,
                       std::vector<at::Tensor>, radixrt_cpu::OptTensors, std::vector<int64_t>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, int64_t, int64_t, int64_t, double, double>());
  m.def(
      "decode_step(__torch__.torch.classes.radixrt.DecodeStack stack, Tensor ids, "
      "Tensor positions, Tensor loc, Tensor kv_indices, Tensor row_start, Tensor row_len, "
      "Tensor group_start, Tensor group_len, Tensor group_row_ptr, Tensor group_rows, "
      "int split=0, bool team=False, int norms_whole=-1, int far_split=-1) -> Tensor");
  m.def(
      "extend_step(__torch__.torch.classes.radixrt.DecodeStack stack, Tensor ids, "
      "Tensor positions, Tensor loc, Tensor[] ext, Tensor? dec_tok, Tensor? ext_tok, "
      "Tensor[] dec_plan) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor h, Tensor cos, Tensor sin, Tensor[] norms, Tensor?[] weights, "
      "int[] meta, Tensor(a!)[] k_buffers, Tensor(b!)[] v_buffers, Tensor(c!)[] k_scales, "
      "Tensor(d!)[] v_scales, Tensor loc, Tensor kv_indices, "
      "Tensor row_start, Tensor row_len, Tensor group_start, Tensor group_len, "
      "Tensor group_row_ptr, Tensor group_rows, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale, int split=0, bool team=False, int norms_whole=-1, "
      "int far_split=-1) -> "
      "(Tensor, Tensor)");
  m.def("decode_team_rows(Tensor?[] weights, int[] meta) -> int",
        &radixrt_cpu::decode_team_rows);
  m.def("decode_team_microbatch_steps() -> int", &radixrt_cpu::decode_team_microbatch_steps);
  m.def("decode_team_steal(int mode=-1, int slow_us=-1) -> int[]",
        &radixrt_cpu::decode_team_steal);
}

TORCH_LIBRARY_IMPL(radixrt, CPU, m) {
  m.impl("decode_layers", &radixrt_cpu::decode_layers);
  m.impl("decode_step", &radixrt_cpu::decode_step);
  m.impl("extend_step", &radixrt_cpu::extend_step);
}

// A weight list holding oneDNN-packed tensors (prepack.py) dispatches decode_layers on their
// key; the same CPU function takes them.
TORCH_LIBRARY_IMPL(radixrt, MkldnnCPU, m) {
  m.impl("decode_layers", &radixrt_cpu::decode_layers);
}
