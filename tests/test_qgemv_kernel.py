"""radixrt's quantized small-M matmul (`torch.ops.radixrt.qgemv`, radixrt/attention/csrc/qgemv.cpp)
and its tiled layout (radixrt/model/quant_matmul.py): packing round trip, results against the
float64 matmul of the dequantized weight for 1..64 rows, row-count invariance, bad input, the
AVX2 and generic builds (subprocess), and a quantized tiny model on both kernels.

Tolerances (derived, not fitted): with x exactly representable in bf16 and a float32 output,
every path computes exact weights and products with float32 sums, so |y - ref| <= 1e-5 *
(|x| @ |W|.T). A float32 x that is not bf16-exact is rounded to bf16 on the AVX512-BF16 path
(like torch's int4 kernel): then 2^-8 relative to |x| @ |W|.T, plus the output's own rounding
for a bf16 output.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from kernel_isa import (
    assert_flag_only_with,
    assert_rows_independent,
    run_isa_check,
    with_threads,
)

from radixrt.attention import cpu_kernels
from radixrt.model.quant import Int4Groups, quantize_int4, quantize_int8
from radixrt.model.quant_matmul import (
    TiledQuantMatmul,
    TorchInt4Matmul,
    merged_codes,
    pack_tiles,
    resolve_quant_kernel,
    unpack_tiles,
)

BF16_EPS = 2.0**-8
SUM_EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.load_cpu_kernels() or not hasattr(torch.ops.radixrt, "qgemv"):
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _groups(n: int, k: int, bits: int, seed: int, fp16_scales: bool = False) -> Int4Groups:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    groups = quantize_int4(w) if bits == 4 else quantize_int8(w)
    if fp16_scales:  # as GGUF blocks: d (and Q4_1's m) are fp16
        if bits == 4:
            d = groups.scale.half().float()
            m = (groups.zero - 8 * groups.scale).half().float()
            groups = Int4Groups(groups.q, d, m + 8 * d)
        else:
            d = groups.scale[1].half().float()
            groups = Int4Groups(groups.q, torch.stack([16 * d, d]),
                                torch.stack([torch.zeros_like(d), 8 * d]))
    return groups


# -- layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [False, True])
def test_tiles_hold_the_groups_weight(bits: int, fp16_scales: bool) -> None:
    groups = _groups(48, 96, bits, seed=bits, fp16_scales=fp16_scales)
    codes, scale, offset = pack_tiles(groups)
    assert codes.shape == (3, 3, 64 * bits) and scale.shape == offset.shape == (3, 3, 16)
    assert scale.dtype == (torch.float16 if fp16_scales else torch.float32)
    ref = groups.dequantize(scale_dtype=None)
    got = unpack_tiles(codes, scale, offset, bits)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    q, s, o = merged_codes(groups)
    assert q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    if bits == 8:
        assert torch.equal(o, torch.zeros_like(o))  # symmetric: no offset


def test_pack_rejects_shapes_the_kernel_cannot_tile() -> None:
    with pytest.raises(ValueError, match="out_features % 16"):
        pack_tiles(_groups(40, 64, 4, seed=0))
    bad = _groups(32, 64, 8, seed=0)
    bad = Int4Groups(bad.q, torch.stack([bad.scale[1], bad.scale[1]]), bad.zero)
    with pytest.raises(ValueError, match="16x"):
        pack_tiles(bad)


# -- the op ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 16, 17, 33, 64])
def test_op_matches_float64_reference(bits: int, fp16_scales: bool, rows: int) -> None:
    groups = _groups(16 * 7, 32 * 5, bits, seed=rows, fp16_scales=fp16_scales)
    tm = TiledQuantMatmul.from_groups(groups)
    w = groups.dequantize(scale_dtype=None).double()
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 160, generator=g).bfloat16()
    mag = x.double().abs() @ w.abs().t()
    ref = x.double() @ w.t()
    # bf16-exact x, fp32 out: only fp32 summation error.
    y32 = tm(x.float())
    assert y32.dtype == torch.float32 and y32.shape == (rows, 112)
    assert ((y32.double() - ref).abs() <= SUM_EPS * mag + 1e-12).all()
    # bf16 in, bf16 out: plus the output's rounding.
    y16 = tm(x)
    assert y16.dtype == torch.bfloat16
    assert ((y16.double() - ref).abs() <= SUM_EPS * mag + BF16_EPS * ref.abs() + 1e-12).all()
    # fp32 x that bf16 cannot hold: rounded to bf16 at most.
    xf = torch.randn(rows, 160, generator=g)
    ref = xf.double() @ w.t()
    mag = xf.double().abs() @ w.abs().t()
    assert ((tm(xf).double() - ref).abs() <= BF16_EPS * mag + 1e-12).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_independent_of_the_row_count(bits: int) -> None:
    """Each row is computed by the same arithmetic whatever M (batch invariance), and with any
    thread count."""
    tm = TiledQuantMatmul.from_groups(_groups(16 * 37, 96, bits, seed=7))
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert_rows_independent(tm, x, (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 64))


def test_agrees_with_torch_int4_kernel_on_the_same_groups() -> None:
    """Both kernels hold the same weights (torch's with bf16-rounded scales)."""
    groups = _groups(64, 128, 4, seed=3, fp16_scales=True)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    a = TiledQuantMatmul.from_groups(groups)(x).double()
    b = TorchInt4Matmul.from_groups(groups)(x).double()
    mag = x.double().abs() @ groups.dequantize(None).double().abs().t()
    assert ((a - b).abs() <= 2 * BF16_EPS * mag).all()



@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_argmax_is_the_outputs_argmax(bits: int, dtype: torch.dtype, threads: int) -> None:
    """`qgemv_argmax` (an LM head's greedy step): the outputs are `qgemv`'s bits and the ids
    their argmax, with the tiles split over the threads (200 tiles of K 96: several chunks at
    2 threads); ties across lanes and chunks go to the first column, a NaN column (a NaN
    scale) wins over an earlier maximum, an all-zero row gives 0."""
    n, k, rows = 16 * 200, 96, 6
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    x[2] = 0.0
    best = x[0].sign() * 2.0
    copies = [37, 42, 1700, n - 3]  # lanes 5, 10, 4, 13; the first and the last chunk
    w[copies] = best
    groups = quantize_int4(w) if bits == 4 else quantize_int8(w)
    tm = TiledQuantMatmul.from_groups(groups)
    xd = x.to(dtype)

    def check(m: TiledQuantMatmul) -> torch.Tensor:
        y, ids = with_threads(threads, lambda: m.forward_f32_argmax(xd))
        ref = with_threads(threads, lambda: m(xd)).float()
        assert y.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (rows,)
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))  # bitwise, NaNs too
        assert torch.equal(ids, y.argmax(-1))
        return ids

    ids = check(tm)
    assert ids[0] == copies[0] and ids[2] == 0
    scale = tm.scale.clone()
    for col in (2900, 300):
        scale[col // 16, 0, col % 16] = float("nan")
    ids = check(TiledQuantMatmul(tm.codes, scale, tm.offset, bits))
    assert ids.tolist() == [300] * rows
    y, ids = torch.ops.radixrt.qgemv_argmax(torch.zeros(0, k), tm.codes, tm.scale, tm.offset,
                                            bits)
    assert y.shape == (0, n) and ids.shape == (0,)
    with pytest.raises(RuntimeError, match="qgemv_argmax: x must be"):
        torch.ops.radixrt.qgemv_argmax(torch.zeros(k), tm.codes, tm.scale, tm.offset, bits)


def test_empty_rows_and_bad_input() -> None:
    tm = TiledQuantMatmul.from_groups(_groups(32, 64, 4, seed=0))
    assert tm(torch.zeros(0, 64)).shape == (0, 32)
    with pytest.raises(ValueError, match="input features"):
        tm(torch.zeros(2, 96))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.radixrt.qgemv(torch.zeros(2, 64, dtype=torch.float16), tm.codes, tm.scale,
                                tm.offset, 4)
    with pytest.raises(RuntimeError, match="bits"):
        torch.ops.radixrt.qgemv(torch.zeros(2, 64), tm.codes, tm.scale, tm.offset, 5)
    with pytest.raises(RuntimeError, match="scale / offset"):
        torch.ops.radixrt.qgemv(torch.zeros(2, 64), tm.codes, tm.scale[:, :1].contiguous(),
                                tm.offset, 4)


def test_kernel_choice() -> None:
    assert resolve_quant_kernel("auto") == "radixrt"
    assert resolve_quant_kernel("torch") == "torch"
    with pytest.raises(ValueError, match="ServerArgs.quant_kernel"):
        resolve_quant_kernel("fast")


_SUBPROCESS_CHECK = textwrap.dedent("""
    import torch
    from radixrt.attention import cpu_kernels
    from radixrt.model.quant import quantize_int4, quantize_int8
    from radixrt.model.quant_matmul import TiledQuantMatmul
    assert cpu_kernels.load_cpu_kernels(), cpu_kernels.unavailable_reason()
    print(torch.ops.radixrt.qgemv_isa())
    g = torch.Generator().manual_seed(0)
    for q in (quantize_int4, quantize_int8):
        groups = q(torch.randn(16 * 9, 96, generator=g))
        tm = TiledQuantMatmul.from_groups(groups)
        w = groups.dequantize(None).double()
        for rows in (1, 2, 3, 4, 5, 9, 33):
            x = torch.randn(rows, 96, generator=g).bfloat16().float()
            y = tm(x).double()
            ref = x.double() @ w.t()
            assert ((y - ref).abs() <= 1e-5 * (x.double().abs() @ w.abs().t())).all()
            assert torch.equal(tm(x[:1]), tm(x)[:1])
            lg, ids = tm.forward_f32_argmax(x)
            assert torch.equal(lg, tm(x)) and torch.equal(ids, lg.argmax(-1))
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.parametrize("isa,path", [("avx2", "avx2"), ("default", "generic")])
def test_other_instruction_sets_build_and_agree(isa: str, path: str) -> None:
    """The AVX2 and generic paths, built here and checked in a fresh process (one kernel library
    per process; cached after the first run)."""
    assert run_isa_check(isa, _SUBPROCESS_CHECK).split() == [path, "ok"]


def test_isa_table_adds_bf16_only_when_the_cpu_has_it(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    assert_flag_only_with(monkeypatch, str(tmp_path), "avx512_bf16", "-mavx512bf16")
