"""`LinearWeight`: one matmul's weight (`y = x @ W.T + b`, W `[out, in]`) in one of its storage
forms, behind one call, `weight(x, bias, invariant)`.

- `DenseWeight`: a plain tensor in the model dtype; `F.linear`.
- `QuantizedWeight`: `Int4Groups` (4-bit or 8-bit) packed for a quantized matmul kernel
  (`quant_matmul.QuantMatmul`: radixrt's C++ `qgemv` or `qgemm_vnni`, or torch's
  `_weight_int4pack_mm_for_cpu` where radixrt's kernel library is unavailable). Weight-only
  kernels (qgemv, torch) beat dense GEMMs only for a few rows (decode: they read 4-8x fewer
  weight bytes), and lose for many (prefill:
  they are compute-bound and dequantize on the fly), so a `QuantizedWeight` may keep a `dense`
  copy of its own dequantized values (model dtype) and run calls of more than `max_rows` rows
  on it. Both paths compute the same weights up to the rounding of the product (the vnni kernel
also rounds activations to int8; where the probe finds it faster at every row count measured,
no dense copy is kept).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.attention.base import MIN_INVARIANT_ROWS
from radixrt.model import prepack
from radixrt.model.quant import GROUP, Int4Groups
from radixrt.model.quant_matmul import QuantMatmul, TorchInt4Matmul, make_quant_matmul


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

    def logits(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """`forward(x)` in float32, for an LM head: weights whose kernel accumulates in fp32
        return those sums instead of rounding them to x's dtype first (a bf16 logit is only
        good to ~0.06 at 10)."""
        return self(x, None, invariant).float()

    def logits_argmax(self, x: torch.Tensor,
                      invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logits(x)` and each row's argmax over them where the kernel picks it while writing
        the logits (bitwise `sampler.row_argmax(logits)`), else None in its place."""
        return self.logits(x, invariant), None

    def greedy_ids(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor | None:
        """Each row's argmax over `logits(x)` (int64 `[M]`, bitwise `sampler.row_argmax`) where
        a kernel picks it without writing the logits, else None (the caller takes
        `logits_argmax`)."""
        return None

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None, invariant: bool,
                 silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`silu_mul(self(x, bias, invariant))` for a `[gate; up]` weight (`silu_mul` bitwise
        radixrt::silu_mul, as every `LayerOps.silu_mul` is); weights with a fused kernel skip
        the `[M, out]` intermediate."""
        return silu_mul(self(x, bias, invariant))

    @abstractmethod
    def bytes_read(self, rows: int) -> int:
        """Weight bytes one call with `rows` input rows reads (the representation it runs on)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this weight holds in memory (every representation kept)."""

    @abstractmethod
    def describe(self) -> str: ...


class DenseWeight(LinearWeight):
    """A plain weight; `pack()` adds a packed copy (`prepack.py`: AMX or oneDNN layout) that
    calls of up to `prepack.max_rows(packed)` rows take, except invariant ones."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.packed: torch.Tensor | None = None  # prepack.pack's copy, not a parameter

    def pack(self) -> None:
        """Keep a packed copy of the weight as it is now (call after its last change)."""
        self.packed = prepack.pack(self.weight)

    def _on_packed(self, rows: int, invariant: bool) -> bool:
        return (self.packed is not None and not invariant
                and rows <= prepack.max_rows(self.packed))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                invariant: bool = False) -> torch.Tensor:
        if self._on_packed(x.shape[0], invariant):
            return prepack.packed_linear(x, self.packed, bias)
        return dense_linear(x, self.weight, bias, invariant)

    def logits(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if self._on_packed(x.shape[0], invariant) and prepack.is_amx(self.packed):
            return prepack.packed_linear_f32(x, self.packed, None)  # amx_linear's fp32 sums
        return super().logits(x, invariant)

    def greedy_ids(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor | None:
        if (x.dim() == 2 and self._on_packed(x.shape[0], invariant)
                and prepack.is_amx(self.packed)):
            return prepack.packed_linear_argmax(x, self.packed, None)  # logits as `logits`
        return None

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None, invariant: bool,
                 silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if (self.packed is not None and prepack.is_amx(self.packed) and not invariant
                and self.packed.shape[0] % 2 == 0):  # any row count (prepack.py)
            return prepack.packed_linear_silu(x, self.packed, bias)
        return silu_mul(self(x, bias, invariant))

    def bytes_read(self, rows: int) -> int:
        return self.weight.numel() * self.weight.element_size()

    def nbytes(self) -> int:
        held = self.weight.numel() * self.weight.element_size()
        return held * 2 if self.packed is not None else held

    def describe(self) -> str:
        return f"dense {str(self.weight.dtype).removeprefix('torch.')}"


class QuantizedWeight(LinearWeight):
    """A quantized weight run by `kernel` (a `QuantMatmul`: radixrt's C++ qgemv or vnni kernel,
    or torch's int4 one); calls of more than `max_rows` rows, and invariant calls, run on
    `dense` when given (the caller fills it with `groups.dequantize(kernel.scale_dtype)` in the
    model dtype so both paths hold the same weights). Without `dense` every call runs on the
    kernel."""

    def __init__(self, kernel: QuantMatmul, dense: torch.Tensor | None = None,
                 max_rows: int = 0):
        super().__init__()
        self.kernel = kernel
        self.out_features, self.in_features = kernel.out_features, kernel.in_features
        self.bits = kernel.bits
        self.dense = None if dense is None else DenseWeight(dense)
        self.max_rows = max_rows if dense is not None else torch.iinfo(torch.int64).max

    @classmethod
    def from_groups(cls, groups: Int4Groups, dense: torch.Tensor | None = None,
                    max_rows: int = 0, kernel: str = "auto") -> QuantizedWeight:
        """`groups` packed for `kernel` ("auto" | "radixrt" | "vnni" | "vnni-hilo" | "torch", see
        `quant_matmul.resolve_quant_kernel`)."""
        return cls(make_quant_matmul(groups, kernel), dense, max_rows)

    @property
    def planes(self) -> int:
        """4-bit planes of the weight (1: 4-bit, 2: 8-bit)."""
        return self.bits // 4

    def _on_dense(self, rows: int, invariant: bool) -> bool:
        return self.dense is not None and (rows > self.max_rows or invariant)

    def _on_kernel(self, x: torch.Tensor, invariant: bool, f32: bool) -> torch.Tensor:
        """The kernel's output (in float32 with `f32`, see `QuantMatmul.forward_f32`)."""
        n = x.shape[0]
        if invariant and n < MIN_INVARIANT_ROWS and isinstance(self.kernel, TorchInt4Matmul):
            y = self.kernel(_pad_rows(x, MIN_INVARIANT_ROWS))[:n]  # its small-M path differs
            return y.float() if f32 else y
        # radixrt's kernels: each row's arithmetic is independent of M
        return self.kernel.forward_f32(x) if f32 else self.kernel(x)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                invariant: bool = False) -> torch.Tensor:
        if self._on_dense(x.shape[0], invariant):
            return self.dense(x, bias, invariant)
        y = self._on_kernel(x, invariant, f32=False)
        return y if bias is None else y + bias

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None, invariant: bool,
                 silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self._on_dense(x.shape[0], invariant):
            return self.dense.silu_mul(x, bias, invariant, silu_mul)
        return silu_mul(self(x, bias, invariant))

    def logits(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if self._on_dense(x.shape[0], invariant):
            return self.dense.logits(x, invariant)
        return self._on_kernel(x, invariant, f32=True)

    def greedy_ids(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor | None:
        if self._on_dense(x.shape[0], invariant):
            return self.dense.greedy_ids(x, invariant)
        return None

    def logits_argmax(self, x: torch.Tensor,
                      invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._on_dense(x.shape[0], invariant) or isinstance(self.kernel, TorchInt4Matmul):
            return self.logits(x, invariant), None  # torch's kernel picks nothing
        return self.kernel.forward_f32_argmax(x)

    def bytes_read(self, rows: int) -> int:
        if self.dense is not None and rows > self.max_rows:
            return self.dense.bytes_read(rows)
        return self.kernel.nbytes()

    def nbytes(self) -> int:
        return self.kernel.nbytes() + (self.dense.nbytes() if self.dense is not None else 0)

    def describe(self) -> str:
        rows = "every call" if self.dense is None else f"<= {self.max_rows} rows, dense above"
        return f"{self.bits}-bit groups of {GROUP} on the {self.kernel.name} kernel ({rows})"


def describe_quantized(model: nn.Module) -> str:
    """Where the loaded model's quantized weights run, read from the weights themselves: per
    kind (the layers' matmuls, the LM head) and width, the rows run on the kernel. Two starts
    whose weights run alike give the same text, whatever their plans said of widths the model
    does not use ("" where no weight is quantized)."""
    seen: dict[tuple[str, int], set[str]] = {}
    kernels: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, QuantizedWeight):
            kind = "LM head" if name.rsplit(".", 1)[-1] == "lm_head" else "layers"
            rows = "every call" if m.dense is None else f"up to {m.max_rows} rows, dense above"
            seen.setdefault((kind, m.bits), set()).add(rows)
            kernels.add(m.kernel.name)
    if not seen:
        return ""
    parts = [f"{kind} {bits}-bit: {' / '.join(sorted(rows))}"
             for (kind, bits), rows in sorted(seen.items(), key=lambda kv: (kv[0][0] != "layers",
                                                                           kv[0][1]))]
    return f"{'/'.join(sorted(kernels))} kernel; {'; '.join(parts)}"


def pack_dense_weights(module: nn.Module) -> int:
    """`pack()` every `DenseWeight` under `module` (quantized weights' dense copies included)
    where `prepack.prepack_pays` for its dtype and device; returns how many were packed."""
    packed = 0
    for m in module.modules():
        if isinstance(m, DenseWeight) and prepack.prepack_pays(m.weight.dtype,
                                                               m.weight.device.type):
            m.pack()
            packed += 1
    return packed
