"""Prepacked bf16 matmul weights (oneDNN's blocked layout), where they pay on this CPU.

`F.linear` on a plain bf16 weight lets oneDNN reorder the weight into its blocked layout on
every call. Packing it once (`torch.ops.mkldnn._reorder_linear_weight`) and calling
`mkldnn::_linear_pointwise` skips that: on a 2-core Xeon with AMX-BF16, SmolLM2's 30 layers at
16-128 rows took 0.58-0.71x the time with the weights in the caches (at 64 rows 21.9 -> 12.8
ms; in a batch-64 decode step, with K/V streaming through the caches, only as fast as the int4
kernel), while at 512 rows the two are even and oneDNN picks other kernels for some shapes.
Up to PACKED_MAX_ROWS rows the packed call is bitwise the plain one (tested over row counts,
shapes and biases), so packing changes speed only, never a result.

`prepack_pays(dtype)` measures once per process whether packed beats plain at 64 rows on a
model-shaped layer by PREPACK_MIN_SPEEDUP (bf16 on CPU only: elsewhere, or without oneDNN, it is
False). `RADIXRT_PREPACK=0|1` forces the outcome (benchmarks, tests). The packed tensor is an
opaque oneDNN tensor kept beside the plain weight (which larger calls, invariant calls and every
other path still use): it costs the weight's bytes again.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from radixrt.model.probe_timing import interleaved_best

logger = logging.getLogger(__name__)

ENV_FORCE = "RADIXRT_PREPACK"
PACKED_MAX_ROWS = 256  # calls of up to this many rows take the packed weight
PREPACK_MIN_SPEEDUP = 1.15
_PROBE_SHAPE = (3072, 576)  # SmolLM2's gate_up: [out, in]
_PROBE_ROWS = 64


def available() -> bool:
    """Whether this torch build can pack weights for oneDNN at all."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PROBE_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on `pack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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

