"""Rotary position embedding, neox / HF "rotate_half" layout (as HF Llama and Qwen2 apply it).

The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` for the supported types:
"default", "linear", "dynamic", "llama3", "yarn". "dynamic" (NTK) rescales only once a sequence
grows past `max_position_embeddings`; the runtime never serves beyond that length, so within the
cache it is exactly "default" (HF computes the same frequencies there).

Invariant: `positions` passed to `cos_sin` are in `[0, max_positions)`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixrt.model.model_config import RopeParams

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_inv_freq(params: RopeParams, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim // 2] fp32, attention_scaling applied to cos and sin)."""
    rope_type = params.rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    dim = int(head_dim * params.partial_rotary_factor)
    base = params.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / _need(params.factor, "factor"), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(params, dim)
    return inv_freq, 1.0


def _need(v: float | int | None, name: str) -> float:
    if v is None:
        raise ValueError(f"rope scaling parameter {name!r} is required")
    return float(v)


def _llama3(inv_freq: torch.Tensor, p: RopeParams) -> torch.Tensor:
    factor = _need(p.factor, "factor")
    low = _need(p.low_freq_factor, "low_freq_factor")
    high = _need(p.high_freq_factor, "high_freq_factor")
    old_ctx = _need(p.original_max_position_embeddings, "original_max_position_embeddings")
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(p: RopeParams, dim: int) -> tuple[torch.Tensor, float]:
    base = p.theta
    factor = _need(p.factor, "factor")
    orig = _need(p.original_max_position_embeddings, "original_max_position_embeddings")

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.attention_factor
    if attention_factor is None:
        if p.mscale and p.mscale_all_dim:
            attention_factor = get_mscale(factor, p.mscale) / get_mscale(factor, p.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.beta_fast or 32.0
    beta_slow = p.beta_slow or 1.0

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """A cos/sin cache `[max_positions, head_dim]` indexed by position, applied rotate-half style.

    Stores `cos` duplicated over both halves and `sin` with the first half negated, so applying
    it is `x * cos + roll(x, half) * sin`, which equals HF's `x * cos + rotate_half(x) * sin`.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        params: RopeParams,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        if params.partial_rotary_factor != 1.0:
            raise ValueError("partial rotary embeddings are not supported by Llama-family models")
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq, scaling = rope_inv_freq(params, head_dim)
        pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(pos, inv_freq)  # fp32, as HF computes it
        cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
        self.register_buffer("cos", torch.cat([cos, cos], -1).to(device, dtype), persistent=False)
        self.register_buffer("sin", torch.cat([-sin, sin], -1).to(device, dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and sin, `[num_tokens, 1, head_dim]`, broadcastable over heads."""
        cos = torch.index_select(self.cos, 0, positions).unsqueeze(1)
        sin = torch.index_select(self.sin, 0, positions).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x [num_tokens, heads, head_dim]`; returns a new contiguous tensor."""
        rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
        return x * cos + rotated * sin
