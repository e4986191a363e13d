"""`LinearWeight`: one matmul's weight (`y = x @ W.T + b`, W `[out, in]`) in one of its storage
forms, behind one call, `weight(x, bias, invariant)`.

- `DenseWeight`: a plain tensor in the model dtype; `F.linear`.
- `QuantizedWeight`: `Int4Groups` (4-bit, or 8-bit as two 4-bit planes) packed for torch's CPU
  weight-only kernel `_weight_int4pack_mm_for_cpu`, which runs with bf16 activations (inputs of
  another dtype are cast to bf16 and the result cast back). Weight-only kernels beat dense GEMMs
  only for a few rows (decode: they read 4-8x fewer weight bytes), and lose for many (prefill:
  they are compute-bound and dequantize on the fly), so a `QuantizedWeight` may keep a `dense`
  copy of its own dequantized values (model dtype) and run calls of more than `max_rows` rows
  on it. Both paths compute the same weights up to the rounding of the product.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.attention.base import MIN_INVARIANT_ROWS
from radixrt.model.quant import GROUP, Int4Groups


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    xp = x.new_zeros(rows, *x.shape[1:])
    xp[: x.shape[0]] = x
    return xp


def dense_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 invariant: bool = False) -> torch.Tensor:
    """`F.linear`; with `invariant`, inputs of fewer than MIN_INVARIANT_ROWS rows are zero-padded
    to it (and the result cut back), so each output row is bitwise the same whatever the row
    count: the small-M GEMM kernels round differently."""
    n = x.shape[0]
    if not invariant or n >= MIN_INVARIANT_ROWS:
        return F.linear(x, w, b)
    return F.linear(_pad_rows(x, MIN_INVARIANT_ROWS), w, b)[:n]


class LinearWeight(nn.Module, ABC):
    """A `[out_features, in_features]` matmul weight; `forward(x [M, in]) -> [M, out]` in x's
    dtype. `invariant=True` promises each output row is a bitwise function of its input row
    whatever M (see `dense_linear`)."""

    out_features: int
    in_features: int

    @abstractmethod
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                invariant: bool = False) -> torch.Tensor: ...

    @abstractmethod
    def bytes_read(self, rows: int) -> int:
        """Weight bytes one call with `rows` input rows reads (the representation it runs on)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this weight holds in memory (every representation kept)."""

    @abstractmethod
    def describe(self) -> str: ...


class DenseWeight(LinearWeight):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.out_features, self.in_features = (int(s) for s in weight.shape)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                invariant: bool = False) -> torch.Tensor:
        return dense_linear(x, self.weight, bias, invariant)

    def bytes_read(self, rows: int) -> int:
        return self.nbytes()

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def describe(self) -> str:
        return f"dense {str(self.weight.dtype).removeprefix('torch.')}"


class QuantizedWeight(LinearWeight):
    """`groups` packed for the int4 CPU kernel; calls of more than `max_rows` rows run on `dense`
    (when given; the caller fills it with `groups.dequantize()` in the model dtype so both paths
    hold the same weights). Without `dense` every call runs on the kernel."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, planes: int,
                 dense: torch.Tensor | None = None, max_rows: int = 0):
        """`packed` / `scales_and_zeros` as `Int4Groups.pack` returns them (`planes` side by side
        along K); see `from_groups`."""
        super().__init__()
        self.out_features = int(scales_and_zeros.shape[1])
        self.in_features = int(scales_and_zeros.shape[0]) * GROUP // planes
        self.planes = planes
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.dense = None if dense is None else DenseWeight(dense)
        self.max_rows = max_rows if dense is not None else torch.iinfo(torch.int64).max

    @classmethod
    def from_groups(cls, groups: Int4Groups, dense: torch.Tensor | None = None,
                    max_rows: int = 0) -> QuantizedWeight:
        packed, sz = groups.pack()
        return cls(packed, sz, groups.planes, dense, max_rows)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                invariant: bool = False) -> torch.Tensor:
        n = x.shape[0]
        if self.dense is not None and (n > self.max_rows or invariant):
            return self.dense(x, bias, invariant)
        xb = _pad_rows(x, MIN_INVARIANT_ROWS) if invariant and n < MIN_INVARIANT_ROWS else x
        xb = xb.to(torch.bfloat16).contiguous()
        if self.planes > 1:
            xb = torch.cat([xb] * self.planes, dim=1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP,
                                                       self.scales_and_zeros)[:n].to(x.dtype)
        return y if bias is None else y + bias

    def bytes_read(self, rows: int) -> int:
        if self.dense is not None and rows > self.max_rows:
            return self.dense.nbytes()
        return self.packed.numel() + self.scales_and_zeros.numel() * 2

    def nbytes(self) -> int:
        quant = self.packed.numel() + self.scales_and_zeros.numel() * 2
        return quant + (self.dense.nbytes() if self.dense is not None else 0)

    def describe(self) -> str:
        rows = "every call" if self.dense is None else f"<= {self.max_rows} rows, dense above"
        return f"{4 * self.planes}-bit groups of {GROUP} ({rows})"
