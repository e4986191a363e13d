"""The float16 KV cache under a float32 model (`kv_cache_dtype=float16`, a "narrowed" pool): the
pool's rounding, the C++ store and decode ops against the same arithmetic on an fp32 pool holding
the rounded values, a tiny model end to end, and the configuration's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import PagedRunner, make_tiny_checkpoint, shared_prefix_greedy
from test_paged_decode_kernel import _case, _head_major, _reference

from radixrt.attention import cpu_kernels
from radixrt.attention.paged_decode import PagedDecodePlan
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.config import ServerArgs
from radixrt.mem.memory_pool import TokenToKVPool, kv_bytes_per_token
from radixrt.model.runner import kv_storage_dtype


def _need_kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


# -- the pool ------------------------------------------------------------------------------------
def test_narrowed_pool_rounds_to_half_and_reads_back_float32() -> None:
    g = torch.Generator().manual_seed(0)
    pool = TokenToKVPool(30, 2, 3, 64, torch.float32, kv_dtype=torch.float16)
    assert pool.narrowed and not pool.quantized
    assert pool.k_buffer[0].dtype == torch.float16 and pool.k_scale == []
    assert pool.bytes_per_token() == kv_bytes_per_token(2, 3, 64, torch.float32) // 2
    k = torch.randn(4, 3, 64, generator=g) * 10
    v = torch.randn(4, 3, 64, generator=g)
    loc = torch.tensor([5, 1, 30, 12])
    pool.set_kv(1, loc, k, v)
    rk, rv = pool.read_kv(1, loc[[2, 0]])
    assert rk.dtype == torch.float32
    assert torch.equal(rk, k[[2, 0]].half().float()) and torch.equal(rv, v[[2, 0]].half().float())
    assert torch.equal(pool.as_stored(k), k.half().float())
    pool.check_invariants()
    # the other pools are not narrowed
    assert not TokenToKVPool(30, 2, 3, 64, torch.float16).narrowed
    assert not TokenToKVPool(30, 2, 3, 64, torch.float32).narrowed


def test_refusals_name_the_field() -> None:
    with pytest.raises(ValueError, match="kv_dtype"):
        TokenToKVPool(30, 2, 3, 64, torch.bfloat16, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="CPU only"):
        TokenToKVPool(30, 2, 3, 64, torch.float32, device="meta", kv_dtype=torch.float16)
    args = ServerArgs(kv_cache_dtype="float16")
    assert kv_storage_dtype(args, torch.float32) == torch.float16
    assert kv_storage_dtype(args, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype=float16"):
        kv_storage_dtype(args, torch.bfloat16)
    assert kv_storage_dtype(ServerArgs(), torch.float32) == torch.float32
    with pytest.raises(ValueError, match="ServerArgs.kv_cache_dtype"):
        ServerArgs(kv_cache_dtype="float8")
    assert kv_storage_dtype(ServerArgs(kv_cache_dtype="float32"), torch.float32) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype=float32"):
        kv_storage_dtype(ServerArgs(kv_cache_dtype="float32"), torch.bfloat16)


@pytest.mark.parametrize("have_kernel", [True, False])
def test_auto_narrows_only_a_quantized_float32_model_on_cpu(monkeypatch: pytest.MonkeyPatch,
                                                            have_kernel: bool) -> None:
    """`auto` stores half K/V under fp32 with quantized weights on CPU where the C++ decode
    reads a half pool; the dense fp32 reference, other dtypes, CUDA, an explicit `float32`, a
    disabled decode kernel and a missing one keep the compute dtype."""
    import radixrt.model.runner as runner_mod

    monkeypatch.setattr(runner_mod, "half_pool_decode_available", lambda head_dim: have_kernel)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = ServerArgs()
    narrowed = torch.float16 if have_kernel else torch.float32
    assert kv_storage_dtype(auto, torch.float32, cpu, quantized=True) == narrowed
    assert kv_storage_dtype(auto, torch.float32, cpu, quantized=False) == torch.float32
    assert kv_storage_dtype(auto, torch.float32, cuda, quantized=True) == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        assert kv_storage_dtype(auto, dtype, cpu, quantized=True) == dtype
    assert kv_storage_dtype(ServerArgs(kv_cache_dtype="float32"), torch.float32, cpu,
                            quantized=True) == torch.float32
    assert kv_storage_dtype(ServerArgs(disable_cpu_decode_kernel=True), torch.float32, cpu,
                            quantized=True) == torch.float32


# -- the C++ ops ---------------------------------------------------------------------------------
@pytest.mark.parametrize("hd", [64, 20])
def test_kv_store_rounds_fp32_rows_as_torch_does(hd: int) -> None:
    """fp32 K/V (strided slices of a fused qkv row, as the layer hands them over) into a
    head-major float16 pool: the bits of torch's `.to(torch.float16)`, including values that
    overflow to inf, subnormals and ties; head dim 20 takes the scalar tail."""
    _need_kernels()
    g = torch.Generator().manual_seed(3)
    pool = TokenToKVPool(40, 2, 3, hd, torch.float32, kv_dtype=torch.float16)
    qkv = torch.randn(5, 9 * hd + 6 * hd, generator=g) * 100
    qkv[0, 9 * hd: 9 * hd + 4] = torch.tensor([70000.0, -1e-7, 3e-6, 1.0 + 2.0**-11])
    k = qkv[:, 9 * hd: 12 * hd].view(5, 3, hd)
    v = qkv[:, 12 * hd:].view(5, 3, hd)
    loc = torch.tensor([3, 17, 1, 40, 22])
    torch.ops.radixrt.kv_store(pool.k_buffer[1], pool.v_buffer[1], loc, k, v)
    assert torch.equal(pool.k_buffer[1][loc], k.half()) and torch.equal(pool.v_buffer[1][loc],
                                                                         v.half())
    assert torch.isinf(pool.k_buffer[1][3, 0, 0])
    # the torch fallback (set_kv) stores the same bits
    other = TokenToKVPool(40, 2, 3, hd, torch.float32, kv_dtype=torch.float16)
    other.set_kv(1, loc, k.contiguous(), v.contiguous())
    assert torch.equal(other.k_buffer[1][loc], pool.k_buffer[1][loc])
    assert torch.equal(other.v_buffer[1][loc], pool.v_buffer[1][loc])
    with pytest.raises(RuntimeError, match="float32 into a float16 pool"):
        torch.ops.radixrt.kv_store(pool.k_buffer[1], pool.v_buffer[1], loc, k.bfloat16(),
                                   v.bfloat16())


CASES = [([1, 2, 15, 16, 17, 33, 64, 300], []),
         ([3, 9, 1, 40], [(40, [0, 1, 2])]),
         ([1 + i % 5 for i in range(20)], [(100, list(range(20)))])]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (6, 3, 80)])
@pytest.mark.parametrize("case", CASES, ids=["flat", "g3", "g20"])
def test_paged_decode_fp32_queries_over_a_half_pool(heads: int, kv_heads: int, dim: int,
                                                    case: tuple) -> None:
    """fp32 queries over a float16 pool: fp32 outputs equal, up to the compiler's fp32
    contractions (one ulp seen), to the same op over an fp32 pool holding the widened values
    (the scans convert each row to fp32 as they read it), and within fp32 rounding of float64
    attention over them."""
    _need_kernels()
    own, groups = case
    c = _case(dim + len(own), torch.float32, heads, kv_heads, dim, own, groups)
    half = dict(c, kb=_head_major(c["kb"].half()), vb=_head_major(c["vb"].half()))
    wide = dict(c, kb=_head_major(c["kb"].half().float()), vb=_head_major(c["vb"].half().float()))
    plan = PagedDecodePlan(c["idx"], c["row_start"], c["row_len"], c["g_start"], c["g_len"],
                           c["g_ptr"], c["g_rows"])
    out, lse = plan.run(c["q"], half["kb"], half["vb"], 0.125)
    want, want_lse = plan.run(c["q"], wide["kb"], wide["vb"], 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)
    spec = cpu_kernels.loaded_spec()
    if spec is not None and spec.isa == "avx2":  # one intrinsic scan for both pools: exact
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, _ = _reference(dict(c, kb=c["kb"].half().float(), vb=c["vb"].half().float()), 0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.radixrt.paged_decode(c["q"].bfloat16(), half["kb"], half["vb"], c["idx"],
                                       c["row_start"], c["row_len"], c["g_start"], c["g_len"],
                                       c["g_ptr"], c["g_rows"], 0.125)


def test_prefetch_and_threads_change_no_bit_over_a_half_pool() -> None:
    """The scans' prefetches over a float16 pool (none to several blocks ahead, into L1 or L2)
    and the thread count move only loads: the same bits, cascade groups (of more query rows
    than one register tile holds) included."""
    _need_kernels()
    own, groups = CASES[2]
    c = _case(99, torch.float32, 9, 3, 64, own, groups)
    kb, vb = _head_major(c["kb"].half()), _head_major(c["vb"].half())
    plan = PagedDecodePlan(c["idx"], c["row_start"], c["row_len"], c["g_start"], c["g_len"],
                           c["g_ptr"], c["g_rows"])
    ahead, l1 = torch.ops.radixrt.paged_decode_prefetch, torch.ops.radixrt.paged_decode_prefetch_l1
    before, before_l1, threads = ahead(), l1(), torch.get_num_threads()
    results = []
    try:
        for n, blocks, into_l1 in ((1, 0, 0), (1, 2, 1), (2, 0, 0), (2, 1, 0), (2, 2, 1),
                                   (2, 6, 0)):
            torch.set_num_threads(n)
            ahead(blocks, blocks)
            l1(into_l1)
            results.append(plan.run(c["q"], kb, vb, 0.125))
    finally:
        ahead(*before)
        l1(before_l1)
        torch.set_num_threads(threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


# -- a tiny model ----------------------------------------------------------------------------------
def test_tiny_model_on_a_float16_kv_cache(tmp_path: Path) -> None:
    """Three requests sharing a 40-token cached prefix and one alone; prefill, then 6 greedy
    decode steps on a float16 pool under fp32: the C++ path (kv_store rounding, the decode op
    on fp32 queries, the fused decode step, the extend op on widened rows) and the torch path
    give the same tokens and logits within fp32 rounding, and stay close to an fp32 pool."""
    _need_kernels()
    make_tiny_checkpoint(tmp_path, "llama", seed=4)
    runs = {}
    for name, kv_dtype, kernels in (("half-kernels", torch.float16, True),
                                    ("half-torch", torch.float16, False),
                                    ("fp32", None, True)):
        runner = PagedRunner.create(tmp_path, dtype=torch.float32, kv_dtype=kv_dtype)
        runner.model.attn_backend = TorchNativeBackend(runner.kv_pool, decode_kernel=kernels,
                                                       extend_kernel=kernels)
        assert runner.kv_pool.narrowed == (kv_dtype is not None)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            runs[name] = shared_prefix_greedy(runner, steps=6)
        # with the kernels, each decode step is the one C++ call (kv_store and the op inside)
        calls = {e.key: e.count for e in prof.key_averages()}.get("radixrt::decode_step", 0)
        assert calls == (6 if kernels else 0), name
    assert runs["half-kernels"][0] == runs["half-torch"][0]
    for a, b in zip(runs["half-kernels"][1], runs["half-torch"][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=0)
    for a, b in zip(runs["half-kernels"][1], runs["fp32"][1], strict=True):
        torch.testing.assert_close(a, b, atol=2e-2 * max(1.0, float(b.abs().max())), rtol=0)
        assert not torch.equal(a, b)  # the pool did round


def test_server_args_float16_builds_a_narrowed_pool(tmp_path: Path) -> None:
    from model_fixtures import make_tiny_runner

    r = make_tiny_runner(tmp_path, kv_cache_dtype="float16", dtype="float32")
    pool = r.token_to_kv_pool
    assert pool.narrowed and pool.dtype == torch.float32
    assert all(b.dtype == torch.float16 for b in pool.k_buffer)


def test_a_quantized_float32_server_defaults_to_the_half_pool(tmp_path: Path) -> None:
    """GGUF weights (Q4_1 layers, Q8_0 head) under fp32: `auto` builds the float16 pool and
    serves greedy and sampled requests (mixed prefill + decode steps) with the same tokens as
    an explicit `float16`; `float32` keeps fp32 K/V, and so does the dense fp32 reference."""
    _need_kernels()
    from model_fixtures import serve_staggered, write_tiny_gguf

    from radixrt.model.quant_matmul import resolve_quant_kernel
    from radixrt.model.runner import ModelRunner
    from radixrt.sched.scheduler import Scheduler

    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=6, num_hidden_layers=2,
                              tie_word_embeddings=True)
    gguf = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_1", "Q8_0")
    prompts = {f"g{i}": [3 + i, 40, 41, 42, 43, 44, 45, 46] * 2 + [7 + i] for i in range(4)}

    def serve(kv: str, quantization: str = "gguf") -> tuple[torch.dtype, dict[str, list[int]]]:
        args = ServerArgs(model_path=str(gguf), dtype="float32", quantization=quantization,
                          quant_kernel=resolve_quant_kernel("auto"), kv_cache_dtype=kv,
                          max_total_tokens=1024, max_running_requests=8)
        sched = Scheduler(args, ModelRunner(args))
        pool = sched.runner.token_to_kv_pool
        assert pool.dtype == torch.float32 and sched.runner.kv_dtype == pool.kv_dtype
        return pool.kv_dtype, serve_staggered(sched, prompts, 10)

    kv_auto, auto = serve("auto")
    kv_half, half = serve("float16")
    kv_full, full = serve("float32")
    assert (kv_auto, kv_half, kv_full) == (torch.float16, torch.float16, torch.float32)
    assert auto == half and all(len(auto[r]) == 10 for r in prompts) and len(auto["s"]) == 4
    assert set(full) == set(auto)
    assert serve("auto", quantization="none")[0] == torch.float32
