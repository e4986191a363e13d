"""`LlamaForCausalLM`: the Llama / Mistral / Qwen2 decoder, run one `ForwardBatch` step at a time.

Weights are stored fused: `qkv_proj` = [q; k; v] rows (plus bias when the config has one) and
`gate_up_proj` = [gate; up] rows, so each layer runs four matmuls, each a `LinearWeight` (dense,
or quantized under a `QuantPlan`; see `model.linear`). `load_weights` takes HF names
(`model.layers.N.self_attn.q_proj.weight`, ...) and writes each tensor into its slice.
Parameters are allocated uninitialised; `load_weights` must fill every one (it checks).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.attention.base import AttentionBackend
from radixrt.attention.extend_attention import ExtendStepPlan
from radixrt.config import ServerArgs
from radixrt.core.forward_batch import ForwardBatch
from radixrt.model.decode_layers import DecodeLayers
from radixrt.model.decode_path_tuner import DecodePathTuner
from radixrt.model.layer_ops import LayerOps, TorchLayerOps, rms_norm, select_layer_ops
from radixrt.model.linear import DenseWeight, LinearWeight, QuantizedWeight
from radixrt.model.model_config import ModelConfig
from radixrt.model.quant import (
    GGUFQuantTensor,
    Int4Groups,
    QuantPlan,
    kernel_supports,
    to_groups,
)
from radixrt.model.rope import RotaryEmbedding

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "invariant_step", "rms_norm"]


def invariant_step(attn: AttentionBackend, fb: ForwardBatch) -> bool:
    """Whether this step runs batch-invariant (extend steps only; see `AttentionBackend`)."""
    return not fb.is_decode and (attn.batch_invariant or fb.batch_invariant)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.eps = cfg.rms_norm_eps
        self.scaling = cfg.head_dim**-0.5
        hid, inter = cfg.hidden_size, cfg.intermediate_size
        p = {"dtype": dtype, "device": device}
        self.input_layernorm = _param(hid, **p)
        self.post_attention_layernorm = _param(hid, **p)
        self.qkv_proj: LinearWeight = DenseWeight(_param(self.q_size + 2 * self.kv_size, hid, **p))
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, **p) if cfg.qkv_bias else None
        self.o_proj: LinearWeight = DenseWeight(_param(hid, self.q_size, **p))
        self.o_bias = _param(hid, **p) if cfg.o_proj_bias else None
        self.gate_up_proj: LinearWeight = DenseWeight(_param(2 * inter, hid, **p))
        self.gate_up_bias = _param(2 * inter, **p) if cfg.mlp_bias else None
        self.down_proj: LinearWeight = DenseWeight(_param(hid, inter, **p))
        self.down_bias = _param(hid, **p) if cfg.mlp_bias else None
        # Residual add + norm, RoPE, SiLU-mul; the model sets the fused CPU ops when they apply.
        self.ops: LayerOps = TorchLayerOps()

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fb: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before it); their sum is the output."""
        inv = invariant_step(attn, fb)
        q, k, v, residual = self.pre_attention(h, residual, cos, sin, inv)
        o = attn.forward(q, k, v, self.layer_id, self.scaling, fb)
        return self.post_attention(o, residual, inv)

    def pre_attention(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inv: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual add, input norm, qkv projection, RoPE: (q, k, v, residual stream). Dense
        work only (no KV pool, no batch metadata), so it can be compiled."""
        ops = self.ops
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_layernorm, self.eps)
        else:
            # in place: h (the last layer's MLP output) and the residual are this step's own
            x, residual = ops.add_rms_norm_(h, residual, self.input_layernorm, self.eps)
        n = x.shape[0]
        qkv = self.qkv_proj(x, self.qkv_bias, inv)
        q, k = ops.rope_qk(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        return q, k, v, residual

    def post_attention(
        self, o: torch.Tensor, residual: torch.Tensor, inv: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, residual add, post-attention norm and the MLP: (MLP output, residual)."""
        n = o.shape[0]
        h = self.o_proj(o.reshape(n, self.q_size), self.o_bias, inv)
        x, residual = self.ops.add_rms_norm_(h, residual, self.post_attention_layernorm,
                                             self.eps)
        act = self.gate_up_proj.silu_mul(x, self.gate_up_bias, inv, self.ops.silu_mul)
        h = self.down_proj(act, self.down_bias, inv)
        return h, residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over the paged KV pool; `forward` returns float32 logits per request."""

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fused_ops: bool | None = None,
    ):
        """`fused_ops`: the decoder's element-wise ops as fused C++ CPU ops (None: when they run
        here and match the torch ones, see `model.layer_ops`; False: torch; True: required)."""
        super().__init__()
        dev = torch.device(device)
        self.config = config
        self.attn_backend = attn_backend  # may be set after loading, once the KV pool is sized
        self.dtype = dtype
        self.device = dev
        p = {"dtype": dtype, "device": dev}
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, **p)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, dev) for i in range(config.num_layers)
        )
        self.norm = _param(config.hidden_size, **p)
        self.lm_head: LinearWeight = DenseWeight(
            self.embed_tokens
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, **p)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, dtype=dtype, device=dev
        )
        self.ops: LayerOps = TorchLayerOps()
        # Decode steps run all layers in one C++ call where they can (`model.decode_layers`);
        # False: always the Python layer loop. The call's arguments are built on first use.
        self.fused_decode = True
        # Extend (prefill and mixed) steps too, where the backend's plan allows (`_extend_plan`).
        self.fused_extend = True
        # Rows from which a one-call decode step runs as two micro-batches (`decode_split`);
        # 0: never. The runner sets it from its ServerArgs; a model built alone takes the default.
        self.decode_microbatch_rows = ServerArgs.decode_microbatch_rows
        # One pass of a one-call decode step runs as a team of threads where it can (see
        # `DecodeLayers.team_capable`); the runner sets it from its ServerArgs.
        self.decode_team = not ServerArgs.disable_decode_team
        # From decode_microbatch_rows rows, micro-batches or one pass (a team, else a parallel
        # region per op), as timed (`DecodePathTuner`); None: always micro-batches there. The
        # runner sets it.
        self.decode_path_tuner: DecodePathTuner | None = (
            None if ServerArgs.disable_decode_path_tuning else DecodePathTuner())
        self._decode_layers: DecodeLayers | str | None = None
        self.set_layer_ops(select_layer_ops(dtype, dev, config.hidden_size,
                                            config.intermediate_size, config.head_dim,
                                            fused_ops))

    def set_layer_ops(self, ops: LayerOps) -> None:
        """Use `ops` (see `model.layer_ops.select_layer_ops`) in every layer and the final norm."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops
        self._decode_layers = None

    def decode_layers(self) -> DecodeLayers | str:
        """The one-call decode path for this model's weights and ops, or why there is none."""
        if self._decode_layers is None:
            self._decode_layers = DecodeLayers.build(list(self.layers), self.ops)
        return self._decode_layers

    def reset_decode_layers(self) -> None:
        """Drop the one-call decode stack, to be built again from the weights as they are now
        (it copies each quantized weight's max_rows when built: crossover_tuning.py)."""
        self._decode_layers = None

    def _microbatches_off(self) -> str | None:
        """Why no one-call decode step runs as micro-batches here, or None: they need
        `decode_microbatch_rows` > 0, exactly 2 torch intra-op threads (one per micro-batch;
        with more, the ops would run one thread each) and a row-invariant step
        (`DecodeLayers.row_invariant`: the split is then bitwise)."""
        if self.decode_microbatch_rows <= 0:
            return "off"
        if torch.get_num_threads() != 2:
            return f"{torch.get_num_threads()} threads, not 2"
        stack = self.decode_layers()
        if not isinstance(stack, DecodeLayers) or not stack.row_invariant:
            return "a matmul is not on radixrt's row-invariant kernels"
        return None

    def decode_split(self, rows: int) -> int:
        """Where the second micro-batch of a `rows`-row one-call decode step starts when the
        step splits, 0 for one batch: halves from `decode_microbatch_rows` rows (see
        `_microbatches_off`). Where a team pass could run such a step instead, the path tuner
        picks between the two at each step (`_microbatch_args`)."""
        return 0 if self._microbatches_off() is not None else self._split_rows(rows)

    def _split_rows(self, rows: int) -> int:
        """Micro-batches being on: halves from `decode_microbatch_rows` rows, else 0."""
        return rows // 2 if rows >= max(self.decode_microbatch_rows, 2) else 0

    def _microbatch_args(self, rows: int) -> tuple[int, int | None, bool]:
        """`run_step`'s (split, far_split) for a `rows`-row step, and whether the path tuner
        picked the path (it then wants the step's time): far_split 0 where micro-batches are
        off (else None: the team's own setting); from `decode_microbatch_rows` rows the step
        takes whichever of two micro-batches and one pass (a team where it fits, else a
        parallel region per op) the tuner picks, or splits where `decode_path_tuner` is None.
        Reads `_microbatches_off` once."""
        if self._microbatches_off() is not None:
            return 0, 0, False
        half = self._split_rows(rows)
        if half and self.decode_path_tuner is not None:
            return (half if self.decode_path_tuner.pick(rows) else 0), None, True
        return half, None, False

    def decode_path(self) -> str:
        """How decode steps run on this model, for the start-up log."""
        stack = self.decode_layers() if self.fused_decode else "disabled"
        if not isinstance(stack, DecodeLayers):
            return f"layer loop ({stack})"
        why = self._microbatches_off()
        if not self.decode_team:
            one = "one pass with a parallel region per op (team disabled)"
        elif not stack.team_capable:
            one = "one pass with a parallel region per op (a matmul is not on the vnni kernel)"
        elif torch.get_num_threads() < 2:
            one = "one pass on one thread"
        else:
            steal = torch.ops.radixrt.decode_team_steal()[0]
            one = "one pass as a team of threads" + ("" if steal else " (static shares)")
        if why is None:
            if one.startswith("one pass as a team of threads") and stack.team_far_split != 0:
                one += " (two micro-batches from 8 rows where its threads are far apart)"
            many = f"two micro-batches from {self.decode_microbatch_rows} rows"
            if self.decode_path_tuner is not None:
                other = "the team pass" if one.startswith("one pass as a team") else "one pass"
                many += f" or {other}, whichever is faster when timed"
            return f"one C++ call, {one}, {many}"
        return f"one C++ call, {one} (no micro-batches: {why})"

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run every layer of one step; float32 logits `[B, vocab]` for rows `fb.logits_indices`."""
        return self.forward_scored(fb)[0]

    @torch.inference_mode()
    def forward_scored(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s logits, plus the final-normed hidden states of `fb.score_rows` (prompt
        scoring; None when the batch has none), for `model.scoring.score_hidden`.

        The caller runs `attn_backend.init_forward_metadata(fb)` first (once per step, as
        `ModelRunner.forward` does), so it can plan, e.g. for CUDA graphs, outside the model.
        """
        logits, hidden, _ = self._forward(fb, greedy=False)
        assert logits is not None  # only a greedy head may leave them out
        return logits, hidden

    @torch.inference_mode()
    def forward_greedy(self, fb: ForwardBatch
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward`'s logits and each row's argmax over them (int64 `[B]`, bitwise
        `sampler.row_argmax(logits)`) where the LM head's kernel picks it, else None in its
        place. Logits are None where the kernel picks the ids without writing them
        (`LinearWeight.greedy_ids`; the ids are then set), else what `forward` returns
        (`LinearWeight.logits_argmax`). Metadata as in `forward_scored`; `fb` scores no prompt
        rows."""
        if fb.score_rows is not None:
            raise ValueError("forward_greedy: the batch scores prompt rows (use forward_scored)")
        logits, _, ids = self._forward(fb, greedy=True)
        return logits, ids

    def _head(self, last: torch.Tensor, fb: ForwardBatch,
              greedy: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The LM head over the normed `last` rows: logits, and their argmax with `greedy`
        where the head's kernel picks it (then without the logits, None, where it can)."""
        invariant = invariant_step(self.attn_backend, fb)
        if greedy:
            ids = self.lm_head.greedy_ids(last, invariant)
            if ids is not None:
                return None, ids
            return self.lm_head.logits_argmax(last, invariant)
        return self.lm_head.logits(last, invariant), None

    def _forward(self, fb: ForwardBatch, greedy: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(logits (None only with `greedy`, see `_head`), the scored rows' hidden states or
        None, the logits' argmax or None)."""
        attn = self.attn_backend
        if attn is None:
            raise RuntimeError("LlamaForCausalLM.attn_backend is not set")
        stack = self.decode_layers() if self.fused_decode and fb.is_decode else None
        plan = attn.paged_decode_plan(fb) if isinstance(stack, DecodeLayers) else None
        if isinstance(stack, DecodeLayers) and plan is not None and fb.score_rows is None:
            # the whole step up to the LM head in one C++ call (decode batches score nothing)
            pool = attn.kv_pool
            split, far_split, tuned = self._microbatch_args(fb.batch_size)
            t0 = time.perf_counter()
            last = stack.run_step(fb.input_ids, fb.positions, self.embed_tokens,
                                  self.rotary.cos, self.rotary.sin, self.norm,
                                  self.config.rms_norm_eps, fb.out_cache_loc, plan,
                                  pool.k_buffer, pool.v_buffer, pool.k_scale, pool.v_scale,
                                  split=split, team=self.decode_team, far_split=far_split)
            if tuned:
                assert self.decode_path_tuner is not None
                self.decode_path_tuner.record(fb.batch_size, split > 0,
                                              time.perf_counter() - t0)
            logits, ids = self._head(last, fb, greedy)
            return logits, None, ids
        extend = self._extend_plan(fb)
        if extend is not None:
            # every layer of the extend step in one C++ call, as the loop below runs them
            assert isinstance(stack := self.decode_layers(), DecodeLayers)
            pool = attn.kv_pool
            h, residual = stack.run_extend(fb.input_ids, fb.positions, self.embed_tokens,
                                           self.rotary.cos, self.rotary.sin, self.norm,
                                           self.config.rms_norm_eps, fb.out_cache_loc, extend,
                                           pool.k_buffer, pool.v_buffer, pool.k_scale,
                                           pool.v_scale)
        else:
            h = F.embedding(fb.input_ids, self.embed_tokens)
            cos, sin = self.rotary.cos_sin(fb.positions)
            residual = None
            for layer in self.layers:
                h, residual = layer(h, residual, cos, sin, fb, attn)
        assert residual is not None
        idx = fb.logits_indices
        b = int(idx.numel())
        if fb.score_rows is not None:
            idx = torch.cat([idx, fb.score_rows])
        last, _ = self.ops.add_rms_norm(torch.index_select(h, 0, idx),
                                        torch.index_select(residual, 0, idx), self.norm,
                                        self.config.rms_norm_eps)
        logits, ids = self._head(last[:b], fb, greedy)
        return logits, (last[b:] if fb.score_rows is not None else None), ids

    def _extend_plan(self, fb: ForwardBatch) -> ExtendStepPlan | None:
        """The attention plan of extend step `fb` when its layers can run in one C++ call
        (`fused_extend`, the one-call stack built, the backend's `extend_step_plan`, the pool
        in the model's dtype or float16 under float32), else None (the Python layer loop)."""
        if fb.is_decode or not self.fused_extend:
            return None
        attn = self.attn_backend
        assert attn is not None
        if not isinstance(self.decode_layers(), DecodeLayers):
            return None
        plan = attn.extend_step_plan(fb)
        pool = attn.kv_pool
        if plan is None or not (pool.narrowed or pool.dtype == self.embed_tokens.dtype):
            return None
        return plan

    def linear_weights(self) -> list[LinearWeight]:
        """Every matmul weight of one forward step, in order (each layer's four, the LM head)."""
        out: list[LinearWeight] = []
        for layer in self.layers:
            out += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        return [*out, self.lm_head]

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFQuantTensor]],
                     quant: QuantPlan | None = None) -> None:
        """Copy HF-named tensors into the (fused) parameters; raises if any slice stays empty.

        A loader may yield a `GGUFQuantTensor` instead of a tensor. With a quantizing `quant`
        plan every matmul weight (fused from its pieces) becomes a `QuantizedWeight` where
        `quant.bits_for` says so: GGUF blocks of the matching width are kept exactly, other
        pieces quantized; its dense copy (and a tied embedding table) then holds the dequantized
        quantized values, so prefill and decode compute the same weights.
        """
        cfg = self.config
        plan = quant or QuantPlan()
        expected = self._expected_weight_names()
        seen: set[str] = set()
        pending: dict[tuple[nn.Module, str], list[tuple[int, torch.Tensor | GGUFQuantTensor]]] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: HF ignores a stored copy too
            loc = self._locate(name)
            if loc is None:
                raise KeyError(f"unexpected weight {name!r} for {cfg.architecture}")
            owner, attr, rows = loc
            if attr == "embed_tokens" and cfg.tie_word_embeddings and plan.quantized:
                attr = "lm_head"  # the tied table is quantized as the LM head's weight
            full = getattr(owner, attr)
            is_matmul = isinstance(full, LinearWeight)
            target = full.weight if is_matmul else full
            dst = target if rows is None else target[rows[0] : rows[0] + rows[1]]
            shape = tensor.shape if isinstance(tensor, GGUFQuantTensor) else tuple(tensor.shape)
            if tuple(dst.shape) != tuple(shape):
                raise ValueError(f"{name}: expected shape {tuple(dst.shape)}, got {tuple(shape)}")
            if plan.quantized and is_matmul:
                pending.setdefault((owner, attr), []).append((0 if rows is None else rows[0],
                                                               tensor))
            else:
                with torch.no_grad():
                    dst.copy_(tensor.dequantize() if isinstance(tensor, GGUFQuantTensor)
                              else tensor)
            seen.add(name)
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:5]}")
        for (owner, attr), parts in pending.items():
            setattr(owner, attr, self._build_linear(getattr(owner, attr), parts, plan,
                                                    lm_head=attr == "lm_head"))
        self._decode_layers = None  # the weights it would reference may have been replaced

    def _build_linear(self, dense: LinearWeight,
                      parts: list[tuple[int, torch.Tensor | GGUFQuantTensor]],
                      plan: QuantPlan, lm_head: bool = False) -> LinearWeight:
        """The weight of one matmul from its row pieces under `plan`; `dense` holds its
        (allocated, unfilled) parameter, which becomes the dense copy."""
        assert isinstance(dense, DenseWeight)
        parts = sorted(parts, key=lambda p: p[0])
        pieces = [t for _, t in parts]
        bits = plan.bits_for(pieces, lm_head)
        w = dense.weight
        if bits is None or not kernel_supports(*w.shape) or w.device.type != "cpu":
            with torch.no_grad():
                for start, t in parts:
                    src = t.dequantize() if isinstance(t, GGUFQuantTensor) else t
                    w[start : start + src.shape[0]].copy_(src)
            return dense
        groups = Int4Groups.cat([to_groups(t, bits) for t in pieces])
        tied = self.config.tie_word_embeddings and w is self.embed_tokens
        keep = plan.keeps_head_dense(bits) if lm_head else plan.keeps_dense(bits)
        qw = QuantizedWeight.from_groups(groups, w if keep else None, plan.max_rows(bits),
                                         plan.kernel)
        if keep or tied:  # a tied lm_head's table stays for the embedding lookup
            with torch.no_grad():  # the kernel's weight exactly, rounded to the model dtype
                w.copy_(groups.dequantize(qw.kernel.scale_dtype))
        return qw

    def _locate(self, name: str) -> tuple[nn.Module, str, tuple[int, int] | None] | None:
        """(module, attribute, rows slice or None) that HF weight `name` fills."""
        cfg = self.config
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        top = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
               "lm_head.weight": "lm_head"}
        if name in top:
            return self, top[name], None
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            return None
        layer: LlamaDecoderLayer = self.layers[int(m.group(1))]  # type: ignore[assignment]
        rest = m.group(2)
        plain = {
            "input_layernorm.weight": "input_layernorm",
            "post_attention_layernorm.weight": "post_attention_layernorm",
            "self_attn.o_proj.weight": "o_proj",
            "self_attn.o_proj.bias": "o_bias",
            "mlp.down_proj.weight": "down_proj",
            "mlp.down_proj.bias": "down_bias",
        }
        if rest in plain:
            return (layer, plain[rest], None) if getattr(layer, plain[rest]) is not None else None
        fused = {
            "self_attn.q_proj": ("qkv", 0, q),
            "self_attn.k_proj": ("qkv", q, kv),
            "self_attn.v_proj": ("qkv", q + kv, kv),
            "mlp.gate_proj": ("gate_up", 0, inter),
            "mlp.up_proj": ("gate_up", inter, inter),
        }
        module, _, kind = rest.rpartition(".")
        if module in fused and kind in ("weight", "bias"):
            group, start, size = fused[module]
            attr = f"{group}_proj" if kind == "weight" else f"{group}_bias"
            if getattr(layer, attr) is None:
                return None
            return layer, attr, (start, size)
        return None

    def _expected_weight_names(self) -> set[str]:
        cfg = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            kinds = ["weight"]
            names.update(
                pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
            )
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.update(
                    f"{pre}self_attn.{proj}.{k}" for k in kinds + (["bias"] if cfg.qkv_bias else [])
                )
            names.update(
                f"{pre}self_attn.o_proj.{k}" for k in kinds + (["bias"] if cfg.o_proj_bias else [])
            )
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.update(
                    f"{pre}mlp.{proj}.{k}" for k in kinds + (["bias"] if cfg.mlp_bias else [])
                )
        return names
