"""`LlamaForCausalLM`: the Llama / Mistral / Qwen2 decoder, run one `ForwardBatch` step at a time.

Weights are stored fused: `qkv_proj` = [q; k; v] rows (plus bias when the config has one) and
`gate_up_proj` = [gate; up] rows, so each layer runs four matmuls. `load_weights` takes HF names
(`model.layers.N.self_attn.q_proj.weight`, ...) and writes each tensor into its slice.
Parameters are allocated uninitialised; `load_weights` must fill every one (it checks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.attention.base import MIN_INVARIANT_ROWS, AttentionBackend
from radixrt.core.forward_batch import ForwardBatch
from radixrt.model.model_config import ModelConfig
from radixrt.model.rope import RotaryEmbedding

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF `LlamaRMSNorm`: normalise in fp32, cast back, then scale by `weight`."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           invariant: bool = False) -> torch.Tensor:
    """`F.linear`; with `invariant`, inputs of fewer than MIN_INVARIANT_ROWS rows are zero-padded
    to it (and the result cut back), so each output row is bitwise the same whatever the row
    count: the small-M GEMM kernels round differently."""
    n = x.shape[0]
    if not invariant or n >= MIN_INVARIANT_ROWS:
        return F.linear(x, w, b)
    xp = x.new_zeros(MIN_INVARIANT_ROWS, *x.shape[1:])
    xp[:n] = x
    return F.linear(xp, w, b)[:n]


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
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, hid, **p)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, **p) if cfg.qkv_bias else None
        self.o_proj = _param(hid, self.q_size, **p)
        self.o_bias = _param(hid, **p) if cfg.o_proj_bias else None
        self.gate_up_proj = _param(2 * inter, hid, **p)
        self.gate_up_bias = _param(2 * inter, **p) if cfg.mlp_bias else None
        self.down_proj = _param(hid, inter, **p)
        self.down_bias = _param(hid, **p) if cfg.mlp_bias else None

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
        residual = h if residual is None else h + residual
        x = rms_norm(residual, self.input_layernorm, self.eps)
        n = x.shape[0]
        qkv = linear(x, self.qkv_proj, self.qkv_bias, inv)
        qk_heads = self.num_heads + self.num_kv_heads
        qk = RotaryEmbedding.apply(
            qkv[:, : self.q_size + self.kv_size].view(n, qk_heads, self.head_dim), cos, sin
        )
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v, residual

    def post_attention(
        self, o: torch.Tensor, residual: torch.Tensor, inv: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, residual add, post-attention norm and the MLP: (MLP output, residual)."""
        n = o.shape[0]
        h = linear(o.reshape(n, self.q_size), self.o_proj, self.o_bias, inv)
        residual = h + residual
        x = rms_norm(residual, self.post_attention_layernorm, self.eps)
        gate_up = linear(x, self.gate_up_proj, self.gate_up_bias, inv)
        gate, up = gate_up.chunk(2, dim=-1)
        h = linear(F.silu(gate) * up, self.down_proj, self.down_bias, inv)
        return h, residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM over the paged KV pool; `forward` returns float32 logits per request."""

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
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
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, **p)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, dtype=dtype, device=dev
        )

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
        attn = self.attn_backend
        if attn is None:
            raise RuntimeError("LlamaForCausalLM.attn_backend is not set")
        h = F.embedding(fb.input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(fb.positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, fb, attn)
        assert residual is not None
        idx = fb.logits_indices
        b = int(idx.numel())
        if fb.score_rows is not None:
            idx = torch.cat([idx, fb.score_rows])
        last = torch.index_select(h, 0, idx) + torch.index_select(residual, 0, idx)
        last = rms_norm(last, self.norm, self.config.rms_norm_eps)
        logits = linear(last[:b], self.lm_head, None, invariant_step(attn, fb)).float()
        return logits, (last[b:] if fb.score_rows is not None else None)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; raises if any slice stays empty."""
        cfg = self.config
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        fused = {
            "self_attn.q_proj": ("qkv", 0, q),
            "self_attn.k_proj": ("qkv", q, kv),
            "self_attn.v_proj": ("qkv", q + kv, kv),
            "mlp.gate_proj": ("gate_up", 0, inter),
            "mlp.up_proj": ("gate_up", inter, inter),
        }
        plain = {
            "input_layernorm.weight": "input_layernorm",
            "post_attention_layernorm.weight": "post_attention_layernorm",
            "self_attn.o_proj.weight": "o_proj",
            "self_attn.o_proj.bias": "o_bias",
            "mlp.down_proj.weight": "down_proj",
            "mlp.down_proj.bias": "down_bias",
        }
        expected = self._expected_weight_names()
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: HF ignores a stored copy too
            target, rows = self._locate(name, fused, plain)
            if target is None:
                raise KeyError(f"unexpected weight {name!r} for {cfg.architecture}")
            dst = target if rows is None else target[rows[0] : rows[0] + rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: expected shape {tuple(dst.shape)}, got {tuple(tensor.shape)}"
                )
            with torch.no_grad():
                dst.copy_(tensor)
            seen.add(name)
        missing = expected - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:5]}")

    def _locate(
        self,
        name: str,
        fused: dict[str, tuple[str, int, int]],
        plain: dict[str, str],
    ) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        top = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if name == "lm_head.weight":
            return self.lm_head, None
        if name in top:
            return top[name], None
        m = _LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            return None, None
        layer: LlamaDecoderLayer = self.layers[int(m.group(1))]  # type: ignore[assignment]
        rest = m.group(2)
        if rest in plain:
            return getattr(layer, plain[rest]), None
        module, _, kind = rest.rpartition(".")
        if module in fused and kind in ("weight", "bias"):
            group, start, size = fused[module]
            attr = {
                ("qkv", "weight"): "qkv_proj",
                ("qkv", "bias"): "qkv_bias",
                ("gate_up", "weight"): "gate_up_proj",
                ("gate_up", "bias"): "gate_up_bias",
            }[(group, kind)]
            return getattr(layer, attr), (start, size)
        return None, None

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
