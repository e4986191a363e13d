"""Prepacked bf16 matmul weights (`radixrt/model/prepack.py`): a oneDNN-packed call is bitwise
the plain one wherever it is taken (rows up to PACKED_MAX_ROWS, not invariant calls); an
AMX-packed one (`radixrt::amx_linear`, where AMX-BF16 is usable) is row-invariant, bitwise the
plain call at 1-8 rows and as accurate up to AMX_MAX_ROWS; the start-up decision
and its overrides, the quantization probe timing plain dense weights, and a model whose dense
weights are packed giving the plain model's logits (bitwise for oneDNN's layout, within the
ulps for AMX's) with the Python layers and the C++ decode step bitwise alike; a decode team
over AMX-packed dense linears (members splitting their N blocks) bitwise the step without it,
and none over oneDNN-packed ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import (
    PagedRunner,
    make_tiny_checkpoint,
    make_tiny_runner,
    serve_staggered,
    write_tiny_gguf,
)

from radixrt.attention import cpu_kernels
from radixrt.model import prepack
from radixrt.model.decode_layers import DecodeLayers
from radixrt.model.layer_ops import FusedCpuLayerOps, TorchLayerOps
from radixrt.model.linear import DenseWeight, QuantizedWeight, pack_dense_weights
from radixrt.model.loader import load_model
from radixrt.model.model_config import ModelConfig
from radixrt.model.quant import QuantPlan
from radixrt.model.quant_matmul import vnni_kernel_available

needs_onednn = pytest.mark.skipif(not prepack.available(),
                                  reason="oneDNN does not pack bf16 weights here")


def _use_layout(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs in oneDNN's layout (RADIXRT_AMX_LINEAR=0) or AMX's (skips where amx_linear cannot
    run) for the rest of the test (the decision is cached per process: cleared)."""
    monkeypatch.setenv(prepack.ENV_AMX, "0" if name == "onednn" else "")
    prepack.amx_available.cache_clear()
    if name == "amx" and not prepack.amx_available():
        pytest.skip("no usable AMX-BF16 tiles in this build or CPU")


@pytest.fixture(params=["onednn", "amx"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each packed layout in turn."""
    _use_layout(request.param, monkeypatch)
    yield request.param
    prepack.amx_available.cache_clear()


@pytest.fixture
def amx_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX's layout only."""
    _use_layout("amx", monkeypatch)
    yield
    prepack.amx_available.cache_clear()


@pytest.fixture
def onednn_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's layout only."""
    _use_layout("onednn", monkeypatch)
    yield
    prepack.amx_available.cache_clear()


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Sets RADIXRT_PREPACK for one test (the decision is cached per process: cleared around)."""

    def force(value: str) -> None:
        monkeypatch.setenv(prepack.ENV_FORCE, value)
        prepack.prepack_pays.cache_clear()

    yield force
    prepack.prepack_pays.cache_clear()


@needs_onednn
@pytest.mark.parametrize(("out_f", "in_f"), [(96, 64), (200, 96), (960, 576)])
@pytest.mark.usefixtures("onednn_layout")
def test_packed_calls_are_bitwise_the_plain_matmul(out_f: int, in_f: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(out_f)
    w = DenseWeight(torch.randn(out_f, in_f, generator=g).bfloat16())
    plain = DenseWeight(w.weight.detach().clone())
    bias = torch.randn(out_f, generator=g).bfloat16()
    w.pack()
    calls = []
    real = prepack.packed_linear
    monkeypatch.setattr(prepack, "packed_linear", lambda *a: calls.append(1) or real(*a))
    for rows in (1, 2, 3, 7, 16, 31, 64, 65, 128, 200, prepack.PACKED_MAX_ROWS):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        for b in (None, bias):
            assert torch.equal(w(x, b), plain(x, b)), (rows, b is not None)
    assert len(calls) == 22  # every call above took the packed weight
    big = torch.randn(prepack.PACKED_MAX_ROWS + 1, in_f, generator=g).bfloat16()
    assert torch.equal(w(big), plain(big))
    assert torch.equal(w(big[:3], None, True), plain(big[:3], None, True))  # invariant: plain
    assert len(calls) == 22
    assert w.nbytes() == 2 * plain.nbytes() and w.bytes_read(8) == plain.bytes_read(8)


@pytest.mark.parametrize(("out_f", "in_f"), [(96, 64), (960, 576), (576, 1536)])
@pytest.mark.usefixtures("amx_layout")
def test_amx_packed_calls(out_f: int, in_f: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX layout: every call up to AMX_MAX_ROWS rows takes it (with and without a bias, row
    counts off the 16-row tiles): the exact result rounded once, up to the fp32 sums' error;
    as close to the plain matmul, and bitwise it at 1-8 rows; each row's outputs are the same
    bits whatever the call's other rows; larger and invariant calls stay plain."""
    g = torch.Generator().manual_seed(out_f + in_f)
    w = DenseWeight((torch.randn(out_f, in_f, generator=g) * 0.05).bfloat16())
    plain = DenseWeight(w.weight.detach().clone())
    bias = torch.randn(out_f, generator=g).bfloat16()
    w.pack()
    assert w.packed is not None and prepack.is_amx(w.packed)
    calls = []
    real = prepack.packed_linear
    monkeypatch.setattr(prepack, "packed_linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(prepack.AMX_MAX_ROWS + 1, in_f, generator=g).bfloat16()
    w64 = w.weight.double()
    row_counts = (1, 2, 7, 8, 15, 16, 17, 33, 64, 100, 256, 300, 517, prepack.AMX_MAX_ROWS)
    for b in (None, bias):
        whole = w(x[:300], b)
        for rows in row_counts:
            xs = x[:rows]
            got, want = w(xs, b), plain(xs, b)
            # the fp32 sum plus the bias, rounded once: half a bf16 ulp of the exact result
            # and the fp32 sums' error (derived: K * 2^-24 of the terms' magnitude)
            b64 = torch.zeros(out_f, dtype=torch.float64) if b is None else b.double()
            exact = xs.double() @ w64.t() + b64
            terms = xs.double().abs() @ w64.abs().t() + b64.abs()
            err = (got.double() - exact).abs()
            half_ulp = torch.exp2(torch.floor(torch.log2(got.double().abs().clamp_min(
                2.0**-126))) - 8)
            assert bool((err <= half_ulp + in_f * 2.0**-24 * terms).all()), (rows, b is not None)
            if b is None:  # oneDNN sums K in another order at some row counts
                assert bool(((got.double() - want.double()).abs()
                             <= 2 * half_ulp + in_f * 2.0**-23 * terms).all()), rows
            if rows <= 8:
                assert torch.equal(got, want), (rows, b is not None)
            if rows <= 300:
                assert torch.equal(got, whole[:rows]), (rows, b is not None)
            else:  # from 512 rows the threads split the rows, not the outputs
                assert torch.equal(got[:300], whole), (rows, b is not None)
    assert len(calls) == 2 * (len(row_counts) + 1)
    assert torch.equal(w(x), plain(x))  # above AMX_MAX_ROWS: the plain weight
    assert torch.equal(w(x[:3], None, True), plain(x[:3], None, True))  # invariant: plain
    assert len(calls) == 2 * (len(row_counts) + 1)
    # sizes off the 32-blocks keep oneDNN's layout
    odd = DenseWeight(torch.randn(200, 96, generator=g).bfloat16())
    odd.pack()
    assert odd.packed is not None and not prepack.is_amx(odd.packed)
    with pytest.raises(ValueError, match="multiples of 32"):
        prepack.amx_pack(odd.weight)


@pytest.mark.parametrize(("inter", "in_f"), [(96, 64), (64, 96), (1536, 576)])
@pytest.mark.usefixtures("amx_layout")
def test_amx_fused_silu_mul(inter: int, in_f: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `[gate; up]` weight's `silu_mul` on AMX tiles (`amx_linear_silu`, the SiLU-mul in the
    linear's epilogue) is bitwise radixrt::silu_mul of the linear, which is torch's
    `F.silu(gate) * up` (inter = 96: its last 32 columns on silu_mul's scalar path), at row
    counts off the tiles, with and without a bias, and above AMX_MAX_ROWS (where the linear
    alone is plain); invariant and odd-block calls take the linear then `silu_mul`."""
    g = torch.Generator().manual_seed(inter + in_f)
    w = DenseWeight((torch.randn(2 * inter, in_f, generator=g) * 0.2).bfloat16())
    bias = torch.randn(2 * inter, generator=g).bfloat16()
    w.pack()
    fused = []
    real = prepack.packed_linear_silu
    monkeypatch.setattr(prepack, "packed_linear_silu", lambda *a: fused.append(1) or real(*a))
    ops, ref = FusedCpuLayerOps(), TorchLayerOps()
    x = torch.randn(prepack.AMX_MAX_ROWS + 1, in_f, generator=g).bfloat16()
    row_counts = (1, 5, 16, 17, 33, 100, prepack.AMX_MAX_ROWS)
    for b in (None, bias):
        for rows in row_counts:
            got = w.silu_mul(x[:rows], b, False, ops.silu_mul)
            assert got.shape == (rows, inter)
            y = w(x[:rows], b)
            assert torch.equal(got, ops.silu_mul(y)), (rows, b is not None)
            assert torch.equal(got, ref.silu_mul(y)), (rows, b is not None)
    assert len(fused) == 2 * len(row_counts)
    # above AMX_MAX_ROWS too (the linear alone is plain there: within its ulps)
    big = w.silu_mul(x, None, False, ops.silu_mul)
    assert len(fused) == 2 * len(row_counts) + 1
    assert torch.equal(big[:prepack.AMX_MAX_ROWS],
                       w.silu_mul(x[:prepack.AMX_MAX_ROWS], None, False, ops.silu_mul))
    assert torch.allclose(big.float(), ops.silu_mul(w(x)).float(), rtol=0.02, atol=0.02)
    assert torch.equal(w.silu_mul(x[:3], None, True, ops.silu_mul),
                       ops.silu_mul(w(x[:3], None, True)))
    odd = DenseWeight(torch.randn(96, in_f, generator=g).bfloat16())  # three 32-blocks
    odd.pack()
    assert odd.packed is not None and prepack.is_amx(odd.packed)
    assert torch.equal(odd.silu_mul(x[:9], None, False, ops.silu_mul), ops.silu_mul(odd(x[:9])))
    assert len(fused) == 2 * len(row_counts) + 2
    with pytest.raises(RuntimeError, match="even number of 32-output blocks"):
        torch.ops.radixrt.amx_linear_silu(x[:4], odd.packed, None)


@pytest.mark.parametrize(("out_f", "in_f"), [(96, 64), (1536, 576)])
@pytest.mark.usefixtures("amx_layout")
def test_amx_logits_are_the_fp32_sums(out_f: int, in_f: int) -> None:
    """An AMX-packed weight's `logits` are amx_linear's fp32 sums (`amx_linear_f32`): rounded
    to bf16 they are bitwise the bf16 call's outputs, and they are within the fp32 sums' error
    of the exact product (no bf16 rounding), at row counts off the tiles, with a bias, from 512
    rows (the threads split the rows) and alone against in a batch; invariant calls and calls
    above AMX_MAX_ROWS round to bf16 first, as before."""
    g = torch.Generator().manual_seed(out_f)
    w = DenseWeight((torch.randn(out_f, in_f, generator=g) * 0.05).bfloat16())
    w.pack()
    assert w.packed is not None and prepack.is_amx(w.packed)
    bias = torch.randn(out_f, generator=g).bfloat16()
    x = torch.randn(prepack.AMX_MAX_ROWS + 1, in_f, generator=g).bfloat16()
    w64 = w.weight.double()
    whole = w.logits(x[:300])
    rounded_once = 0
    for rows in (1, 7, 16, 17, 33, 64, 300, 517):
        xs = x[:rows]
        got = w.logits(xs)
        assert got.dtype == torch.float32 and got.shape == (rows, out_f)
        assert torch.equal(got.bfloat16(), w(xs)), rows
        exact = xs.double() @ w64.t()
        terms = xs.double().abs() @ w64.abs().t()
        assert bool(((got.double() - exact).abs() <= in_f * 2.0**-24 * terms).all()), rows
        rounded_once += int((got != got.bfloat16().float()).sum())
        assert torch.equal(got[:min(rows, 300)], whole[:min(rows, 300)]), rows
        with_bias = torch.ops.radixrt.amx_linear_f32(xs, w.packed, bias)
        assert torch.equal(with_bias.bfloat16(), w(xs, bias)), rows
    assert rounded_once > 0  # the fp32 sums, not bf16 values widened
    assert torch.equal(w.logits(x[:5], True), w(x[:5], None, True).float())
    assert torch.equal(w.logits(x), w(x).float())  # above AMX_MAX_ROWS: the plain weight
    with pytest.raises(RuntimeError, match="amx_linear_f32: x must be 2-D bfloat16"):
        torch.ops.radixrt.amx_linear_f32(x[:2].float(), w.packed, None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.usefixtures("amx_layout")
def test_amx_greedy_ids_are_the_argmax_of_the_fp32_logits(threads: int) -> None:
    """`amx_linear_argmax` (`DenseWeight.greedy_ids` on an AMX-packed weight) is bitwise
    `row_argmax(amx_linear_f32(x))` without writing the logits: at row counts off the tiles,
    with a bias, from 512 rows (the threads split the rows), at 1 and 2 threads (each run's
    picks merged after the call); ties go to the first column whichever run and lane holds
    each copy, a row holding NaN gives its first NaN although a larger value comes earlier, a
    row whose outputs are all equal gives 0. Invariant calls and calls above AMX_MAX_ROWS get
    None (the caller takes the logits)."""
    from radixrt.sampling.sampler import row_argmax

    torch.set_num_threads(threads)
    out_f, in_f = 1536, 576  # 48 N blocks: each thread holds half of the columns
    g = torch.Generator().manual_seed(21)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).bfloat16()
    x = torch.randn(600, in_f, generator=g).bfloat16()
    # column 900 sums inf * x0 - inf * x1: NaN where x0, x1 share a sign (or one is 0), else
    # +-inf (the other rows: each of the three at random)
    w[900, :2] = torch.tensor([float("inf"), float("-inf")])
    x[0, :2] = torch.tensor([-1.0, 1.0])  # row 0: -inf at 900
    best = x[0].float().sign().bfloat16() * 2  # row 0's largest output, far above the rest
    copies = [37, 42, 517, 1100, out_f - 3]  # lanes 5, 10, 5, 12, 13; both threads' columns
    for c in copies:
        w[c] = best
    x[1] = best * 0.25  # row 1: its largest finite output at 37 ...
    x[1, :2] = 1.0  # ... and a NaN later, at 900
    x[2] = 0.0  # row 2: every output 0 but a NaN at 900 (0 * inf)
    dense = DenseWeight(w)
    dense.pack()
    assert dense.packed is not None and prepack.is_amx(dense.packed)
    bias = torch.randn(out_f, generator=g)
    for rows in (1, 4, 7, 16, 17, 33, 64, 300, 517, 600):
        xs = x[:rows]
        for b in (None, bias):
            logits = torch.ops.radixrt.amx_linear_f32(xs, dense.packed, b)
            ids = torch.ops.radixrt.amx_linear_argmax(xs, dense.packed, b)
            assert ids.dtype == torch.int64 and torch.equal(ids, row_argmax(logits)), (rows, b)
        assert torch.equal(dense.greedy_ids(xs), row_argmax(dense.logits(xs)))
    ids = dense.greedy_ids(x[:3])
    assert ids is not None and ids.tolist() == [37, 900, 900]
    assert dense.greedy_ids(x[:5], invariant=True) is None
    big = torch.randn(prepack.AMX_MAX_ROWS + 1, in_f, generator=g).bfloat16()
    assert dense.greedy_ids(big) is None
    finite = prepack.amx_pack(w[:512])
    zero = torch.zeros(3, in_f, dtype=torch.bfloat16)
    assert torch.ops.radixrt.amx_linear_argmax(zero, finite, None).tolist() == [0, 0, 0]
    assert torch.ops.radixrt.amx_linear_argmax(x[:0], dense.packed, None).shape == (0,)
    with pytest.raises(RuntimeError, match="amx_linear_argmax: x must be 2-D bfloat16"):
        torch.ops.radixrt.amx_linear_argmax(x[:2].float(), dense.packed, None)
    with pytest.raises(RuntimeError, match="amx_linear_argmax: bias must be"):
        torch.ops.radixrt.amx_linear_argmax(x[:2], dense.packed, bias[:5])


@pytest.mark.usefixtures("amx_layout")
def test_a_greedy_step_over_an_amx_packed_head_skips_the_logits(tmp_path: Path,
                                                                 forced: object) -> None:
    """`forward_greedy` on a model whose LM head is AMX-packed (a GGUF model's dense copy above
    the vnni kernel's rows, and a bf16 model's own weight): no logits, and the ids are
    `row_argmax` of `forward`'s logits, for an extend batch and decode batches (the C++
    one-call step); at the kernel's rows the GGUF head still returns logits and ids."""
    from radixrt.core.forward_batch import ForwardMode
    from radixrt.sampling.sampler import row_argmax

    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    forced("1")  # type: ignore[operator]
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=6, num_hidden_layers=2,
                              tie_word_embeddings=True)
    cases: list[tuple[Path, QuantPlan | None]] = [(tmp_path / "hf", None)]
    if vnni_kernel_available():
        gguf = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_1", "Q8_0")
        cases.append((gguf, QuantPlan("gguf", max_rows_int4=2, max_rows_int8=2,
                                      kernel="vnni")))
    for path, plan in cases:
        model, _ = load_model(path, None, torch.bfloat16, "cpu",
                              model_config=ModelConfig.from_path(path), quant=plan)
        assert pack_dense_weights(model) > 0
        r = PagedRunner.for_model(model)
        rows = [r.new_request() for _ in range(5)]
        gen = torch.Generator().manual_seed(7)
        chunks = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 9, 1, 17, 6)]
        mode = ForwardMode.EXTEND
        for _ in range(4):
            logits, lg, ids = r.greedy_step(mode, rows, chunks)
            assert lg is None and ids is not None, (path.name, mode)
            assert torch.equal(ids, row_argmax(logits)), (path.name, mode)
            chunks, mode = [[t] for t in ids.tolist()], ForwardMode.DECODE
        r.kv_pool.check_invariants()
        if plan is not None:  # 2 rows: the vnni kernel writes the logits and picks
            logits, lg, ids = r.greedy_step(ForwardMode.DECODE, rows[:2], [[5], [6]])
            assert lg is not None and torch.equal(lg, logits)
            assert ids is not None and torch.equal(ids, row_argmax(lg))


@pytest.mark.usefixtures("amx_layout")
@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_a_scheduler_over_an_amx_packed_head_serves_greedy_steps_without_logits(
        tmp_path: Path, forced: object, monkeypatch: pytest.MonkeyPatch,
        speculative: str) -> None:
    """A scheduler serving a bf16 model whose LM head is AMX-packed: greedy requests (all-greedy
    steps get ids and no logits from `forward_greedy`; with n-gram drafts, several rows per
    request, picked and verified) give the same tokens as when the head writes the logits
    (`greedy_ids` off); a sampled request alongside (steps not all greedy) is served too.
    Mixed prefill + decode steps included (staggered arrivals)."""
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner
    from radixrt.sched.scheduler import Scheduler

    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    forced("1")  # type: ignore[operator]
    make_tiny_checkpoint(tmp_path / "hf", "llama", seed=8, num_hidden_layers=2,
                         tie_word_embeddings=True)
    args = ServerArgs(model_path=str(tmp_path / "hf"), dtype="bfloat16", max_total_tokens=1024,
                      num_threads=2, speculative_algorithm=speculative)
    # repeating prompts, so that n-gram lookup drafts
    prompts = {f"g{i}": [3 + i, 40, 41, 42, 43] * 3 + [7 + i] for i in range(4)}

    def serve(without_logits: bool) -> dict[str, list[int]]:
        if not without_logits:
            monkeypatch.setattr(DenseWeight, "greedy_ids", lambda self, x, invariant=False: None)
        sched = Scheduler(args, ModelRunner(args))
        head = sched.runner.model.lm_head
        assert isinstance(head, DenseWeight) and head.packed is not None
        real, skipped = sched.runner.forward_greedy, [0]

        def greedy(fb: object) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            logits, ids = real(fb)  # type: ignore[arg-type]
            skipped[0] += logits is None
            return logits, ids

        sched.runner.forward_greedy = greedy  # type: ignore[method-assign]
        out = serve_staggered(sched, prompts, 12)
        assert (skipped[0] > 0) == without_logits
        assert all(len(out[r]) == 12 for r in prompts) and len(out["s"]) == 4
        if speculative == "ngram":  # steps with several rows per request ran
            assert sched.stats()["spec_verify_steps_total"] > 0
        return out

    without, written = serve(True), serve(False)
    assert {r: without[r] for r in prompts} == {r: written[r] for r in prompts}


def test_amx_linear_refuses_bad_input() -> None:
    if not cpu_kernels.load_cpu_kernels() or not torch.ops.radixrt.amx_linear_available():
        pytest.skip("amx_linear cannot run here")
    packed = prepack.amx_pack(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 32 features"):
        torch.ops.radixrt.amx_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.radixrt.amx_linear(torch.zeros(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.radixrt.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed,
                                     torch.zeros(3))
    assert torch.ops.radixrt.amx_linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed,
                                        None).shape == (0, 64)


def test_the_decision_and_its_overrides(forced: object) -> None:
    forced("")  # type: ignore[operator]
    assert not prepack.prepack_pays(torch.float32)  # bf16 only
    assert not prepack.prepack_pays(torch.bfloat16, "cuda")
    forced("0")  # type: ignore[operator]
    assert not prepack.prepack_pays(torch.bfloat16)
    forced("1")  # type: ignore[operator]
    assert prepack.prepack_pays(torch.bfloat16) == prepack.available()
    forced("yes")  # type: ignore[operator]
    with pytest.raises(ValueError, match=prepack.ENV_FORCE):
        prepack.prepack_pays(torch.bfloat16)


@needs_onednn
def test_the_measured_decision_times_both_forms(forced: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    forced("")  # type: ignore[operator]
    monkeypatch.setattr(prepack, "_measure", lambda dtype: (2.0, 1.0))
    assert prepack.prepack_pays(torch.bfloat16)
    prepack.prepack_pays.cache_clear()
    monkeypatch.setattr(prepack, "_measure", lambda dtype: (1.1, 1.0))  # under the margin
    assert not prepack.prepack_pays(torch.bfloat16)
    monkeypatch.undo()
    plain, packed = prepack._measure(torch.bfloat16, reps=1, copies=2)  # the real timing runs
    assert plain > 0 and packed > 0


@needs_onednn
def test_the_quant_probe_times_plain_dense_weights(forced: object) -> None:
    """The probe's crossover is measured on plain dense weights (packed ones won at 64 rows in
    the cache-resident probe and not in a real step)."""
    from radixrt.model import quant_probe

    forced("1")  # type: ignore[operator]
    weights = quant_probe._probe_weights(576, 1536, torch.bfloat16, ("vnni",))
    assert all(w.packed is None for w in weights["dense"])


def _decode(path: Path, plan: QuantPlan | None, pack: bool, fused: bool,
            team: bool = True) -> torch.Tensor:
    model, _ = load_model(path, None, torch.bfloat16, "cpu",
                          model_config=ModelConfig.from_path(path), quant=plan)
    if pack:
        assert pack_dense_weights(model) > 0
    runner = PagedRunner.for_model(model)
    model.fused_decode = model.fused_extend = fused
    model.decode_team = team
    g = torch.Generator().manual_seed(5)
    rows = [runner.new_request() for _ in range(5)]
    logits = [runner.extend(rows, [torch.randint(3, 256, (n,), generator=g).tolist()
                                   for n in (3, 9, 1, 17, 6)])]
    for _ in range(3):
        logits.append(runner.decode(rows, logits[-1].argmax(-1).tolist()))
    if fused and pack:
        stack = model.decode_layers()
        assert isinstance(stack, DecodeLayers)
        assert any(t is not None and (t.is_mkldnn or prepack.is_amx(t))
                   for t in stack.weights)  # the op gets them
    runner.kv_pool.check_invariants()
    return torch.cat(logits)


@needs_onednn
@pytest.mark.parametrize("case", ["bf16-dense", "gguf-vnni-dense-copy"])
def test_a_packed_model_gives_the_plain_models_logits(tmp_path: Path, case: str,
                                                      forced: object, layout: str) -> None:
    """Prefill and decode (the C++ one-call step and the Python layer loop) with every dense
    weight packed: bitwise the unpacked model in oneDNN's layout; in AMX's, the C++ step and
    the layer loop bitwise alike, and close to the unpacked model (bf16 ulps in the matmuls)."""
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    forced("1")  # type: ignore[operator]
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=4, num_hidden_layers=2,
                              tie_word_embeddings=True)
    path, plan = tmp_path / "hf", None
    if case.startswith("gguf"):
        if not vnni_kernel_available():
            pytest.skip("no vnni kernel here")
        path = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_1", "Q8_0")
        plan = QuantPlan("gguf", max_rows_int4=2, max_rows_int8=2, kernel="vnni")
    out = {(pack, fused): _decode(path, plan, pack, fused)
           for pack in (False, True) for fused in (True, False)}
    base = out[(False, False)]
    assert torch.equal(out[(False, True)], base)
    assert torch.equal(out[(True, True)], out[(True, False)])
    if layout == "onednn":
        assert torch.equal(out[(True, True)], base)
    else:
        assert torch.allclose(out[(True, True)], base, rtol=0.02, atol=0.02)
    if plan is not None:  # the dense copies were packed (5 decode rows > max_rows 2)
        model, _ = load_model(path, None, torch.bfloat16, "cpu",
                              model_config=ModelConfig.from_path(path), quant=plan)
        pack_dense_weights(model)
        dense = [m.dense for m in model.modules() if isinstance(m, QuantizedWeight)]
        assert dense and all(d is not None and d.packed is not None for d in dense)


@needs_onednn
def test_extend_steps_over_the_packed_row_limits_are_bitwise_the_loop(
        tmp_path: Path, forced: object, layout: str) -> None:
    """Prefill steps of 250, 300 (above oneDNN's packed rows) and 1110 (above AMX's) tokens
    with every dense weight packed: the C++ extend step picks the weight the Python loop picks
    at each row count, so their logits (every position's) are bitwise alike."""
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    forced("1")  # type: ignore[operator]
    hf = tmp_path / "hf"
    make_tiny_checkpoint(hf, "llama", seed=9, num_hidden_layers=2, tie_word_embeddings=True)
    out = {}
    for fused in (True, False):
        model, _ = load_model(hf, None, torch.bfloat16, "cpu",
                              model_config=ModelConfig.from_path(hf))
        assert pack_dense_weights(model) > 0
        model.fused_extend = fused
        runner = PagedRunner.for_model(model, kv_size=2048)
        g = torch.Generator().manual_seed(2)
        logits = []
        for lens in ((250,), (300,), (370, 370, 370)):
            rows = [runner.new_request() for _ in lens]
            logits.append(runner.extend(rows, [torch.randint(3, 256, (n,), generator=g).tolist()
                                               for n in lens], all_positions=True))
        runner.kv_pool.check_invariants()
        out[fused] = logits
    for a, b in zip(out[True], out[False], strict=True):
        assert torch.equal(a, b), f"{a.shape[0]} rows: max diff {(a - b).abs().max()}"


@needs_onednn
@pytest.mark.parametrize("disable", [False, True])
def test_runner_packs_unless_disabled(tmp_path: Path, forced: object, disable: bool) -> None:
    """`ServerArgs.disable_prepacked_weights` reaches the runner: every dense weight packed by
    default (here forced to pay), none with the flag."""
    forced("1")  # type: ignore[operator]
    r = make_tiny_runner(tmp_path / "hf", dtype="bfloat16", disable_prepacked_weights=disable)
    dense = [m for m in r.model.modules() if isinstance(m, DenseWeight)]
    assert dense
    assert all((m.packed is None) == disable for m in dense)


def test_the_one_call_step_takes_packed_weights_up_to_the_same_rows() -> None:
    """decode_layers.cpp's row limits are prepack's (the C++ step and the Python layers must
    pick the same weight for a call, or their results would differ)."""
    src = (Path(cpu_kernels.__file__).parent / "csrc" / "decode_layers.cpp").read_text()
    assert f"constexpr int64_t kPackedMaxRows = {prepack.PACKED_MAX_ROWS};" in src
    assert f"constexpr int64_t kAmxMaxRows = {prepack.AMX_MAX_ROWS};" in src


def _tiny_packed_model(tmp_path: Path, case: str) -> tuple[Path, QuantPlan | None]:
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama", seed=6, num_hidden_layers=2,
                              tie_word_embeddings=True)
    if case == "bf16-dense":
        return tmp_path / "hf", None
    if not vnni_kernel_available():
        pytest.skip("no vnni kernel here")
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", "llama", "Q4_1", "Q8_0")
    # 5 decode rows > max_rows 2: every layer matmul takes its dense copy
    return path, QuantPlan("gguf", max_rows_int4=2, max_rows_int8=2, kernel="vnni")


def _packed_stack(tmp_path: Path, case: str, forced: object
                  ) -> tuple[Path, QuantPlan | None, DecodeLayers]:
    """`_tiny_packed_model`'s path and plan, and the C++ decode stack of that model with every
    dense weight packed (in the layout the test's fixture chose)."""
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    forced("1")  # type: ignore[operator]
    path, plan = _tiny_packed_model(tmp_path, case)
    model, _ = load_model(path, None, torch.bfloat16, "cpu",
                          model_config=ModelConfig.from_path(path), quant=plan)
    pack_dense_weights(model)
    stack = model.decode_layers()
    assert isinstance(stack, DecodeLayers)
    return path, plan, stack


@needs_onednn
@pytest.mark.parametrize("case", ["bf16-dense", "gguf-vnni-dense-copy"])
def test_a_decode_team_runs_amx_packed_dense_linears(tmp_path: Path, case: str, forced: object,
                                                     amx_layout: None) -> None:
    """AMX-packed dense weights (a bf16 model's, a GGUF model's dense copies above max_rows)
    let the C++ step run as a team of threads up to AMX_MAX_ROWS rows: each member runs its
    share of every amx_linear's N blocks (both call it: twice the calls of a step with a
    parallel region per op), and the logits are bitwise those of the step without the team."""
    path, plan, stack = _packed_stack(tmp_path, case, forced)
    assert stack.team_rows == prepack.AMX_MAX_ROWS and stack.team_capable
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, calls = {}, {}
        for team in (True, False):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out[team] = _decode(path, plan, True, True, team=team)
            counts = {e.key: e.count for e in prof.key_averages()}
            calls[team] = counts.get("radixrt::amx_linear", 0) + counts.get(
                "radixrt::amx_linear_silu", 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[True], out[False])
    # 3 decode steps x 2 layers x 4 calls (qkv, o, gate_up with its SiLU-mul, down), again on
    # the second member; the extend step (the Python layers) and the LM head call them alike in
    # both runs
    assert calls[True] - calls[False] == 3 * 2 * 4


@needs_onednn
@pytest.mark.parametrize("case", ["bf16-dense", "gguf-vnni-dense-copy"])
def test_onednn_packed_dense_linears_keep_the_team_to_the_kernel_rows(
        tmp_path: Path, case: str, forced: object, onednn_layout: None) -> None:
    """oneDNN-packed dense weights run whole on every member of a team, so none forms over
    them: no team for a bf16 model, and a GGUF model's team stops at its max_rows."""
    _, plan, stack = _packed_stack(tmp_path, case, forced)
    assert stack.team_rows == (-1 if plan is None else 2)
