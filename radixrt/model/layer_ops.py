"""The element-wise ops of a decoder layer (residual add + RMSNorm, SiLU-mul, RoPE), behind one
seam: `TorchLayerOps` (the reference: plain torch, any device) and `FusedCpuLayerOps` (one C++
op each, `radixrt/attention/csrc/fused_ops.cpp`, built with the other CPU kernels by
`radixrt.attention.cpu_kernels`). `select_layer_ops` picks one for a model.

Both compute the same roundings (HF's: RMSNorm normalised in fp32, cast to the model dtype, then
scaled by the weight; every elementwise op rounded to the model dtype), so the fused ops are
bitwise the torch ones wherever the C++ build and torch's own kernels agree on the order of the
norm's sum and on `exp`. `select_layer_ops` checks that on random rows: fp32 models use the
fused ops only when they are bitwise identical (fp32 is the mode of the HF parity tests); bf16 /
fp16 models use them when they agree within one unit of the dtype's rounding.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from radixrt.model.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF `LlamaRMSNorm`: normalise in fp32, cast back, then scale by `weight`."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class LayerOps(ABC):
    """Row-wise ops (each output row a function of its input row only: batch invariant).
    Inputs are 2-D `[rows, features]` in the model dtype, outputs in the same dtype."""

    name: str

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm` into its inputs, bitwise the same values: `residual` becomes
        x + residual and `x` the norm; returns (x, residual). For rows the caller owns and
        reads no more in their old values (a layer's matmul output and its residual stream);
        both contiguous, not sharing memory."""
        out, s = self.add_rms_norm(x, residual, weight, eps)
        residual.copy_(s)
        x.copy_(out)
        return x, residual

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of `gate_up = [gate | up]` `[rows, 2I]` -> `[rows, I]`."""

    @abstractmethod
    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (`RotaryEmbedding` layout; `cos`, `sin` `[rows, 1, head_dim]`) of the q and k
        heads at the front of `qkv` `[rows, >= (Hq + Hkv) * head_dim]`: (q `[rows, Hq, D]`,
        k `[rows, Hkv, D]`), not necessarily contiguous."""


class TorchLayerOps(LayerOps):
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + residual
        return rms_norm(s, weight, eps), s

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = qkv.shape[0], cos.shape[-1]
        heads = num_q_heads + num_kv_heads
        qk = RotaryEmbedding.apply(qkv[:, : heads * d].view(n, heads, d), cos, sin)
        return qk[:, :num_q_heads], qk[:, num_q_heads:]


class FusedCpuLayerOps(LayerOps):
    """`torch.ops.radixrt.*` (CPU tensors of FUSED_DTYPES; the caller checked the library)."""

    name = "fused-cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.radixrt.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.radixrt.add_rms_norm(x, residual, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # its stores land in the lines its loads brought in (fresh outputs' did not: 2x at 512
        # rows x 576 in a prefill)
        torch.ops.radixrt.add_rms_norm_(x, residual, weight, eps)
        return x, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixrt.silu_mul(gate_up)

    def rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.radixrt.rope_qk(qkv, cos.squeeze(1), sin.squeeze(1), num_q_heads,
                                         num_kv_heads)


def _self_check(ops: LayerOps, dtype: torch.dtype, hidden: int, inter: int, head_dim: int,
                rows: int = 5) -> float:
    """Largest difference between `ops` and `TorchLayerOps` on random rows of this model's
    shapes, in units of the dtype's eps relative to the magnitude (0.0: bitwise identical)."""
    ref = TorchLayerOps()
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, r, w = rnd(rows, hidden, scale=3.0), rnd(rows, hidden), rnd(hidden)
    gu = rnd(rows, 2 * inter, scale=4.0)
    heads = 3
    qkv = rnd(rows, 3 * heads * head_dim)
    ang = torch.rand(rows, 1, head_dim // 2, generator=g) * 100
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    pairs = [(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)),
             *zip(ops.add_rms_norm(x, r, w, 1e-6), ref.add_rms_norm(x, r, w, 1e-6), strict=True),
             *zip(ops.add_rms_norm_(x.clone(), r.clone(), w, 1e-6),
                  ref.add_rms_norm(x, r, w, 1e-6), strict=True),
             (ops.silu_mul(gu), ref.silu_mul(gu)),
             *zip(ops.rope_qk(qkv, cos, sin, heads, 1), ref.rope_qk(qkv, cos, sin, heads, 1),
                  strict=True)]
    worst = 0.0
    eps = torch.finfo(dtype).eps
    for a, b in pairs:
        if a.shape != b.shape:
            return float("inf")
        if torch.equal(a, b):
            continue
        diff = (a.float() - b.float()).abs() / (b.float().abs() + 1e-3)
        worst = max(worst, float(diff.max()) / eps, 1e-9)
    return worst


def select_layer_ops(dtype: torch.dtype, device: torch.device, hidden: int, inter: int,
                     head_dim: int, fused: bool | None = None) -> LayerOps:
    """The fused CPU ops when they can run here and pass the self-check (see the module doc),
    else the torch ones. `fused`: None decides; False always torch; True raises (saying why)
    when the fused ops cannot be used."""
    if fused is False:
        return TorchLayerOps()
    reason = fused_unavailable_reason(dtype, device, hidden, inter, head_dim)
    if reason is None:
        return FusedCpuLayerOps()
    if fused:
        raise RuntimeError(f"fused CPU layer ops unavailable: {reason}")
    if device.type == "cpu":
        logger.info("layer ops: torch (%s)", reason)
    return TorchLayerOps()


def fused_unavailable_reason(dtype: torch.dtype, device: torch.device, hidden: int, inter: int,
                             head_dim: int) -> str | None:
    """None when `FusedCpuLayerOps` may serve a model of these shapes, else why not."""
    from radixrt.attention import cpu_kernels

    if device.type != "cpu":
        return f"device {device.type} is not the CPU"
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} not supported"
    if head_dim % 2:
        return "odd head_dim"
    if not cpu_kernels.load_cpu_kernels():
        return f"CPU kernels unavailable ({cpu_kernels.unavailable_reason()})"
    if not hasattr(torch.ops.radixrt, "rms_norm"):
        return "the CPU kernel library has no fused ops"
    err = _self_check(FusedCpuLayerOps(), dtype, hidden, inter, head_dim)
    if dtype == torch.float32 and err != 0.0:
        return (f"not bitwise identical to torch's fp32 ops on this CPU (kernels "
                f"{torch.ops.radixrt.fused_ops_isa()}, torch "
                f"{torch.backends.cpu.get_cpu_capability()})")
    if err > 1.0:
        return f"differs from torch's ops by {err:.1f} units of rounding"
    return None
