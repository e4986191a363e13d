"""Quantized matmul kernels: the `QuantMatmul` seam and its three CPU implementations, all built
from an `Int4Groups` weight and computing `x @ W.T` for `x [M, in]` in x's dtype.

- `TiledQuantMatmul` ("radixrt"): radixrt's C++ kernel `torch.ops.radixrt.qgemv`
  (radixrt/attention/csrc/qgemv.cpp) on a tiled layout made once at load time (`pack_tiles`):
  4-bit codes, or 8-bit codes (two planes merged back into one int8), with an fp32 scale and
  offset per group of 32, so GGUF Q4_0 / Q4_1 / Q8_0 blocks are kept exactly (up to one fp32
  rounding of a Q4_1 group's offset). Activations are bf16 on AVX512-BF16 CPUs (products and
  sums fp32) and fp32 elsewhere.
- `TorchInt4Matmul` ("torch"): torch's `_weight_int4pack_mm_for_cpu` (bf16 activations, scales
  and zeros rounded to bf16; 8-bit weights run as two 4-bit planes over `[x, x]`). The fallback
  where radixrt's kernel library does not build.

- `VnniQuantMatmul` ("vnni"): radixrt's C++ kernel `torch.ops.radixrt.qgemm_vnni`
  (radixrt/attention/csrc/qgemm_vnni.cpp) on AVX512-VNNI or AVX2 CPUs: activations quantized to
  int8 per row and group of 32, integer dot products (vpdpbusd; vpmaddubsw on AVX2) against the
  exact weight codes, for every row count (decode and prefill), on a layout made once at load time (`pack_vnni`).
  "vnni-hilo" is the same kernel with two int8 terms per activation (the high one and the
  residual it leaves): near-fp32 activations for twice the integer work.

`make_quant_matmul(groups, kernel)` picks one: `kernel` is "auto" (radixrt when its library
loads, else torch; the start-up probe may pick vnni instead, see `quant_kernel_candidates`),
"radixrt", "vnni", "vnni-hilo" or "torch".
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from radixrt.config import QUANT_KERNELS, VNNI_TERMS
from radixrt.model.quant import GROUP, KERNEL_SCALE_DTYPE, Int4Groups

TILE = 16  # output features per tile of the radixrt layout


class QuantMatmul(nn.Module, ABC):
    """`forward(x [M, in_features]) -> [M, out_features]` in x's dtype, on a quantized weight."""

    name: str
    bits: int
    out_features: int
    in_features: int

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` in float32 (LM heads); kernels that accumulate in fp32 override it to
        return the sums before their rounding to x's dtype."""
        return self(x).float()

    def forward_f32_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_f32(x)` and, where the kernel picks them as it writes its outputs, each
        row's argmax (int64 `[M]`, `sampler.row_argmax`'s index); else None in its place."""
        return self.forward_f32(x), None

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the packed weight holds (what one call reads)."""

    @property
    @abstractmethod
    def scale_dtype(self) -> torch.dtype | None:
        """The rounding applied to scales and zeros (`Int4Groups.dequantize(scale_dtype)` is
        this kernel's weight; None: exact)."""


class TorchInt4Matmul(QuantMatmul):
    """torch's weight-only int4 CPU kernel; see the module docstring."""

    name = "torch"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, planes: int):
        """`packed` / `scales_and_zeros` as `Int4Groups.pack` returns them."""
        super().__init__()
        self.out_features = int(scales_and_zeros.shape[1])
        self.in_features = int(scales_and_zeros.shape[0]) * GROUP // planes
        self.planes = planes
        self.bits = 4 * planes
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @classmethod
    def from_groups(cls, groups: Int4Groups) -> TorchInt4Matmul:
        packed, sz = groups.pack()
        return cls(packed, sz, groups.planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        if self.planes > 1:
            xb = torch.cat([xb] * self.planes, dim=1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP,
                                                          self.scales_and_zeros).to(x.dtype)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_and_zeros.numel() * 2

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return KERNEL_SCALE_DTYPE


def merged_codes(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, offset) with `W = scale * codes + offset` per group, exactly `groups`'
    weight up to one fp32 rounding of the offset: one plane -> codes uint8 0..15; two planes
    (scale of plane 0 = 16 x plane 1's, as every 8-bit constructor makes them) -> codes int8
    `16 * (hi - 8) + lo`. scale / offset float32 `[N, K / GROUP]`."""
    s, z = groups.scale.float(), groups.zero.float()
    if groups.planes == 1:
        return groups.q[0], s[0], z[0] - 8 * s[0]
    if not torch.equal(s[0], 16 * s[1]):
        raise ValueError("8-bit Int4Groups need plane 0's scale to be 16x plane 1's")
    q8 = 16 * (groups.q[0].to(torch.int16) - 8) + groups.q[1].to(torch.int16)
    return q8.to(torch.int8), s[1], z[0] + z[1] - 8 * s[1]


def _tile_codes(groups: Int4Groups, kernel: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """`merged_codes` of a weight a tiled kernel can take, with (tiles, groups): raises
    ValueError naming `kernel` unless N % 16 == 0 and K % 32 == 0."""
    n, k = groups.shape
    if n % TILE or k % GROUP:
        raise ValueError(f"the {kernel} quantized kernel needs out_features % {TILE} == 0 and "
                         f"in_features % {GROUP} == 0, got a [{n}, {k}] weight")
    q, scale, offset = merged_codes(groups)
    return q, scale, offset, n // TILE, k // GROUP


def _lane_scales(scale: torch.Tensor, offset: torch.Tensor, nt: int, g: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K/32]` scale and offset as `[N/16, K/32, 16]` (lanes last), float16 when that holds
    every value of both exactly (GGUF blocks), else float32."""

    def lanes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(nt, TILE, g).permute(0, 2, 1).contiguous()

    scale, offset = lanes(scale), lanes(offset)
    half_s, half_o = scale.half(), offset.half()
    if torch.equal(half_s.float(), scale) and torch.equal(half_o.float(), offset):
        return half_s, half_o
    return scale, offset


def pack_tiles(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 `[N/16, K/32, 64 * bits]`, scale, offset `[N/16, K/32, 16]`) in qgemv.cpp's
    layout; scale and offset are float16 when that holds every value exactly (GGUF blocks),
    else float32. Raises ValueError unless N % 16 == 0 and K % 32 == 0."""
    q, scale, offset, nt, g = _tile_codes(groups, "radixrt")
    # [t, n, g, j, h] -> [t, g, j, n, h]: pair j of group g, lane n, element h (k = 32g + 2j + h)
    q = q.reshape(nt, TILE, g, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    if groups.planes == 1:
        codes = (q[..., 0] | (q[..., 1] << 4)).to(torch.uint8)
    else:
        codes = q.contiguous().view(torch.uint8)
    codes = codes.reshape(nt, g, -1).contiguous()
    return (codes, *_lane_scales(scale, offset, nt, g))


def unpack_tiles(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """float32 `[N, K]` weight of a tiled layout (the torch reference of qgemv.cpp)."""
    nt, g, _ = codes.shape
    if bits == 4:
        q = torch.stack([codes & 0xF, codes >> 4], -1).float()  # [t, g, j*16 + n, h]
    else:
        q = codes.view(torch.int8).float()  # [t, g, j*32 + 2n + h]
    q = q.reshape(nt, g, GROUP // 2, TILE, 2)  # [t, g, j, n, h]
    w = q * scale.float()[:, :, None, :, None] + offset.float()[:, :, None, :, None]
    return w.permute(0, 3, 1, 2, 4).reshape(nt * TILE, g * GROUP)


class TiledQuantMatmul(QuantMatmul):
    """radixrt's C++ kernel on the tiled layout; see the module docstring."""

    name = "radixrt"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 bits: int):
        """Arguments as `pack_tiles` returns them (`bits` 4 or 8)."""
        super().__init__()
        self.bits = bits
        self.out_features = int(codes.shape[0]) * TILE
        self.in_features = int(codes.shape[1]) * GROUP
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)

    @classmethod
    def from_groups(cls, groups: Int4Groups) -> TiledQuantMatmul:
        return cls(*pack_tiles(groups), groups.bits)

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} input features, the weight "
                             f"{self.in_features}")
        return x.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixrt.qgemv(self._checked(x), self.codes, self.scale, self.offset,
                                       self.bits)

    def forward_f32_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_f32` and each row's argmax, picked by every chunk of tiles over the outputs
        it has just written (`qgemv_argmax`; in x's dtype, whose float32 is exact)."""
        y, ids = torch.ops.radixrt.qgemv_argmax(self._checked(x), self.codes, self.scale,
                                                self.offset, self.bits)
        return y.float(), ids

    def dequantize(self) -> torch.Tensor:
        return unpack_tiles(self.codes, self.scale, self.offset, self.bits)

    def nbytes(self) -> int:
        return (self.codes.numel() + self.scale.numel() * self.scale.element_size()
                + self.offset.numel() * self.offset.element_size())

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return None


VNNI_CODE_BYTES = {4: 256, 8: 512}  # codes per (tile, group) blob of the vnni layout


def pack_vnni(groups: Int4Groups) -> torch.Tensor:
    """uint8 `[N/16, K/32, B]` in qgemm_vnni.cpp's layout: per (tile, group) the unsigned codes
    (4-bit: `u = q` 0..15; 8-bit: `u = q8 + 128`), then the scale d and offset c of
    `W = d * u + c` for the 16 lanes: float16 when that holds every value exactly (GGUF
    blocks), else float32. A *symmetric* weight (`c = -2^(bits-1) d` in every group, i.e. GGUF
    Q4_0 and Q8_0) with float16-exact scales stores d alone (B = 64 * bits + 32); the kernel then
    folds the offset into its integer dot products. Raises ValueError unless N % 16 == 0 and
    K % 32 == 0."""
    q, scale, offset, nt, g = _tile_codes(groups, "vnni")
    if groups.planes == 1:
        # [t, n, g, v, h, b] -> [t, g, v, n, b, h]: vector v, lane n, byte b; h = nibble
        u = q.reshape(nt, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        codes = (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
    else:
        u = (q.to(torch.int16) + 128).to(torch.uint8)
        offset = offset - 128 * scale  # exact for GGUF Q8_0 (offset 0, scale fp16)
        codes = u.reshape(nt, TILE, g, 8, 4).permute(0, 2, 3, 1, 4)
    codes = codes.reshape(nt, g, -1)
    symmetric = torch.equal(offset, -(2.0 ** (groups.bits - 1)) * scale)
    scale, offset = _lane_scales(scale, offset, nt, g)
    if symmetric and scale.dtype == torch.float16:
        sc = scale.contiguous().view(torch.uint8)
    else:
        sc = torch.cat([scale, offset], -1).contiguous().view(torch.uint8)
    return torch.cat([codes, sc], -1).contiguous()


def vnni_symmetric(packed: torch.Tensor, bits: int) -> bool:
    """Whether a `pack_vnni` layout holds a symmetric weight (scales only, see `pack_vnni`)."""
    return int(packed.shape[2]) == VNNI_CODE_BYTES[bits] + 2 * TILE


def unpack_vnni(packed: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """(u float32 `[N, K]`, d, c float32 `[N, K / 32]`) of a vnni layout: `W = d * u + c`."""
    nt, g, blob = packed.shape
    cb = VNNI_CODE_BYTES[bits]
    codes, sc = packed[..., :cb], packed[..., cb:].contiguous()
    if vnni_symmetric(packed, bits):
        d = sc.view(torch.float16).float().reshape(nt, g, 1, TILE)
        sc = torch.cat([d, -(2.0 ** (bits - 1)) * d], 2)
    else:
        sdt = torch.float16 if blob - cb == 64 else torch.float32
        sc = sc.view(sdt).float().reshape(nt, g, 2, TILE)
    if bits == 4:
        c = codes.reshape(nt, g, 4, TILE, 4)  # [t, g, v, n, b]
        u = torch.stack([c & 0xF, c >> 4], -2)  # [t, g, v, n, h, b]
        u = u.permute(0, 3, 1, 2, 4, 5)
    else:
        u = codes.reshape(nt, g, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    u = u.reshape(nt * TILE, g * GROUP).float()

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1).reshape(nt * TILE, g)

    return u, rows(sc[:, :, 0]), rows(sc[:, :, 1])


def vnni_terms(kernel: str) -> int:
    """int8 terms per activation of kernel name `kernel` ("vnni" 1, "vnni-hilo" 2), 0 for a
    kernel that is not the int8-activation one."""
    return VNNI_TERMS.get(kernel, 0)


class VnniQuantMatmul(QuantMatmul):
    """radixrt's int8-activation VNNI kernel `torch.ops.radixrt.qgemm_vnni`
    (radixrt/attention/csrc/qgemm_vnni.cpp) on the `pack_vnni` layout: each activation row is
    quantized per group of 32 to int8 (absmax / 127, round to nearest even) and dotted with the
    unsigned weight codes by vpdpbusd; weights (GGUF scales) are exact, so the result is the
    exact-weight matmul of the int8-rounded activations (relative error per group <= 1/254 of
    its absmax), summed in fp32. AVX512-VNNI or AVX2 CPUs (the same bits on both); every row
    count. With `terms` 2 ("vnni-hilo") each activation is two int8 terms, the high one as
    above and the residual it leaves, quantized alike with its own scale (relative error per
    group <= 1/64516 of its absmax): two rows of integer work per row, one weight read."""

    def __init__(self, packed: torch.Tensor, bits: int, terms: int = 1):
        """`packed` as `pack_vnni` returns it (`bits` 4 or 8); `terms` 1 or 2."""
        super().__init__()
        if terms not in (1, 2):
            raise ValueError(f"VnniQuantMatmul: terms must be 1 or 2, got {terms}")
        self.bits = bits
        self.terms = terms
        self.name = "vnni" if terms == 1 else "vnni-hilo"
        self.out_features = int(packed.shape[0]) * TILE
        self.in_features = int(packed.shape[1]) * GROUP
        self.register_buffer("packed", packed)

    @classmethod
    def from_groups(cls, groups: Int4Groups, terms: int = 1) -> VnniQuantMatmul:
        return cls(pack_vnni(groups), groups.bits, terms)

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} input features, the weight "
                             f"{self.in_features}")
        return x.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixrt.qgemm_vnni(self._checked(x), self.packed, self.bits, self.terms)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 sums `forward` rounds to x's dtype (bitwise: `forward(x)` is this rounded)."""
        return torch.ops.radixrt.qgemm_vnni_f32(self._checked(x), self.packed, self.bits,
                                                self.terms)

    def forward_f32_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_f32` and each row's argmax, picked by every thread over the outputs it has
        just written (`qgemm_vnni_f32_argmax`), so the logits are not read again."""
        y, ids = torch.ops.radixrt.qgemm_vnni_f32_argmax(self._checked(x), self.packed,
                                                          self.bits, self.terms)
        return y, ids

    def dequantize(self) -> torch.Tensor:
        u, d, c = unpack_vnni(self.packed, self.bits)
        n, k = u.shape
        w = u.reshape(n, k // GROUP, GROUP) * d[..., None] + c[..., None]
        return w.reshape(n, k)

    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return None


def radixrt_kernel_available() -> bool:
    """Whether `torch.ops.radixrt.qgemv` is usable here (builds the kernel library if needed)."""
    from radixrt.attention.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels() and hasattr(torch.ops.radixrt, "qgemv")


def vnni_kernel_available() -> bool:
    """Whether `torch.ops.radixrt.qgemm_vnni` is usable here: the library loads and was built
    with AVX512-VNNI or AVX2 (`qgemm_vnni_isa()`; a generic build's op exists but refuses)."""
    return (radixrt_kernel_available() and hasattr(torch.ops.radixrt, "qgemm_vnni_isa")
            and torch.ops.radixrt.qgemm_vnni_isa() != "none")


def resolve_quant_kernel(kernel: str) -> str:
    """One kernel for `ServerArgs.quant_kernel` = `kernel` without timing anything: "auto" ->
    "radixrt" where its library loads, else "torch" (the probe may still pick "vnni", see
    `quant_kernel_candidates`). Raises ValueError naming the field for an unknown name, or an
    explicit kernel that is unavailable here."""
    if kernel not in QUANT_KERNELS:
        raise ValueError(f"ServerArgs.quant_kernel: must be one of {QUANT_KERNELS}, got "
                         f"{kernel!r}")
    if kernel == "torch":
        return "torch"
    if vnni_terms(kernel):
        if vnni_kernel_available():
            return kernel
        from radixrt.attention.cpu_kernels import unavailable_reason

        why = unavailable_reason() or "the library was built without AVX2 or AVX512-VNNI"
        raise ValueError(f"ServerArgs.quant_kernel: {kernel!r} needs radixrt's CPU kernel "
                         f"library built for an AVX2 or AVX512-VNNI CPU ({why})")
    if radixrt_kernel_available():
        return "radixrt"
    if kernel == "radixrt":
        from radixrt.attention.cpu_kernels import unavailable_reason

        raise ValueError("ServerArgs.quant_kernel: 'radixrt' needs radixrt's CPU kernel library, "
                         f"which is unavailable ({unavailable_reason()})")
    return "torch"


def quant_kernel_candidates(kernel: str) -> tuple[str, ...]:
    """The kernels the start-up probe times for `kernel`: "auto" -> ("vnni", "radixrt") where
    vnni is built, else `resolve_quant_kernel("auto")` alone; an explicit kernel -> itself."""
    if kernel == "auto" and vnni_kernel_available():
        return ("vnni", resolve_quant_kernel("auto"))
    return (resolve_quant_kernel(kernel),)


def make_quant_matmul(groups: Int4Groups, kernel: str = "auto") -> QuantMatmul:
    """`groups` packed for `kernel` (see `resolve_quant_kernel`)."""
    resolved = resolve_quant_kernel(kernel)
    if vnni_terms(resolved):
        return VnniQuantMatmul.from_groups(groups, vnni_terms(resolved))
    if resolved == "radixrt":
        return TiledQuantMatmul.from_groups(groups)
    return TorchInt4Matmul.from_groups(groups)
