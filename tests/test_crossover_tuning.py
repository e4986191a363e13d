"""crossover_tuning: the start-up timing of a quantized model's own extend steps that lowers the
row count from which its matmuls take their dense copies. The decision rule; a real measurement
on a tiny GGUF model leaves its weights and pools as it found them; a tuned runner computes what
a runner given that crossover computes, its C++ decode stack included; and the runner applies it
only where the crossover was not given. The LM head's own crossover, timed on its own calls:
its rule (every call where the kernel wins throughout), that the extend-step tuning leaves the
head alone, that a measurement restores it, and that the head computes on the path it chose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_checkpoint, write_tiny_gguf

from radixrt.config import ServerArgs
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.model import crossover_tuning as ct
from radixrt.model import runner as runner_mod
from radixrt.model.decode_layers import KIND_QGEMV, KIND_VNNI, DecodeLayers
from radixrt.model.quant import EVERY_CALL, QuantPlan
from radixrt.model.quant_matmul import resolve_quant_kernel

T = ct.CrossoverTiming


@pytest.mark.parametrize(("current", "timings", "want"), [
    (64, [T(16, 1, 2), T(24, 1, 2), T(32, 1, 2)], 64),  # the kernel wins every count timed
    (64, [T(16, 1, 2), T(24, 2, 1)], 20),  # midway between the last win and the first loss
    (64, [T(16, 2, 1)], 15),  # a loss at the first count: just below it
    (64, [T(16, 1, 2), T(24, 1.04, 1)], 64),  # within the margin: not a loss
    (20, [T(16, 1, 2), T(24, 2, 1)], 20),  # never above the plan's crossover
    (16, [T(24, 2, 1)], 16),  # counts above it are not considered
    (64, [T(32, 2, 1), T(16, 1, 2)], 24),  # order of the timings does not matter
])
def test_choose_crossover(current: int, timings: list[ct.CrossoverTiming], want: int) -> None:
    assert ct.choose_crossover(current, timings) == want


def _q8_gguf(factory: pytest.TempPathFactory, tied: bool, seed: int) -> Path:
    """A tiny llama GGUF with every matrix (and the embedding / LM head) in Q8_0."""
    d = factory.mktemp("tiny_crossover")
    model = make_tiny_checkpoint(d, "llama", seed=seed, tie_word_embeddings=tied)
    return write_tiny_gguf(model, d / "tiny.Q8_0.gguf", "llama", matrix_qtype="Q8_0",
                           embd_qtype="Q8_0")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _q8_gguf(tmp_path_factory, tied=True, seed=5)


def _runner(path: Path, max_rows: int | None, ctx: int = 128) -> runner_mod.ModelRunner:
    return runner_mod.ModelRunner(ServerArgs(
        model_path=str(path), dtype="bfloat16", quantization="gguf", quant_max_rows=max_rows,
        quant_kernel=resolve_quant_kernel("auto"), max_total_tokens=512, max_context_len=ctx,
        max_running_requests=4, attention_backend="torch"))


def _extend_logits(r: runner_mod.ModelRunner, n: int) -> torch.Tensor:
    rp, kp = r.req_to_token_pool, r.token_to_kv_pool
    req, slots = rp.alloc(), kp.alloc(n)
    assert req is not None and slots is not None
    try:
        rp.write([req], [0], [n], slots)
        ids = torch.arange(3, 3 + n) % 50 + 3
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [req], [0], [n], rp.req_to_token,
                                r.device)
        return r.forward(fb)
    finally:
        kp.free(slots)
        rp.free(req)


def test_measure_leaves_weights_and_pools_as_it_found_them(tiny_gguf: Path) -> None:
    r = _runner(tiny_gguf, 64)
    weights = ct.dense_copy_weights(r.model)
    assert weights and all(w.max_rows == 64 for w in weights)
    rp, kp = r.req_to_token_pool, r.token_to_kv_pool
    free = (rp.available_size(), kp.available_size())
    before = _extend_logits(r, 24)
    timings = ct.measure(r, weights, (16, 24), reps=1)
    assert [t.rows for t in timings] in ([16, 24], [16]) and all(
        t.kernel_ms > 0 and t.dense_ms > 0 for t in timings)
    if len(timings) == 1:  # stopped at the first loss
        assert timings[0].dense_wins()
    assert all(w.max_rows == 64 for w in weights)
    assert (rp.available_size(), kp.available_size()) == free
    rp.check_invariants()
    kp.check_invariants()
    assert torch.equal(_extend_logits(r, 24), before)


def _stack_max_rows(r: runner_mod.ModelRunner) -> set[int]:
    stack = r.model.decode_layers()
    assert isinstance(stack, DecodeLayers), stack
    meta = stack.meta
    return {meta[3 * i + 2] for i in range(len(meta) // 3) if meta[3 * i] in (KIND_QGEMV, KIND_VNNI)}


def test_tuned_runner_computes_what_a_runner_given_that_crossover_does(tiny_gguf: Path) -> None:
    r, ref = _runner(tiny_gguf, 64), _runner(tiny_gguf, 20)
    assert _stack_max_rows(r) == {64}  # built before the tuning: must be rebuilt
    calls: list[list[int]] = []

    def fake(runner: object, weights: object, candidates: list[int]) -> list[ct.CrossoverTiming]:
        calls.append(list(candidates))
        return [T(16, 1.0, 2.0), T(24, 2.0, 1.0)]

    assert ct.tune_crossover(r, fake)[:2] == (64, 20)
    assert calls == [[16, 24, 32, 40, 48, 56, 64]]
    assert {w.max_rows for w in ct.dense_copy_weights(r.model)} == {20}
    assert _stack_max_rows(r) == {20}
    for n in (20, 21):  # the last row count on the kernel, the first on the dense copy
        assert torch.equal(_extend_logits(r, n), _extend_logits(ref, n)), n
    assert not torch.equal(_extend_logits(r, 21), _extend_logits(_runner(tiny_gguf, 64), 21))


def test_only_row_counts_that_fit_a_request_are_timed(tiny_gguf: Path) -> None:
    calls: list[list[int]] = []

    def fake(runner: object, weights: object, candidates: list[int]) -> list[ct.CrossoverTiming]:
        calls.append(list(candidates))
        return []

    assert ct.tune_crossover(_runner(tiny_gguf, 64, ctx=40), fake)[:2] == (64, 64)
    assert calls == [[16, 24, 32, 40]]  # a request's context holds 40 tokens


@pytest.mark.parametrize(("timings", "want"), [
    ([T(8, 1, 2), T(16, 1, 2), T(512, 1, 2)], EVERY_CALL),  # won throughout, the last by 2x
    ([T(8, 1, 2), T(512, 1, 1.1)], 512),  # the last won within EVERY_CALL_MARGIN
    ([T(8, 1, 2), T(16, 1, 2), T(32, 2, 1)], 24),  # midway to the first loss
    ([T(8, 2, 1)], 7),  # a loss at the first count
    ([T(8, 1, 2), T(16, 1.04, 1)], 16),  # within MARGIN: not a loss, but not every call
    ([], 0),
])
def test_head_crossover(timings: list[ct.CrossoverTiming], want: int) -> None:
    assert ct.head_crossover(timings) == want


def test_extend_tuning_leaves_the_lm_head_to_its_own(tiny_gguf: Path) -> None:
    r = _runner(tiny_gguf, 64)
    head = ct.lm_head_weight(r.model)
    assert head is r.model.lm_head and head.dense is not None  # tied Q8_0: kept with its table
    weights = ct.dense_copy_weights(r.model)
    assert weights and head not in weights  # extend steps call it on one row per request
    assert ct.tune_crossover(r, lambda *a: [T(16, 2.0, 1.0)])[:2] == (64, 15)
    assert {w.max_rows for w in weights} == {15} and head.max_rows == 64


def test_measure_head_restores_the_head_and_stops_at_the_first_loss(tiny_gguf: Path) -> None:
    r = _runner(tiny_gguf, 64)
    head = ct.lm_head_weight(r.model)
    assert head is not None
    timings = ct.measure_head(head, (2, 4, 8), torch.bfloat16, reps=1)
    rows = [t.rows for t in timings]
    assert rows == [2, 4, 8][: len(rows)] and all(t.kernel_ms > 0 and t.dense_ms > 0
                                                 for t in timings)
    assert all(not t.dense_wins() for t in timings[:-1])
    assert len(rows) == 3 or timings[-1].dense_wins()
    assert head.max_rows == 64
    # no count is started once the budget is spent (the first always is)
    assert [t.rows for t in ct.measure_head(head, (2, 4, 8), torch.bfloat16, reps=1,
                                            budget_s=0.0)] == [2]


@pytest.mark.parametrize(("timings", "path"), [
    ([T(8, 1.0, 2.0), T(16, 1.0, 2.0)], "kernel"),  # every call: 40 rows stay on the kernel
    ([T(8, 1.0, 2.0), T(16, 2.0, 1.0)], "dense"),  # crossover 12: 40 rows on the dense copy
])
def test_tuned_head_computes_on_the_path_it_chose(tiny_gguf: Path, timings: list[T],
                                                  path: str) -> None:
    r = _runner(tiny_gguf, 64)
    head = ct.lm_head_weight(r.model)
    assert head is not None and head.dense is not None
    x = torch.randn(40, head.in_features, generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16)
    kernel, dense = head.kernel.forward_f32(x), head.dense.logits(x)
    assert not torch.equal(kernel, dense)  # the two paths round differently
    seen: list[tuple[int, ...]] = []

    def fake(h: object, candidates: tuple[int, ...], dtype: torch.dtype) -> list[T]:
        assert h is head and dtype == torch.bfloat16
        seen.append(tuple(candidates))
        return timings

    old, new, _ = ct.tune_head_crossover(r.model, torch.bfloat16, fake)
    assert seen == [ct.HEAD_CANDIDATES] and old == 64
    assert head.max_rows == new == (EVERY_CALL if path == "kernel" else 12)
    assert torch.equal(head.logits(x), kernel if path == "kernel" else dense)
    # batch-invariant calls (prompt scoring) took the dense copy whenever there was one: a head
    # on the kernel for every call keeps none, so they compute as a start that never had one
    assert (head.dense is None) == (path == "kernel")
    assert torch.equal(head.logits(x, invariant=True), kernel if path == "kernel" else dense)


@pytest.mark.parametrize(("max_rows", "disabled", "tuned"), [
    (None, False, True), (64, False, False), (None, True, False)])
def test_runner_tunes_only_a_crossover_it_was_not_given(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, max_rows: int | None, disabled: bool,
        tuned: bool) -> None:
    kernel = resolve_quant_kernel("auto")
    # 4-bit weights without dense copies (EVERY_CALL) must stay so; the 8-bit ones keep one
    monkeypatch.setattr(runner_mod, "resolve_quantization", lambda *a, **k: (
        QuantPlan("gguf", EVERY_CALL, 64, kernel=kernel), "fixed"))
    monkeypatch.setattr(runner_mod, "tune_crossover", lambda r: (64, 36, []))
    monkeypatch.setattr(runner_mod, "tune_head_crossover", lambda m, d: (64, 300, []))
    r = runner_mod.ModelRunner(ServerArgs(
        model_path=str(tiny_gguf), dtype="bfloat16", quantization="gguf",
        quant_max_rows=max_rows, quant_kernel=kernel, max_total_tokens=256,
        attention_backend="torch", disable_crossover_tuning=disabled))
    assert (r.quant.max_rows_int4, r.quant.max_rows_int8) == (EVERY_CALL, 36 if tuned else 64)
    assert r.quant.max_rows_head == (300 if tuned else None)
    assert ("LM head up to 300 rows" in r.quant.describe()) == tuned


@pytest.fixture(scope="module")
def untied_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _q8_gguf(tmp_path_factory, tied=False, seed=6)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("timings", "want"), [
    ([T(8, 1.0, 2.0), T(16, 2.0, 1.0)], 12),  # the dense copy wins from 16 rows: kept
    ([T(8, 1.0, 2.0), T(16, 1.0, 2.0)], EVERY_CALL),  # the kernel wins throughout: dropped
])
def test_the_head_follows_its_own_timing_whatever_the_probe_said(
        tiny_gguf: Path, untied_gguf: Path, monkeypatch: pytest.MonkeyPatch, tied: bool,
        timings: list[T], want: int) -> None:
    """The probe's 8-bit outcome (every call, or a crossover with dense copies) split between
    starts on one machine (stop 82); the LM head's path after its own timing must not follow
    it, or two starts would compute its logits differently."""
    kernel = resolve_quant_kernel("auto")
    path = tiny_gguf if tied else untied_gguf
    monkeypatch.setattr(runner_mod, "tune_crossover", lambda r: None)
    monkeypatch.setattr(runner_mod, "tune_head_crossover",
                        lambda m, d: ct.tune_head_crossover(m, d, lambda *a: timings))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    seen = []
    for int8_rows in (EVERY_CALL, 64):  # the probe's two outcomes for the 8-bit width
        plan = QuantPlan("gguf", EVERY_CALL, int8_rows, kernel=kernel)
        monkeypatch.setattr(runner_mod, "resolve_quantization",
                            lambda *a, plan=plan, **k: (plan, "fixed"))
        r = runner_mod.ModelRunner(ServerArgs(
            model_path=str(path), dtype="bfloat16", quantization="gguf", quant_kernel=kernel,
            max_total_tokens=256, attention_backend="torch"))
        head = r.model.lm_head
        assert r.quant.time_head and head.in_features == x.shape[1]
        assert head.max_rows == want and (head.dense is None) == (want == EVERY_CALL)
        copy = ct.own_head_copy(r.model)
        assert (copy is None) == (tied or want == EVERY_CALL)
        seen.append((head.logits(x), head.logits(x, invariant=True)))
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))


def test_without_head_tuning_the_head_follows_its_width(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--disable-crossover-tuning`: no timing, so no copy kept for one: an 8-bit width on the
    kernel for every call leaves the head without a dense copy, as before stop 83."""
    kernel = resolve_quant_kernel("auto")
    monkeypatch.setattr(runner_mod, "resolve_quantization", lambda *a, **k: (
        QuantPlan("gguf", EVERY_CALL, EVERY_CALL, kernel=kernel), "fixed"))
    r = runner_mod.ModelRunner(ServerArgs(
        model_path=str(tiny_gguf), dtype="bfloat16", quantization="gguf", quant_kernel=kernel,
        max_total_tokens=256, attention_backend="torch", disable_crossover_tuning=True))
    assert not r.quant.time_head and r.model.lm_head.dense is None


@pytest.fixture(scope="module")
def smollm2_layout_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's GGUF layout: Q4_1 matrices, a tied Q8_0 embedding (the only 8-bit weight is
    the LM head)."""
    d = tmp_path_factory.mktemp("tiny_smol_layout")
    model = make_tiny_checkpoint(d, "llama", seed=7, tie_word_embeddings=True)
    return write_tiny_gguf(model, d / "tiny.Q4_1.gguf", "llama", matrix_qtype="Q4_1",
                           embd_qtype="Q8_0")


@pytest.mark.parametrize(("max_rows_int8", "head_wins"), [
    (64, True), (EVERY_CALL, True), (64, False)])
def test_engine_info_describes_the_weights_not_the_plan(
        smollm2_layout_gguf: Path, monkeypatch: pytest.MonkeyPatch, max_rows_int8: int,
        head_wins: bool) -> None:
    """On Zen 3 the quantization probe put the 8-bit width at 512 rows in one start and at every
    call in the next; with SmolLM2 only the LM head is 8-bit and its own timing decides where it
    runs, so both starts compute alike and must say so (`engine.info["quantization"]`)."""
    kernel = resolve_quant_kernel("auto")
    monkeypatch.setattr(runner_mod, "resolve_quantization", lambda *a, **k: (
        QuantPlan("gguf", EVERY_CALL, max_rows_int8, kernel=kernel), "fixed"))
    monkeypatch.setattr(runner_mod, "tune_crossover", lambda r: None)  # no 4-bit dense copies
    timings = [T(8, 1.0, 2.0), T(16, 1.0 if head_wins else 2.0, 2.0 if head_wins else 1.0)]
    monkeypatch.setattr(runner_mod, "tune_head_crossover",
                        lambda m, d: ct.tune_head_crossover(m, d, lambda *a: timings))
    r = runner_mod.ModelRunner(ServerArgs(
        model_path=str(smollm2_layout_gguf), dtype="float32", quantization="gguf",
        quant_kernel=kernel, max_total_tokens=256, attention_backend="torch"))
    name = r.model.lm_head.kernel.name
    head = "every call" if head_wins else "up to 12 rows, dense above"
    assert r.describe_quantization() == (
        f"gguf ({name} kernel; layers 4-bit: every call; LM head 8-bit: {head})")
    # the plan's own text still names the 8-bit width's probe result, which no weight follows
    assert ("up to 64 rows (8-bit)" in r.quant.describe()) == (max_rows_int8 == 64)
    # read from the live weights: a head moved later is described where it now runs
    r.model.lm_head.max_rows, r.model.lm_head.dense = EVERY_CALL, None
    assert r.describe_quantization().endswith("LM head 8-bit: every call)")
