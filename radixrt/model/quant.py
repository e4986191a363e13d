"""Quantized weight data: GGUF block tensors as read from a file, and `Int4Groups`, the one
in-memory form every quantized matmul weight takes before it is packed for a quantized matmul
kernel (`quant_matmul`: radixrt's C++ kernel, or torch's int4 kernel described here).

`Int4Groups` holds one or two *planes* of 4-bit codes with a scale and a zero per group of
`GROUP` (32) consecutive input features:

    w[n, k] = sum over planes p of (q[p, n, k] - 8) * scale[p, n, k // 32] + zero[p, n, k // 32]

which is exactly what `torch.ops.aten._weight_int4pack_mm_for_cpu` computes from its packed
weight and `scales_and_zeros` (its zero point is added after `(q - 8) * scale`; measured). One
plane is a 4-bit weight; two planes are an 8-bit weight (`q8 = 16 * hi + lo`, hi in -8..7, lo in
0..15: plane 0 holds hi + 8 with scale 16d and zero 0, plane 1 holds lo with scale d and zero
8d), run as one int4 matmul over `[x, x]` (K doubled). So GGUF maps exactly:

- Q4_0 (`w = d * (q - 8)`): one plane, scale d, zero 0.
- Q4_1 (`w = d * q + m`): one plane, scale d, zero m + 8d.
- Q8_0 (`w = d * q`, q int8): two planes as above.

torch's kernel takes scales and zeros in the activation dtype (bf16), so the only change from the
file is rounding each group's scale and zero to bf16 (`dequantize` reproduces that exactly);
radixrt's kernel keeps them exact (`dequantize(scale_dtype=None)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

GROUP = 32  # input features per scale/zero group (GGUF's block size too)
KERNEL_SCALE_DTYPE = torch.bfloat16  # what `_weight_int4pack_mm_for_cpu` takes with bf16 x

KERNEL_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` needs N % 16 == 0


def kernel_supports(out_features: int, in_features: int) -> bool:
    """Whether the quantized kernels (torch's int4, radixrt's qgemv) can hold a `[out, in]` weight
    in groups of GROUP (both need out % 16 == 0)."""
    return out_features % KERNEL_N_MULTIPLE == 0 and in_features % GROUP == 0


# GGUF block layouts (ggml): bytes per block of 32 weights.
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GGUF_KEPT_TYPES: tuple[str, ...] = tuple(_GGUF_BLOCK_BYTES)


@dataclass(frozen=True)
class GGUFQuantTensor:
    """One GGUF tensor kept in its block encoding: `raw` is uint8 `[rows, blocks * block_bytes]`
    (row n = output feature n, blocks along the input features), logical shape `[rows, cols]`.
    Row operations (llama.cpp's RoPE permutation of q/k) act on `raw` rows exactly."""

    qtype: str  # Q4_0 | Q4_1 | Q8_0
    raw: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype not in _GGUF_BLOCK_BYTES:
            raise ValueError(f"unsupported GGUF block type {self.qtype!r}")
        rows, cols = self.shape
        want = (rows, cols // GROUP * _GGUF_BLOCK_BYTES[self.qtype])
        if cols % GROUP or tuple(self.raw.shape) != want or self.raw.dtype != np.uint8:
            raise ValueError(f"{self.qtype} data of shape {self.raw.shape} "
                             f"({self.raw.dtype}) does not hold a {self.shape} tensor")

    def take_rows(self, order: np.ndarray) -> GGUFQuantTensor:
        """The tensor with rows `order` (a permutation of output features)."""
        return GGUFQuantTensor(self.qtype, np.ascontiguousarray(self.raw[order]), self.shape)

    def _blocks(self) -> tuple[torch.Tensor, np.ndarray]:
        """(fp16 scale `d` as float32 [rows, blocks], block bytes after `d` [rows, blocks, -1])."""
        rows, cols = self.shape
        blk = self.raw.reshape(rows, cols // GROUP, _GGUF_BLOCK_BYTES[self.qtype])
        d = np.ascontiguousarray(blk[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
        return torch.from_numpy(d), blk[:, :, 2:]

    def to_groups(self) -> Int4Groups:
        """The exact `Int4Groups` form (before bf16 rounding of scales and zeros)."""
        rows, cols = self.shape
        d, rest = self._blocks()
        if self.qtype == "Q8_0":
            q8 = torch.from_numpy(np.ascontiguousarray(rest).view(np.int8)).reshape(rows, cols)
            return _planes_from_int8(q8, d)
        if self.qtype == "Q4_1":
            m = torch.from_numpy(
                np.ascontiguousarray(rest[:, :, :2]).view(np.float16)[..., 0].astype(np.float32))
            nib = rest[:, :, 2:]
            zero = m + 8 * d
        else:
            nib = rest
            zero = torch.zeros_like(d)
        # ggml nibble order: byte j of a block holds element j (low) and element j + 16 (high).
        nib_t = torch.from_numpy(np.ascontiguousarray(nib))
        q = torch.cat([nib_t & 0xF, nib_t >> 4], dim=-1).reshape(rows, cols)
        return Int4Groups(q[None], d[None], zero[None])

    def dequantize(self) -> torch.Tensor:
        """float32 `[rows, cols]`, as `gguf.quants.dequantize` computes it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.raw, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(self.shape).copy())


@dataclass(frozen=True)
class Int4Groups:
    """`planes` (1 = 4-bit, 2 = 8-bit) of 4-bit codes with per-group scales and zeros; see the
    module docstring for the formula. q: uint8 `[P, N, K]` in 0..15; scale, zero: float32
    `[P, N, K / GROUP]`."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def __post_init__(self) -> None:
        p, n, k = self.q.shape
        if p not in (1, 2) or k % GROUP or self.scale.shape != (p, n, k // GROUP) or (
                self.zero.shape != self.scale.shape):
            raise ValueError(f"inconsistent Int4Groups: q {tuple(self.q.shape)}, scale "
                             f"{tuple(self.scale.shape)}, zero {tuple(self.zero.shape)}")

    @property
    def planes(self) -> int:
        return int(self.q.shape[0])

    @property
    def bits(self) -> int:
        return 4 * self.planes

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[1]), int(self.q.shape[2])

    def dequantize(self, scale_dtype: torch.dtype | None = KERNEL_SCALE_DTYPE) -> torch.Tensor:
        """float32 `[N, K]`, scales and zeros first rounded to `scale_dtype` (the kernel's; None
        keeps them exact). Each term is exact in float32, so this is the kernel's weight."""
        s, z = self.scale, self.zero
        if scale_dtype is not None:
            s, z = s.to(scale_dtype).float(), z.to(scale_dtype).float()
        p, n, k = self.q.shape
        w = self.q.view(p, n, k // GROUP, GROUP).float().sub_(8).mul_(s[..., None])
        w.add_(z[..., None])
        return (w[0] if p == 1 else w.sum(0)).reshape(n, k)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed weight for `_weight_int4pack_mm_for_cpu`, `scales_and_zeros` bf16
        `[P*K/GROUP, N, 2]`); the planes are laid side by side along K (the input is `[x] * P`)."""
        p, n, k = self.q.shape
        codes = self.q.permute(1, 0, 2).reshape(n, p * k).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        s = self.scale.permute(1, 0, 2).reshape(n, -1).t()
        z = self.zero.permute(1, 0, 2).reshape(n, -1).t()
        return packed, torch.stack([s, z], -1).to(KERNEL_SCALE_DTYPE).contiguous()

    @staticmethod
    def cat(parts: Sequence[Int4Groups]) -> Int4Groups:
        """Row-wise concatenation (fused projections); every part must have the same planes."""
        if len({g.planes for g in parts}) != 1:
            raise ValueError("cannot concatenate 4-bit and 8-bit groups")
        return Int4Groups(torch.cat([g.q for g in parts], 1), torch.cat([g.scale for g in parts], 1),
                          torch.cat([g.zero for g in parts], 1))


def _planes_from_int8(q8: torch.Tensor, d: torch.Tensor) -> Int4Groups:
    """Two planes for `w = d * q8` (q8 int8 `[N, K]`, d `[N, K / GROUP]`): exact."""
    q = q8.to(torch.int16)
    hi = torch.div(q, 16, rounding_mode="floor")  # -8..7
    lo = q - 16 * hi  # 0..15
    codes = torch.stack([hi + 8, lo]).to(torch.uint8)
    scale = torch.stack([16 * d, d])
    zero = torch.stack([torch.zeros_like(d), 8 * d])
    return Int4Groups(codes, scale, zero)


def quantize_int4(w: torch.Tensor) -> Int4Groups:
    """Round-to-nearest asymmetric 4-bit per group of 32 (Q4_1's scheme): per group, scale =
    (max - min) / 15, codes = round((w - min) / scale); the group's min and max are kept to
    the precision of the scale."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(1, n, k), scale[None], (lo + 8 * scale)[None])


def quantize_int8(w: torch.Tensor) -> Int4Groups:
    """Round-to-nearest symmetric 8-bit per group of 32 (Q8_0's scheme): d = absmax / 127."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    d = g.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q8 = (g / safe[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    return _planes_from_int8(q8, d)


QUANTIZATION_MODES: tuple[str, ...] = ("none", "gguf", "int8", "int4")


EVERY_CALL = 1 << 62
"""A `QuantPlan` max rows meaning every call of that width runs on the kernel: its weights keep no
dense copy (the probe found the kernel faster than dense up to its largest, prefill-sized,
row count)."""


@dataclass(frozen=True)
class QuantPlan:
    """How the model stores its matmul weights (resolved from `ServerArgs.quantization`).

    mode: `none` (dense, model dtype) | `gguf` (keep a GGUF file's Q4_0/Q4_1 as 4-bit and Q8_0
    as 8-bit groups, exactly; other tensors dense) | `int8` / `int4` (every matmul weight as
    8-bit / 4-bit groups: GGUF blocks of that width kept exactly, the rest quantized at load;
    `int4` keeps the LM head at 8 bits: a 4-bit head alone raised SmolLM2's mean KL to the fp32
    logits from 0.003 to 0.08, see bench/accuracy.py).
    `max_rows_int4` / `max_rows_int8`: the largest call (rows) run on the quantized kernel when
    `dense_copy` keeps a dense copy for larger ones; `EVERY_CALL` keeps none for that width.
    `kernel`: "auto" | "radixrt" | "vnni" | "vnni-hilo" | "torch", the quantized matmul kernel (see
    `quant_matmul.resolve_quant_kernel`). `max_rows_head`: the quantized LM head's own crossover
    where it was measured on the loaded head (`crossover_tuning.tune_head_crossover`; it drops
    its dense copy when that is `EVERY_CALL`), None where the head follows its width's.
    `time_head`: that measurement will run, so a quantized LM head keeps a dense copy at load
    whatever its width's crossover (`keeps_head_dense`): whether it keeps one afterwards is then
    the head's own timing's call, not the probe's margin for its width."""

    mode: str = "none"
    max_rows_int4: int = 0
    max_rows_int8: int = 0
    dense_copy: bool = True
    kernel: str = "auto"
    max_rows_head: int | None = None
    time_head: bool = False

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {self.mode!r}")

    @property
    def quantized(self) -> bool:
        return self.mode != "none"

    def max_rows(self, bits: int) -> int:
        return self.max_rows_int4 if bits == 4 else self.max_rows_int8

    def keeps_dense(self, bits: int) -> bool:
        """Whether a `bits`-bit weight keeps a dense copy (for calls above `max_rows(bits)`)."""
        return self.dense_copy and self.max_rows(bits) < EVERY_CALL

    def keeps_head_dense(self, bits: int) -> bool:
        """Whether a quantized LM head of `bits` bits keeps a dense copy at load: as its width
        (`keeps_dense`), and always with `time_head` (unless `dense_copy` is off)."""
        return self.keeps_dense(bits) or (self.dense_copy and self.time_head)

    def capped(self, rows: int) -> QuantPlan:
        """This plan with each width that keeps a dense copy on its kernel up to at most `rows`
        rows (crossover_tuning.py); a width without one stays `EVERY_CALL`."""
        def cap(bits: int) -> int:
            n = self.max_rows(bits)
            return min(n, rows) if self.keeps_dense(bits) else n

        return replace(self, max_rows_int4=cap(4), max_rows_int8=cap(8))

    def bits_for(self, pieces: Sequence[torch.Tensor | GGUFQuantTensor],
                 lm_head: bool = False) -> int | None:
        """Bits of the quantized form of one (possibly fused) weight made of `pieces`; None
        keeps it dense."""
        if self.mode == "int4":
            return 8 if lm_head else 4
        if self.mode == "int8":
            return 8
        if self.mode == "gguf" and all(isinstance(p, GGUFQuantTensor) for p in pieces):
            kinds = {p.qtype for p in pieces}  # type: ignore[union-attr]
            return 4 if kinds <= {"Q4_0", "Q4_1"} else 8
        return None

    def no_dense_matmul(self, gguf_types: frozenset[str] | None) -> bool:
        """Whether every call of every matmul runs on the int8-activation vnni kernel, so none
        runs in the model dtype: a vnni plan whose weights keep no dense copy (neither width,
        `keeps_dense`) and whose mode quantizes every weight (`gguf` only when all of the file's
        2-D tensors, `gguf_types`, are kept types; None: not a GGUF file). Never `vnni-hilo`:
        its activations are meant to reach it unrounded, so the model dtype still matters."""
        if (not self.quantized or self.kernel != "vnni"
                or self.keeps_dense(4) or self.keeps_dense(8)):
            return False
        return self.mode != "gguf" or (gguf_types is not None
                                       and gguf_types <= set(GGUF_KEPT_TYPES))

    def describe(self) -> str:
        return f"{self.mode} ({self.kernel} kernel, {self.rows_text()})" if self.quantized else "none"

    def rows_text(self) -> str:
        """Which calls run on the kernel, per width."""
        if not (self.keeps_dense(4) or self.keeps_dense(8)):
            return "kernels for every call"

        def rows(n: int) -> str:
            return "every call" if n >= EVERY_CALL else f"up to {n} rows"

        head = "" if self.max_rows_head is None else f", LM head {rows(self.max_rows_head)}"
        return (f"kernels {rows(self.max_rows(4))} (4-bit) / {rows(self.max_rows(8))} (8-bit)"
                f"{head}, dense copy above")


def to_groups(piece: torch.Tensor | GGUFQuantTensor, bits: int) -> Int4Groups:
    """`piece` as `bits`-bit groups: a GGUF block tensor of that width exactly, anything else
    quantized (round to nearest) from its float32 values."""
    if isinstance(piece, GGUFQuantTensor):
        if (bits == 4 and piece.qtype in ("Q4_0", "Q4_1")) or (bits == 8 and piece.qtype == "Q8_0"):
            return piece.to_groups()
        piece = piece.dequantize()
    return quantize_int4(piece) if bits == 4 else quantize_int8(piece)
