"""Prepacked bf16 matmul weights, where they pay on this CPU: radixrt's AMX layout on CPUs with
usable AMX-BF16 tiles, else oneDNN's blocked layout.

- **AMX** (`csrc/amx_linear.cpp`, `amx_pack`): weight blocks of 32 x 32 in the tiles' pair
  layout, run by `radixrt::amx_linear`. Row-invariant (each output a fixed sequence of tile
  sums over K, whatever the row count; the bias added before the one rounding), bitwise
  `F.linear` where oneDNN also sums K in order (1-8 and 512 rows on SmolLM2's shapes), elsewhere
  a few outputs in 10^4 differ by the fp32 sums' order. Measured on a 2-vCPU AMX Xeon against
  oneDNN's plain call: whole prefills of the default model (its bf16 dense copies) of 256
  tokens 1.18x, 512 1.11x, 1024 1.15x, 1300 1.05x, 1536 0.91x; calls of up to AMX_MAX_ROWS rows
  take it, weights whose sizes are multiples of 32. An MLP's `[gate; up]` weight in this layout
  (an even number of 32-blocks) takes `packed_linear_silu` (`radixrt::amx_linear_silu`, the
  SiLU-mul in the linear's epilogue, bitwise radixrt::silu_mul of `packed_linear`) at any row
  count: against `F.linear` then `silu_mul`, 1.15x at 1024 rows, 1.33-1.5x at 1536-2048, 1.03x
  at 4096, 1.39x at 8192 (weights in cache; in a model oneDNN's gate_up at 4096 rows ran at
  1.4 TFLOP/s, its 25 MB output leaving the caches).
- **oneDNN** (`torch.ops.mkldnn._reorder_linear_weight`, `mkldnn::_linear_pointwise`):
  `F.linear` on a plain bf16 weight lets oneDNN reorder the weight on every call; packing once
  skips that. On the same Xeon, 30 layers at 16-128 rows took 0.58-0.71x the time with the
  weights in the caches (at 64 rows 21.9 -> 12.8 ms), while at 512 rows the two are even and
  oneDNN picks other kernels for some shapes. Up to PACKED_MAX_ROWS rows the packed call is
  bitwise the plain one (tested over row counts, shapes and biases).

`prepack_pays(dtype)` measures once per process whether packed (in the layout `pack` makes)
beats plain at 64 rows on a model-shaped layer by PREPACK_MIN_SPEEDUP (bf16 on CPU only:
elsewhere, or without oneDNN and AMX, it is False). `RADIXRT_PREPACK=0|1` forces the outcome
(benchmarks, tests); `RADIXRT_AMX_LINEAR=0` keeps oneDNN's layout where AMX is usable. The packed
tensor is kept beside the plain weight (which larger calls, invariant calls and every other path
still use): it costs the weight's bytes again.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from radixrt.attention import cpu_kernels
from radixrt.model.probe_timing import interleaved_best

logger = logging.getLogger(__name__)

ENV_FORCE = "RADIXRT_PREPACK"
ENV_AMX = "RADIXRT_AMX_LINEAR"
PACKED_MAX_ROWS = 256  # calls of up to this many rows take a oneDNN-packed weight
AMX_MAX_ROWS = 1024  # ... and an AMX-packed one (the measurements above)
AMX_BLOCK = 32  # outputs and inputs per AMX weight block
PREPACK_MIN_SPEEDUP = 1.15
_PROBE_SHAPE = (3072, 576)  # SmolLM2's gate_up: [out, in]
_PROBE_ROWS = 64


@functools.cache
def available() -> bool:
    """Whether oneDNN packs bf16 weights here: the torch build has the op, and this CPU's oneDNN
    takes bf16 (torch 2.13's refuses where the CPU has neither AVX-NE-CONVERT nor
    AVX512-BW/VL/DQ, e.g. AVX2-only Zen 3)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), 8)
    except RuntimeError:
        return False
    return True


@functools.cache
def amx_available() -> bool:
    """Whether radixrt's kernels run `amx_linear` here (built with AMX-BF16, tiles usable), and
    `RADIXRT_AMX_LINEAR` does not say 0."""
    forced = os.environ.get(ENV_AMX, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{ENV_AMX} must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False
    return (cpu_kernels.load_cpu_kernels() and hasattr(torch.ops.radixrt, "amx_linear_available")
            and bool(torch.ops.radixrt.amx_linear_available()))


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 `weight` [N, K] (N and K multiples of AMX_BLOCK) in amx_linear's layout
    [N/32, K/32, 2, 16, 32]: block (nb, kb), half t, row r holds outputs 32 nb + 16 t + 0..15,
    each as its input pair (32 kb + 2r, 32 kb + 2r + 1)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % AMX_BLOCK or k % AMX_BLOCK:
        raise ValueError(f"amx_pack: needs a bfloat16 weight with both sizes multiples of "
                         f"{AMX_BLOCK}, got {tuple(weight.shape)} {weight.dtype}")
    b = AMX_BLOCK
    w = weight.detach().reshape(n // b, 2, 16, k // b, 16, 2)  # (nb, t, n, kb, r, e)
    return w.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(n // b, k // b, 2, 16, 2 * 16)


def is_amx(packed: torch.Tensor) -> bool:
    """Whether `packed` is in amx_linear's layout (else oneDNN's)."""
    return packed.dim() == 5


def max_rows(packed: torch.Tensor) -> int:
    """Calls of up to this many rows take `packed` (the others the plain weight)."""
    return AMX_MAX_ROWS if is_amx(packed) else PACKED_MAX_ROWS


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] packed: amx_linear's layout where `amx_available()` and its sizes
    allow, else oneDNN's blocked layout (an opaque tensor)."""
    n, k = weight.shape
    if (weight.dtype == torch.bfloat16 and n % AMX_BLOCK == 0 and k % AMX_BLOCK == 0
            and amx_available()):
        return amx_pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PROBE_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on `pack(weight)` (how close: the module docstring)."""
    if is_amx(packed):
        y = torch.ops.radixrt.amx_linear(x.reshape(-1, x.shape[-1]), packed, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_f32(x: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """`packed_linear`'s fp32 sums before their rounding to bf16 (an LM head's logits), for a
    weight in amx_linear's layout (`is_amx`)."""
    y = torch.ops.radixrt.amx_linear_f32(x.reshape(-1, x.shape[-1]), packed, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def packed_linear_argmax(x: torch.Tensor, packed: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """Each row's argmax over `packed_linear_f32(x, packed, bias)` (int64 `[M]`, bitwise
    `sampler.row_argmax` of those logits) without the logits (amx_linear_argmax), for a weight
    in amx_linear's layout (`is_amx`) and a 2-D x."""
    return torch.ops.radixrt.amx_linear_argmax(x, packed, bias)


def packed_linear_silu(x: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """radixrt::silu_mul of `packed_linear(x, packed, bias)` for a `[gate; up]` weight in
    amx_linear's layout (bitwise; an even number of 32-output blocks), in one call."""
    y = torch.ops.radixrt.amx_linear_silu(x.reshape(-1, x.shape[-1]), packed, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _measure(dtype: torch.dtype, reps: int = 5, copies: int = 8) -> tuple[float, float]:
    """Best ms of a pass over `copies` model-shaped weights, plain and packed."""
    n, k = _PROBE_SHAPE
    ws = [torch.full((n, k), 0.01, dtype=dtype) for _ in range(copies)]
    ps = [pack(w) for w in ws]
    x = torch.randn(_PROBE_ROWS, k).to(dtype)

    def plain() -> None:
        for w in ws:
            torch.nn.functional.linear(x, w)

    def packed() -> None:
        for p in ps:
            packed_linear(x, p, None)

    best = interleaved_best({"plain": plain, "packed": packed}, min_reps=reps, max_reps=reps)
    return best["plain"] * 1e3, best["packed"] * 1e3


@functools.cache
def prepack_pays(dtype: torch.dtype, device_type: str = "cpu") -> bool:
    """Whether `DenseWeight`s of `dtype` on `device_type` should keep a packed copy (above)."""
    forced = os.environ.get(ENV_FORCE, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{ENV_FORCE} must be 0 or 1, got {forced!r}")
    if device_type != "cpu" or dtype != torch.bfloat16 or not available():
        return False
    if forced:
        return forced == "1"
    try:
        with torch.inference_mode():
            plain, packed = _measure(dtype)
    except RuntimeError as e:  # a oneDNN build without this path
        logger.info("prepacked matmul weights: unavailable (%s)", e)
        return False
    pays = plain >= PREPACK_MIN_SPEEDUP * packed
    logger.info("prepacked matmul weights: %s (%d rows, %d threads: plain %.2f ms, packed %.2f ms, "
                "needs >= %.2fx)", "on" if pays else "off", _PROBE_ROWS, torch.get_num_threads(),
                plain, packed, PREPACK_MIN_SPEEDUP)
    return pays

