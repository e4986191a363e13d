"""`DecodeLayers`: every decoder layer of a decode (or extend) step in one C++ call.

`torch.ops.radixrt.decode_layers` (radixrt/attention/csrc/decode_layers.cpp) calls the same ops
as the Python layer loop with `FusedCpuLayerOps` (norms, RoPE, SiLU-mul, the matmuls, `kv_store`,
`paged_decode`) in the same order, so its result is bitwise the loop's; it removes the per-op
Python cost, ~100 us per layer, which is a third of a small decode batch's step here. One op
differs: a down projection on the vnni kernel takes gate_up through `qgemm_vnni_silu` (SiLU-mul
inside its activation quantization), bitwise the loop's `silu_mul` then `qgemm_vnni`. The model
calls it through `radixrt::decode_step` (`run_step`), which adds the embedding, the RoPE rows
and the final norm around the layers in the same call.

One pass over the rows can run as a team of threads (`team`): every intra-op thread runs the
whole layer loop inside one parallel region, the ops sharing their work and meeting at spin
barriers instead of opening a parallel region each (decode_layers.cpp, team.h); a member done
with its share of a matmul or an attention takes the others' last items (`set_team_steal`).

A step of many rows on two threads can run as two micro-batches, one per thread (`split`, see
`LlamaForCausalLM.decode_split`): each micro-batch goes through every layer on its own thread,
so one's paged decode (memory-bound) overlaps the other's matmuls (compute-bound). It is used
only when every matmul is on radixrt's row-invariant kernels (`row_invariant`): each op then
computes a row as in the whole batch, and the result is bitwise the unsplit one.

Extend (prefill and mixed) steps run the same C++ layer loop through `radixrt::extend_step`
(`run_extend`), on the same held stack, with their attention as the backend's `ExtendStepPlan`
says (the extend op; the paged-decode op for a mixed step's one-token rows) and each op in its
own parallel region; the caller norms the rows it needs, so the result is bitwise its loop's.

It applies when the whole step is of that shape: a decode batch whose attention is the
paged-decode op (`AttentionBackend.paged_decode_plan`), fused CPU layer ops, and every matmul
dense or on radixrt's `qgemv` or `qgemm_vnni` kernel (`build` says why not otherwise, and the
model then runs its Python loop). The flattened weight list is built once per model and holds references to
the model's own tensors (no copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixrt.attention.extend_attention import ExtendStepPlan
from radixrt.attention.paged_decode import PagedDecodePlan
from radixrt.model.layer_ops import FusedCpuLayerOps, LayerOps
from radixrt.model.linear import DenseWeight, LinearWeight, QuantizedWeight
from radixrt.model.quant_matmul import TiledQuantMatmul, VnniQuantMatmul

# the op's linear kinds (see decode_layers.cpp); KIND_VNNI_HILO: the vnni kernel, two terms
KIND_DENSE, KIND_QGEMV, KIND_VNNI, KIND_VNNI_HILO = 0, 1, 2, 3
SLOTS_PER_LINEAR = 6  # (a, b, c, dense, bias, packed): decode_layers.cpp's kSlotsPerLinear


def _linear_entry(w: LinearWeight, bias: torch.Tensor | None
                  ) -> tuple[list[torch.Tensor | None], list[int]] | str:
    """(SLOTS_PER_LINEAR weight slots, 3 meta ints) of one matmul for the op, or why it cannot
    run there. The last slot is the dense weight's packed copy (prepack.py: AMX or oneDNN
    layout), if any."""
    if isinstance(w, DenseWeight):
        return [w.weight, None, None, None, bias, w.packed], [KIND_DENSE, 0, 0]
    dense = None if not isinstance(w, QuantizedWeight) or w.dense is None else w.dense
    packed = None if dense is None else dense.packed
    plain = None if dense is None else dense.weight
    if isinstance(w, QuantizedWeight) and isinstance(w.kernel, TiledQuantMatmul):
        k = w.kernel
        return ([k.codes, k.scale, k.offset, plain, bias, packed],
                [KIND_QGEMV, k.bits, w.max_rows])
    if isinstance(w, QuantizedWeight) and isinstance(w.kernel, VnniQuantMatmul):
        return ([w.kernel.packed, None, None, plain, bias, packed],
                [KIND_VNNI if w.kernel.terms == 1 else KIND_VNNI_HILO, w.kernel.bits,
                 w.max_rows])
    return f"matmul weight {w.describe()} has no C++ path"


def set_team_steal(on: bool) -> bool:
    """Whether a decode team's members, once their share of a matmul's tiles or an attention's
    items is done, take the others' last ones (`radixrt::decode_team_steal`; team.h
    `TeamMember::run_items`). Process-wide, between steps only (the runner sets it from
    `ServerArgs.disable_team_steal`); bitwise alike. Returns the previous setting."""
    return bool(torch.ops.radixrt.decode_team_steal(1 if on else 0)[0])


class DecodeLayers:
    """The arguments of `radixrt::decode_layers` that do not change from step to step."""

    def __init__(self, norms: list[torch.Tensor], weights: list[torch.Tensor | None],
                 meta: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, scale: float):
        self.norms, self.weights, self.meta = norms, weights, meta
        # Every matmul on radixrt's qgemv / vnni kernels with no dense copy: those compute a
        # row the same whatever the row count (torch's dense matmuls need not), so the whole
        # step is row-invariant and may run as micro-batches bitwise.
        self.row_invariant = all(
            meta[3 * i] in (KIND_QGEMV, KIND_VNNI, KIND_VNNI_HILO)
            and weights[SLOTS_PER_LINEAR * i + 3] is None
            for i in range(len(meta) // 3))
        # The most rows one pass may take as a team of threads (decode_layers.cpp, team.h:
        # every matmul without a bias, on the vnni kernel or dense on an AMX-packed weight,
        # rows within prepack.AMX_MAX_ROWS and within the max_rows of a dense copy that is not
        # AMX-packed), -1 for none; the op also needs 2+ threads.
        self.team_rows = int(torch.ops.radixrt.decode_team_rows(weights, meta))
        self.team_capable = self.team_rows >= 1
        # A team's norms and their matmuls' quantization on every row of each member (one
        # meeting fewer each): 1 always, 0 never, -1 where its two threads share no cache (the
        # team probes as it forms; decode_layers.cpp). Bitwise alike; tests set it.
        self.team_norms_whole = -1
        # Whether a team of two runs a step as two micro-batches instead, one per thread: -1
        # where its probe finds the threads far apart (every round trip over 300 ns) and the step
        # has 8+ rows, 1 always (2+ rows), 0 never (decode_layers.cpp, placement.h). Bitwise
        # alike; tests and benchmarks set it.
        self.team_far_split = -1
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scale = eps, scale
        # (the arguments it was built from, the radixrt.DecodeStack): see run_step
        self._held_stack: tuple[tuple[object, ...], torch.ScriptObject] | None = None

    @classmethod
    def build(cls, layers: Sequence[torch.nn.Module], ops: LayerOps) -> DecodeLayers | str:
        """From a model's `LlamaDecoderLayer`s, or the reason the op cannot run them."""
        if not isinstance(ops, FusedCpuLayerOps):
            return f"layer ops are {ops.name}, not the fused CPU ops"
        if not hasattr(torch.ops.radixrt, "decode_step"):
            return "the CPU kernel library has no decode_step op"
        if not layers:
            return "no layers"
        norms: list[torch.Tensor] = []
        weights: list[torch.Tensor | None] = []
        meta: list[int] = []
        for layer in layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            for w, b in ((layer.qkv_proj, layer.qkv_bias), (layer.o_proj, layer.o_bias),
                         (layer.gate_up_proj, layer.gate_up_bias),
                         (layer.down_proj, layer.down_bias)):
                entry = _linear_entry(w, b)
                if isinstance(entry, str):
                    return entry
                weights += entry[0]
                meta += entry[1]
        first = layers[0]
        return cls(norms, weights, meta, first.num_heads, first.num_kv_heads, first.head_dim,
                   first.eps, first.scaling)

    def run_step(self, ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, final_norm: torch.Tensor,
                 final_eps: float, loc: torch.Tensor, plan: PagedDecodePlan,
                 k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                 k_scales: list[torch.Tensor] | None = None,
                 v_scales: list[torch.Tensor] | None = None, split: int = 0,
                 team: bool = False, far_split: int | None = None) -> torch.Tensor:
        """The decode step up to the LM head in one call (`radixrt::decode_step`): the embedding
        rows of `ids`, the RoPE table rows of `positions`, every layer (`radixrt::decode_layers`;
        new K/V stored at `loc`, an int8 pool's scales in `k_scales` / `v_scales`), the final
        RMSNorm. Returns the normed last hidden states `[rows, hidden]`, bitwise the layer
        loop's. `split` > 0: rows `[0, split)` and `[split, rows)` run as two micro-batches, one
        per thread. `team` (one pass): as a team of the intra-op threads in one parallel region
        where `team_capable` and 2+ threads, else with a parallel region per op; bitwise alike.
        `far_split`: the team's choice of micro-batches (`team_far_split`, its default).

        The step-invariant arguments (this object's weights, the tables, the pool's buffer
        lists) go to the op as one `radixrt.DecodeStack`, built on the first call and again
        whenever one of them is another object: a pool's buffer lists must not be changed in
        place."""
        stack = self._stack_for(embed, cos_table, sin_table, final_norm, final_eps, k_buffers,
                                v_buffers, k_scales, v_scales)
        return torch.ops.radixrt.decode_step(
            stack, ids, positions, loc, *plan.tensors(), split, team, self.team_norms_whole,
            self.team_far_split if far_split is None else far_split)

    def run_extend(self, ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
                   cos_table: torch.Tensor, sin_table: torch.Tensor, final_norm: torch.Tensor,
                   final_eps: float, loc: torch.Tensor, plan: ExtendStepPlan,
                   k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                   k_scales: list[torch.Tensor] | None = None,
                   v_scales: list[torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's layers in one call (`radixrt::extend_step`): the embedding rows of
        `ids`, the RoPE rows of `positions`, every layer with its attention as `plan` says (new
        K/V stored at `loc`), each op with its own parallel region. Returns the last layer's
        (MLP output, residual stream) of every token, bitwise the layer loop's; the caller
        norms the rows it needs. Takes the same arguments as `run_step` (and so the same held
        stack; `final_norm` is not applied here); the pool must be of the model's dtype or
        float16 under a float32 model (not int8: `k_scales` empty)."""
        stack = self._stack_for(embed, cos_table, sin_table, final_norm, final_eps, k_buffers,
                                v_buffers, k_scales, v_scales)
        ext, dec_tok, ext_tok, dec_plan = plan.op_args()
        return torch.ops.radixrt.extend_step(stack, ids, positions, loc, ext, dec_tok, ext_tok,
                                             dec_plan)

    def _stack_for(self, *ends: object) -> torch.ScriptObject:
        """The `radixrt.DecodeStack` of these step-invariant arguments (see `run_step`)."""
        held = self._held_stack
        if held is not None and all(a is b or (isinstance(a, float) and a == b)
                                    for a, b in zip(held[0], ends, strict=True)):
            return held[1]
        embed, cos_table, sin_table, final_norm, final_eps, kb, vb, ks, vs = ends
        stack = torch.classes.radixrt.DecodeStack(
            embed, cos_table, sin_table, final_norm, float(final_eps), self.norms, self.weights,
            self.meta, kb, vb, ks or [], vs or [], self.num_heads, self.num_kv_heads,
            self.head_dim, self.eps, self.scale)
        self._held_stack = (ends, stack)
        return stack
