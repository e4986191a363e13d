"""The fused C++ layer ops (`torch.ops.radixrt.rms_norm` / `add_rms_norm` / `silu_mul` /
`rope_qk` / `kv_store`, `model/layer_ops.py`) against the torch ops they replace.

Bitwise in every dtype where the kernel library is built for torch's own dispatch ISA (the
fused ops reproduce each rounding of the torch path); elsewhere fp32 must still be bitwise for
the model to use them (`select_layer_ops` checks), bf16 / fp16 within one rounding unit. Shapes
cover odd widths (scalar tails), one row, and enough rows to run on several threads; RoPE caches
of every scaling variant. Then: bad input, thread-count invariance, the selection rules, a tiny
model run with fused vs torch ops (identical logits, fp32 and bf16), and the lower ISAs built in
a subprocess.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from kernel_isa import run_isa_check
from model_fixtures import PagedRunner, make_tiny_checkpoint

from radixrt.attention import cpu_kernels
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.model.layer_ops import (
    FusedCpuLayerOps,
    TorchLayerOps,
    _self_check,
    fused_unavailable_reason,
    select_layer_ops,
)
from radixrt.model.model_config import RopeParams
from radixrt.model.rope import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FUSED, REF = FusedCpuLayerOps(), TorchLayerOps()


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _native_isa() -> bool:
    """The library is built for the ISA torch dispatches its own kernels to."""
    return torch.ops.radixrt.fused_ops_isa() == torch.backends.cpu.get_cpu_capability()


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.dtype == torch.float32 or _native_isa():
        assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max()}"
    else:  # one rounding unit of the dtype, relative to the value
        eps = torch.finfo(a.dtype).eps
        rel = (a.float() - b.float()).abs() / (b.float().abs() + 1e-3)
        assert float(rel.max()) <= eps, what


def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 72, 100, 576, 4096, 4100])
def test_norms_match_torch(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + hidden)
    x, r = _rand(g, rows, hidden, dtype=dtype, scale=3.0), _rand(g, rows, hidden, dtype=dtype)
    w = _rand(g, hidden, dtype=dtype)
    _assert_same(FUSED.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), "rms_norm")
    out, s = FUSED.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_s = REF.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, ref_s)  # one rounded add
    _assert_same(out, ref_out, "add_rms_norm")
    # in place: the sum into the residual, the norm into x, the same bits as the fresh outputs
    xi, ri = x.clone(), r.clone()
    got_x, got_r = FUSED.add_rms_norm_(xi, ri, w, 1e-6)
    assert got_x is xi and got_r is ri
    assert torch.equal(ri, s) and torch.equal(xi, out)
    xt, rt = x.clone(), r.clone()
    REF.add_rms_norm_(xt, rt, w, 1e-6)
    assert torch.equal(rt, ref_s) and torch.equal(xt, ref_out)
    # strided rows (a row slice of a wider tensor) read the same
    wide = _rand(g, rows, hidden + 8, dtype=dtype)
    _assert_same(FUSED.rms_norm(wide[:, :hidden], w, 1e-5),
                 REF.rms_norm(wide[:, :hidden], w, 1e-5), "strided rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 9, 200])
@pytest.mark.parametrize("inter", [37, 128, 1536])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    gu = _rand(g, rows, 2 * inter, dtype=dtype, scale=4.0)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow / underflow, zeros
    _assert_same(FUSED.silu_mul(gu), REF.silu_mul(gu), "silu_mul")


def test_silu_mul_every_bf16_gate_is_torchs() -> None:
    """silu_mul on bf16 takes silu(gate) from a table of every bf16 input (AVX-512 builds),
    built by the vector arithmetic it replaces: every one of the 65536 gate bit patterns
    (denormals, infinities, NaNs included), times up = 1 and times random up, is torch's."""
    if not _native_isa():
        pytest.skip("the library is not built for torch's own instruction set")
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate.reshape(64, 1024)  # 1024 columns: every element on the vector path
    for up in (torch.ones(64, 1024), torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))):
        gu = torch.cat([gate, up.to(torch.bfloat16)], dim=1)
        assert _bits_equal(FUSED.silu_mul(gu), REF.silu_mul(gu))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (-0.0 is not 0.0; denormals exactly), NaN where the other has NaN."""
    nan = a.isnan()
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(nan, b.isnan())
            and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]))


def test_bf16_rounding_of_denormals_and_nans_is_torchs() -> None:
    """Rounding to bfloat16 takes the one-instruction conversion where it agrees with torch's
    software one; vectors with denormals (which the instruction reads as zero) or NaNs take
    the software path: every op stays bitwise torch's on denormals, NaN where torch's is."""
    if not _native_isa():
        pytest.skip("the library is not built for torch's own instruction set")
    bf = torch.bfloat16
    tiny = torch.tensor([1e-38, -3e-39, 1e-39, 2e-38, -1e-40, 5e-39, 1.5e-38, -7e-39])
    gu = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    gu[0, :8] = tiny  # silu(gate) denormal
    gu[1, 32:40] = tiny  # up denormal: the products are
    gu[2, 3] = float("nan")
    gu = gu.to(bf)
    assert _bits_equal(FUSED.silu_mul(gu), REF.silu_mul(gu))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    r = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    x[0, :8], r[0, :8] = tiny, tiny  # denormal sums in the residual stream
    x[1, 5] = float("nan")
    x, r, w = x.to(bf), r.to(bf), torch.ones(64, dtype=bf)
    out, res = FUSED.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = REF.add_rms_norm(x, r, w, 1e-6)
    assert _bits_equal(res, ref_res) and _bits_equal(out, ref_out)
    emb = RotaryEmbedding(64, 64, RopeParams(), dtype=bf)
    cos, sin = emb.cos_sin(torch.arange(4))
    qkv = torch.randn(4, 4 * 64, generator=torch.Generator().manual_seed(8))
    qkv[0, :8] = tiny  # denormal products with cos / sin
    qkv[2, 70] = float("nan")
    qkv = qkv.to(bf)
    for a, b in zip(FUSED.rope_qk(qkv, cos, sin, 2, 1), REF.rope_qk(qkv, cos, sin, 2, 1),
                    strict=True):
        assert _bits_equal(a, b)


ROPES = [RopeParams(),
         RopeParams(rope_type="linear", factor=4.0),
         RopeParams(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64),
         RopeParams(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r.rope_type)
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
def test_rope_matches_torch(dtype: torch.dtype, rope: RopeParams, head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    hq, hkv, n = 6, 2, 150
    emb = RotaryEmbedding(head_dim, 1024, rope, dtype=dtype)
    cos, sin = emb.cos_sin(torch.randint(0, 1024, (n,), generator=g))
    qkv = _rand(g, n, (hq + 2 * hkv) * head_dim, dtype=dtype)
    for a, b, what in zip(FUSED.rope_qk(qkv, cos, sin, hq, hkv),
                          REF.rope_qk(qkv, cos, sin, hq, hkv), ("q", "k"), strict=True):
        _assert_same(a, b, what)


@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_store_writes_strided_rows(dtype: torch.dtype, head_major: bool) -> None:
    g = torch.Generator().manual_seed(0)
    if head_major:  # the CPU pool's layout: [heads, slots, dim] storage seen as [slots, heads]
        kb, vb = (torch.zeros(3, 50, 16, dtype=dtype).transpose(0, 1) for _ in range(2))
    else:
        kb, vb = torch.zeros(50, 3, 16, dtype=dtype), torch.zeros(50, 3, 16, dtype=dtype)
    qkv = _rand(g, 5, 12 * 16, dtype=dtype).view(5, 12, 16)
    k, v = qkv[:, 6:9], qkv[:, 9:]  # views with a token stride of 12 heads
    loc = torch.tensor([7, 1, 49, 20, 3])
    torch.ops.radixrt.kv_store(kb, vb, loc, k, v)
    ref_k, ref_v = torch.zeros_like(kb), torch.zeros_like(vb)
    ref_k.index_copy_(0, loc, k.contiguous())
    ref_v.index_copy_(0, loc, v.contiguous())
    assert torch.equal(kb, ref_k) and torch.equal(vb, ref_v)


def test_bad_input_raises_naming_the_argument() -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.radixrt.rms_norm(x, torch.randn(65), 1e-5)
    with pytest.raises(RuntimeError, match="weight dtype"):
        torch.ops.radixrt.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.radixrt.add_rms_norm(x, torch.randn(3, 64), w, 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.radixrt.add_rms_norm_(x.clone(), torch.randn(3, 64), w, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.radixrt.add_rms_norm_(torch.randn(64, 4).t(), x.clone(), w, 1e-5)
    shared = x.clone()
    with pytest.raises(RuntimeError, match="share memory"):
        torch.ops.radixrt.add_rms_norm_(shared, shared, w, 1e-5)
    assert torch.equal(shared, x)  # refused before anything was written
    with pytest.raises(RuntimeError, match="dtype must be"):
        torch.ops.radixrt.rms_norm(x.double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.radixrt.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="too narrow"):
        torch.ops.radixrt.rope_qk(torch.randn(2, 64), torch.randn(2, 16), torch.randn(2, 16), 4,
                                  1)
    kb = torch.zeros(10, 2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.radixrt.kv_store(kb, kb.clone(), torch.tensor([10]), torch.randn(1, 2, 16),
                                   torch.randn(1, 2, 16))


def test_result_does_not_depend_on_thread_count() -> None:
    g = torch.Generator().manual_seed(3)
    x, r, w = (_rand(g, 600, 576, dtype=torch.bfloat16), _rand(g, 600, 576, dtype=torch.bfloat16),
               _rand(g, 576, dtype=torch.bfloat16))
    gu = _rand(g, 600, 3072, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append((*FUSED.add_rms_norm(x, r, w, 1e-5), FUSED.silu_mul(gu)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_selection_rules() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_layer_ops(torch.float32, cpu, 64, 128, 16, fused=False),
                      TorchLayerOps)
    assert isinstance(select_layer_ops(torch.float32, torch.device("meta"), 64, 128, 16),
                      TorchLayerOps)
    assert "dtype" in (fused_unavailable_reason(torch.float64, cpu, 64, 128, 16) or "")
    with pytest.raises(RuntimeError, match="fused CPU layer ops unavailable"):
        select_layer_ops(torch.float64, cpu, 64, 128, 16, fused=True)
    # Where the kernels serve fp32 they are bitwise identical on the model's shapes.
    if fused_unavailable_reason(torch.float32, cpu, 576, 1536, 64) is None:
        assert _self_check(FUSED, torch.float32, 576, 1536, 64) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_model_fused_ops_give_the_same_logits(tmp_path: Path, dtype: torch.dtype) -> None:
    """A prefill of two requests (one after a cached prefix) and 5 greedy decode steps: fused
    and torch ops give identical logits (the ops are bitwise identical), whichever attention."""
    make_tiny_checkpoint(tmp_path, "llama", seed=5)
    if fused_unavailable_reason(dtype, torch.device("cpu"), 64, 128, 16) is not None:
        pytest.skip("fused ops not used for this dtype here")
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 256, (30,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11)]
    runs = []
    for fused in (True, False):
        runner = PagedRunner.create(tmp_path, dtype=dtype)
        assert isinstance(runner.model.ops, FusedCpuLayerOps)  # the default here
        if not fused:
            runner.model.set_layer_ops(TorchLayerOps())
            backend = runner.model.attn_backend
            assert isinstance(backend, TorchNativeBackend)
            backend._kv_store = False
        first = runner.new_request()
        runner.extend([first], [prefix])
        rows = [runner.share_prefix(first, len(prefix)), runner.new_request()]
        logits = [runner.extend(rows, tails, all_positions=True)]
        for _ in range(5):
            last = logits[-1][-2:] if len(logits) == 1 else logits[-1]
            tok = last.argmax(-1).tolist()
            logits.append(runner.decode(rows, tok))
        runs.append(logits)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


_SUBPROCESS_CHECK = textwrap.dedent("""
    import torch
    from radixrt.attention import cpu_kernels
    from radixrt.model.layer_ops import FusedCpuLayerOps, _self_check
    assert cpu_kernels.load_cpu_kernels(), cpu_kernels.unavailable_reason()
    print(torch.ops.radixrt.fused_ops_isa(), torch.backends.cpu.get_cpu_capability())
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((64, 128, 16), (576, 1536, 64), (100, 37, 40)):
            print(_self_check(FusedCpuLayerOps(), dt, *shape))
""")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_instruction_sets_build_and_agree(isa: str) -> None:
    """The library built for a lower ISA (AVX2-only machines, non-x86), in a fresh process:
    bf16 / fp16 within one rounding unit of torch; fp32 bitwise wherever the build and torch's
    dispatch agree (elsewhere the model falls back to the torch ops, as the self-check says)."""
    lines = run_isa_check(isa, _SUBPROCESS_CHECK, timeout=1200).split("\n")
    ours, torch_isa = lines[0].split()
    assert ours == isa.upper()
    errs = [float(x) for x in lines[1:] if x.strip()]
    assert len(errs) == 9 and max(errs[3:]) <= 1.0
    if ours == torch_isa:
        assert errs[:3] == [0.0, 0.0, 0.0]
