"""The int8 KV cache (`kv_cache_dtype=int8`): its number format, the C++ store and decode ops
against torch references, the pool, and a tiny model run end to end on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import PagedRunner, make_tiny_checkpoint, shared_prefix_greedy
from test_paged_decode_kernel import _case as float_case
from test_paged_decode_kernel import _positions, _relocated
from test_paged_decode_kernel import _reference as float_reference

from radixrt.attention import cpu_kernels
from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.config import ServerArgs
from radixrt.mem.kv_quant import dequantize_rows, quantize_rows
from radixrt.mem.memory_pool import TokenToKVPool, kv_bytes_per_token


def _need_i8_kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    reason = paged_decode_i8_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _head_major(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


# -- the number format ----------------------------------------------------------------------------
def test_quantize_rows_error_is_at_most_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 10
    x[7, 1] = 0.0  # a row of zeros
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert codes.shape == x.shape and scale.shape == x.shape[:-1]
    back = dequantize_rows(codes, scale, torch.float32)
    assert bool(((back - x).abs() <= scale.unsqueeze(-1) * 0.5001 + 1e-12).all())
    # every non-zero row uses the full range; the zero row is all zeros with scale 0
    top = codes.abs().amax(-1)
    assert int(top[7, 1]) == 0 and float(scale[7, 1]) == 0.0
    top[7, 1] = 127
    assert bool((top == 127).all())


# -- the C++ ops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hd", [64, 40, 256])
def test_kv_store_i8_writes_torch_codes_and_scales(dtype: torch.dtype, hd: int) -> None:
    """Whole vectors (head dims 64, 256: the AVX-512 path) and a tail (head dim 40, the scalar
    loop), a zero row; strided sources."""
    _need_i8_kernels()
    g = torch.Generator().manual_seed(1)
    pool = TokenToKVPool(40, 2, 3, hd, dtype, kv_dtype=torch.int8)
    qkv = (torch.randn(5, 9 * hd + 2 * 3 * hd, generator=g) * 3).to(dtype)
    qkv[2, 9 * hd: 10 * hd] = 0  # one all-zero K row: scale 0, codes 0
    # strided sources, as the layer hands them over: slices of the fused qkv projection
    k = qkv[:, 9 * hd: 12 * hd].view(5, 3, hd)
    v = qkv[:, 12 * hd:].view(5, 3, hd)
    loc = torch.tensor([3, 17, 1, 40, 22])
    layer = 1
    torch.ops.radixrt.kv_store_i8(pool.k_buffer[layer], pool.v_buffer[layer],
                                  pool.k_scale[layer], pool.v_scale[layer], loc, k, v)
    for buf, sc, x in ((pool.k_buffer, pool.k_scale, k), (pool.v_buffer, pool.v_scale, v)):
        codes, scale = quantize_rows(x)
        assert torch.equal(buf[layer][loc], codes)
        assert torch.equal(sc[layer][loc], scale)
        untouched = torch.ones(41, dtype=torch.bool)
        untouched[loc] = False
        assert bool((sc[layer][untouched] == 0).all())
        assert bool((sc[0] == 0).all())  # other layers untouched
    # kv_read_i8 (the extend op's compact copy) reads back what the torch path reads
    for out_dtype in (torch.float32, torch.bfloat16):
        pool.dtype = out_dtype
        ck, cv = torch.ops.radixrt.kv_read_i8(pool.k_buffer[layer], pool.v_buffer[layer],
                                              pool.k_scale[layer], pool.v_scale[layer],
                                              loc[[4, 0, 0, 2]], out_dtype)
        tk, tv = pool.read_kv(layer, loc[[4, 0, 0, 2]])
        assert ck.dtype == out_dtype and ck.is_contiguous()
        assert torch.equal(ck, tk) and torch.equal(cv, tv)
    with pytest.raises(RuntimeError, match="kv_read_i8: slot 99 out of range"):
        torch.ops.radixrt.kv_read_i8(pool.k_buffer[layer], pool.v_buffer[layer],
                                     pool.k_scale[layer], pool.v_scale[layer],
                                     torch.tensor([99]), torch.float32)
    # set_kv (the torch fallback) stores the same bits
    other = TokenToKVPool(40, 2, 3, hd, dtype, kv_dtype=torch.int8)
    other.set_kv(layer, loc, k, v)
    assert torch.equal(other.k_buffer[layer][loc], pool.k_buffer[layer][loc])
    assert torch.equal(other.v_scale[layer][loc], pool.v_scale[layer][loc])


def _pool_case(seed: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
               own_lens: list[int], groups: list[tuple[int, list[int]]]) -> dict:
    """test_paged_decode_kernel's random pool and plan (rows with `own_lens` own keys; `groups`
    = (shared prefix length, member rows)), its fp32 K/V (an outlier channel added to K, as
    RoPE'd keys have) also stored as an int8 pool laid out head-major, as radixrt's."""
    c = float_case(seed, torch.float32, heads, kv_heads, dim, own_lens, groups)
    c["kb"] = c["kb"] * 2
    c["kb"][..., 1] += 6
    kc, ks = quantize_rows(c["kb"])
    vc, vs = quantize_rows(c["vb"])
    return dict(c, q=c["q"].to(dtype), kc=_head_major(kc), vc=_head_major(vc),
                ks=_head_major(ks), vs=_head_major(vs))


def _run_i8(c: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.radixrt.paged_decode_i8(c["q"], c["kc"], c["vc"], c["ks"], c["vs"],
                                             c["idx"], c["row_start"], c["row_len"],
                                             c["g_start"], c["g_len"], c["g_ptr"], c["g_rows"],
                                             scale)


def _reference(c: dict, scale: float, quantized_q: bool,
               k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each row over its group's prefix then its own keys
    (test_paged_decode_kernel's reference) on the K/V `k`, `v`; `quantized_q`: the queries
    rounded to int8 per (row, head) as the op rounds them."""
    q = c["q"].double()
    if quantized_q:
        codes, qs = quantize_rows(c["q"].float())
        q = codes.double() * qs.double().unsqueeze(-1)
    return float_reference(dict(c, q=q, kb=k, vb=v), scale)


LENS = [1, 2, 15, 16, 17, 33, 64, 300]
CASCADE = [([3, 9, 1, 40], [(40, [0, 1, 2])]),
           ([1 + i % 5 for i in range(40)], [(100, list(range(40)))]),
           ([5, 1, 17, 0, 31], [(1037, [0, 1, 2, 3, 4])])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 16), (6, 3, 80),
                                                (2, 1, 256)])
@pytest.mark.parametrize("case", [(LENS, []), *CASCADE], ids=["flat", "g3", "g40", "g5long"])
def test_paged_decode_i8_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int,
                                           dim: int, case: tuple) -> None:
    """Against float64 attention over the dequantized K/V with the queries rounded as the op
    rounds them: fp32 arithmetic, plus (head dims in 32s) P V's 15-bit p. Against the
    unquantized K/V and queries: the format's error, bounded."""
    _need_i8_kernels()
    own, groups = case
    c = _pool_case(dim + heads + len(own), dtype, heads, kv_heads, dim, own, groups)
    scale = dim**-0.5
    out, lse = _run_i8(c, scale)
    assert out.dtype == dtype and out.shape == c["q"].shape and lse.dtype == torch.float32
    kd = dequantize_rows(c["kc"], c["ks"], torch.float32)
    vd = dequantize_rows(c["vc"], c["vs"], torch.float32)
    ref, ref_lse = _reference(c, scale, True, kd, vd)
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    # Head dims in 32s take P V in integers: p times the value scale on a 15-bit grid of the
    # block's largest scale, at most 2^-16 of max |v| per key (seen: up to 7e-5 of it in all).
    atol = tol + (2**-12 * float(vd.abs().max()) if dim % 32 == 0 else 0.0)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=tol)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    assert bool(torch.isneginf(lse[~finite]).all())
    exact, _ = _reference(c, scale, False, c["kb"], c["vb"])
    err = (out.double() - exact).abs()
    assert float(err.max()) < 0.1 and float(err.mean()) < 0.01


def test_paged_decode_i8_row_does_not_depend_on_the_batch() -> None:
    _need_i8_kernels()
    c = _pool_case(5, torch.bfloat16, 9, 3, 64, LENS, [])
    full, _ = _run_i8(c, 0.125)
    for b in (0, 4, 7):
        one = dict(c, q=c["q"][b: b + 1].contiguous(),
                   row_start=c["row_start"][b: b + 1].contiguous(),
                   row_len=c["row_len"][b: b + 1].contiguous())
        alone, _ = _run_i8(one, 0.125)
        assert torch.equal(alone[0], full[b])


@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "slot-major"])
@pytest.mark.parametrize("case", [(LENS, []), CASCADE[0]], ids=["flat", "cascade"])
def test_paged_decode_i8_does_not_depend_on_where_keys_lie(head_major: bool,
                                                          case: tuple) -> None:
    """The same codes and scales in scattered slots, in one run of consecutive slots (a
    request's allocation), or in runs of 1-40 broken anywhere, in a head-major pool (scales of
    consecutive slots consecutive too) or a slot-major one: bitwise the same outputs and LSE."""
    _need_i8_kernels()
    own, groups = case
    c = _pool_case(13, torch.bfloat16, 9, 3, 64, own, groups)
    names = ("kc", "vc", "ks", "vs")
    if not head_major:
        c = dict(c, **{n: c[n].contiguous() for n in names})
    want = _run_i8(c, 0.125)
    for name, pos in _positions(c["idx"].numel(), 4).items():
        moved = _relocated(c, pos, names)
        assert (moved["ks"].stride(0) == 1) == head_major
        got = _run_i8(moved, 0.125)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


def test_paged_decode_i8_bad_input_names_the_argument() -> None:
    _need_i8_kernels()
    c = _pool_case(6, torch.float32, 9, 3, 64, [4, 5], [])
    with pytest.raises(RuntimeError, match="k_buffer and v_buffer must be int8"):
        _run_i8(dict(c, kc=c["kc"].float(), vc=c["vc"].float()), 0.125)
    with pytest.raises(RuntimeError, match="k_scale / v_scale must be float32"):
        _run_i8(dict(c, ks=c["ks"][:-1]), 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        _run_i8(dict(c, idx=c["idx"] + 5000), 0.125)


# -- the pool and the configuration ---------------------------------------------------------------
def test_int8_pool_layout_bytes_and_refusals() -> None:
    pool = TokenToKVPool(100, 2, 3, 64, torch.bfloat16, kv_dtype=torch.int8)
    assert pool.quantized and pool.k_buffer[0].dtype == torch.int8
    assert pool.k_scale[0].shape == (101, 3) and pool.k_scale[0].stride() == (1, 101)
    # codes plus one fp32 scale per row: 68 bytes where bf16 takes 128
    assert pool.bytes_per_token() == 2 * 2 * 3 * (64 + 4)
    assert kv_bytes_per_token(2, 3, 64, torch.bfloat16) == 2 * 2 * 3 * 128
    pool.check_invariants()
    x = torch.randn(4, 3, 64)
    loc = torch.tensor([5, 9, 2, 77])
    pool.set_kv(0, loc, x, -x)
    k, v = pool.read_kv(0, loc)
    assert k.dtype == torch.bfloat16
    step = pool.k_scale[0][loc].unsqueeze(-1)
    assert bool(((k.float() - x).abs() <= step * 0.5 + x.abs() * 2**-8).all())
    assert bool(((v.float() + x).abs() <= step * 0.5 + x.abs() * 2**-8).all())
    plain = TokenToKVPool(100, 2, 3, 64, torch.bfloat16)
    assert not plain.quantized and plain.k_scale == []
    with pytest.raises(ValueError, match="CPU only"):
        TokenToKVPool(100, 2, 3, 64, torch.bfloat16, device="cuda", kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="kv_dtype"):
        TokenToKVPool(100, 2, 3, 64, torch.bfloat16, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="ServerArgs.kv_cache_dtype"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")


# -- a tiny model on an int8 KV cache -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_model_on_int8_kv_cache(tmp_path: Path, dtype: torch.dtype) -> None:
    """Three requests sharing a 40-token cached prefix and one alone; prefill (with a cached
    prefix), then 6 greedy decode steps on an int8 pool: the C++ ops (decode kernel, extend
    kernel on the dequantized rows) and the torch paths give the same tokens and close logits,
    and both stay close to the same model on an unquantized pool."""
    _need_i8_kernels()
    make_tiny_checkpoint(tmp_path, "llama", seed=4)
    runs = {}
    for name, kv_dtype, kernels in (("int8-kernels", torch.int8, True),
                                    ("int8-torch", torch.int8, False),
                                    ("plain", None, True)):
        runner = PagedRunner.create(tmp_path, dtype=dtype, kv_dtype=kv_dtype)
        runner.model.attn_backend = TorchNativeBackend(
            runner.kv_pool, decode_kernel=kernels, extend_kernel=kernels)
        runs[name] = shared_prefix_greedy(runner)
    assert runs["int8-kernels"][0] == runs["int8-torch"][0]
    for a, b in zip(runs["int8-kernels"][1], runs["int8-torch"][1], strict=True):
        # the op also rounds the queries to int8; the torch path attends with them exact
        torch.testing.assert_close(a, b, atol=3e-2 * max(1.0, float(b.abs().max())), rtol=0)
    for a, b in zip(runs["int8-kernels"][1], runs["plain"][1], strict=True):
        torch.testing.assert_close(a, b, atol=6e-2 * max(1.0, float(b.abs().max())), rtol=0)


def test_server_args_int8_builds_an_int8_pool_sized_by_its_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kv_cache_dtype=int8` reaches the runner's pool, and the pool sizing from free memory
    counts int8 codes plus scales: 128 / 68 times the tokens of bf16 in the same memory."""
    from types import SimpleNamespace

    from model_fixtures import make_tiny_runner

    from radixrt.model import runner as runner_mod
    from radixrt.model.model_config import ModelConfig

    r = make_tiny_runner(tmp_path, kv_cache_dtype="int8", dtype="bfloat16")
    pool = r.token_to_kv_pool
    assert pool.quantized and pool.dtype == torch.bfloat16 and len(pool.k_scale) == len(
        pool.k_buffer)
    cfg = ModelConfig.from_path(tmp_path)
    monkeypatch.setattr(runner_mod.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=1 << 32))
    def plan(kv: str) -> runner_mod.PoolSizes:
        args = ServerArgs(model_path=str(tmp_path), kv_cache_dtype=kv)
        return runner_mod.plan_pools(args, cfg, runner_mod.kv_storage_dtype(args, torch.bfloat16),
                                     torch.device("cpu"))

    sizes = {kv: plan(kv) for kv in ("auto", "int8")}
    per = {kv: kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, d)
           for kv, d in (("auto", torch.bfloat16), ("int8", torch.int8))}
    for kv in sizes:
        assert sizes[kv].max_total_tokens == int((1 << 32) * 0.25) // per[kv]
    assert per["auto"] / per["int8"] == pytest.approx(2 * cfg.head_dim / (cfg.head_dim + 4))
