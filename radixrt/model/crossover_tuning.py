"""Where a quantized model's matmuls leave their weight-only kernel for the dense copy, measured
on the loaded model's own extend steps at start-up.

`quant_probe` places that crossover (`QuantPlan.max_rows_*`) from matmuls timed alone, against
plain dense weights. In the model the dense copies are prepacked (AMX tiles where the CPU has
them) and the kernel path has fused neighbours, so the two can disagree: on the AMX Xeon (stop
68) the probe kept SmolLM2's Q8_0 weights on the vnni kernel up to 64 rows, while real extend
steps of 48 and 64 new tokens ran 1.07x and 1.15-1.18x faster on the dense copies (32 tied, 16
was 1.2-1.4x faster on the kernel); decode steps agreed (stop 67: 1.04x at 48 rows, 1.08x at 64).

`tune_crossover` times extend steps of r new tokens for r in CANDIDATES up to the plan's
crossover, on one scratch request whose slots it frees again: every dense-copy weight on its
kernel (max_rows = r), then on its dense copy (max_rows = r - 1), alternated, one warm-up round
and REPS timed ones, the best of each kept. Ascending, the first count where the dense copy is
MARGIN x faster ends the search and the crossover moves to midway between it and the last count
the kernel won (just below it when that is the first). It only lowers the crossover, never moves
calls onto the kernel. The result holds for the process: the two paths round differently, so a
request's output must not depend on when it ran. `ServerArgs.quant_max_rows` given,
`disable_crossover_tuning`, or a plan without dense copies skips it.

The LM head is not among the weights timed that way: an extend step calls it on one row per
request, so its path never changes there, and with SmolLM2's GGUF (4-bit layers on the kernel
for every call, the tied Q8_0 head the only weight with a dense copy) the tuning compared two
identical steps and moved the head's crossover on noise (15, 28 and 128 rows in three starts
on Zen 3, stops 75-76). Its calls have one row per decode request (or per scored prompt token),
and its shape is unlike the layers' the probe times: on Zen 3 (fp32, AVX2) a dense GEMM of
64 x 576 by 576 x 49152 ran at 72-95 GFLOP/s against 172 on 2048^3, and the vnni kernel was
faster at every count from 1 to 1024 rows (17.8 against 36.6 ms at 64, 147 against 191 at
512). `tune_head_crossover` times the head's own call (as a greedy decode step runs it: logits
and their argmax) on random rows, kernel against dense copy, for r in HEAD_CANDIDATES
ascending, and sets its crossover from those alone, above the probe's as well as below: the
first count where the dense copy wins by MARGIN ends it as above; a kernel that wins at every
count, the last by EVERY_CALL_MARGIN, runs every call (its time per row is flat from 64 rows,
a dense GEMM's stops improving by ~512) and drops its dense copy, which batch-invariant calls
would otherwise still take. The head keeps a dense copy at load for this whatever the probe said
of its width (`QuantPlan.time_head`, stop 83), so the probe's margin at 512 rows, which split
between starts on one machine, no longer decides whether the head is timed at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.model.linear import QuantizedWeight
from radixrt.model.model_config import ModelConfig
from radixrt.model.probe_timing import interleaved_best
from radixrt.model.quant import EVERY_CALL

CANDIDATES = (16, 24, 32, 40, 48, 56, 64)
REPS = 5
MARGIN = 1.05
HEAD_CANDIDATES = (8, 16, 32, 64, 128, 256, 512)
HEAD_REPS = 2
HEAD_BUDGET_S = 4.0  # no further head row count is started after this long
EVERY_CALL_MARGIN = 1.15


class ExtendRunner(Protocol):
    """What the measurement uses of a `ModelRunner` (runner.py, which calls this module)."""

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    model: Any  # LlamaForCausalLM: modules(), reset_decode_layers()
    model_config: ModelConfig
    device: torch.device

    def forward(self, fb: ForwardBatch) -> torch.Tensor: ...


@dataclass(frozen=True)
class CrossoverTiming:
    """One row count's best extend-step times (ms) on the kernel and on the dense copies."""

    rows: int
    kernel_ms: float
    dense_ms: float

    def dense_wins(self, margin: float = MARGIN) -> bool:
        return self.dense_ms * margin <= self.kernel_ms


def choose_crossover(current: int, timings: Sequence[CrossoverTiming],
                     margin: float = MARGIN) -> int:
    """The crossover (largest row count run on the kernel) after `timings`, ascending; never
    above `current`. See the module docstring."""
    last_win = 0
    for t in sorted(timings, key=lambda t: t.rows):
        if t.rows > current:
            break
        if t.dense_wins(margin):
            return min(current, (last_win + t.rows) // 2 if last_win else t.rows - 1)
        last_win = t.rows
    return current


def dense_copy_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The model's quantized weights that keep a dense copy (their max_rows is the crossover),
    the LM head aside (`lm_head_weight`: extend steps do not exercise its crossover)."""
    head = lm_head_weight(model)
    return [m for m in model.modules()
            if isinstance(m, QuantizedWeight) and m.dense is not None and m is not head]


def lm_head_weight(model: torch.nn.Module) -> QuantizedWeight | None:
    """The model's LM head where it is quantized and keeps a dense copy, else None."""
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, QuantizedWeight) and head.dense is not None else None


def own_head_copy(model: torch.nn.Module) -> torch.Tensor | None:
    """The quantized LM head's dense copy where it holds memory of its own (None where there is
    none, or where it is the tied embedding table, which the embedding lookup keeps anyway)."""
    head = lm_head_weight(model)
    if head is None or head.dense is None:
        return None
    w = head.dense.weight
    return None if w is getattr(model, "embed_tokens", None) else w


def set_max_rows(model: torch.nn.Module, weights: Sequence[QuantizedWeight],
                 rows: Callable[[QuantizedWeight], int]) -> None:
    """Every weight's max_rows to `rows(weight)`, and the model's one-call decode stack rebuilt
    from them (it copies max_rows when built)."""
    for w in weights:
        w.max_rows = rows(w)
    model.reset_decode_layers()


def measure(runner: ExtendRunner, weights: Sequence[QuantizedWeight],
            candidates: Sequence[int], reps: int = REPS) -> list[CrossoverTiming]:
    """Best extend-step times at each of `candidates` new tokens, kernel against dense copy,
    ascending, stopping after the first count where the dense copy wins (see module docstring).
    Restores each weight's max_rows and frees the scratch request's row and slots."""
    rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool
    model = runner.model
    saved = {id(w): w.max_rows for w in weights}
    n = max(candidates)
    req = rp.alloc()
    slots = kp.alloc(n) if req is not None else None
    if req is None or slots is None:
        if req is not None:
            rp.free(req)
        return []
    out: list[CrossoverTiming] = []
    try:
        rp.write([req], [0], [n], slots)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, runner.model_config.vocab_size, (n,), generator=g)
        for r in sorted(candidates):
            fb = ForwardBatch.build(ForwardMode.EXTEND, ids[:r], [req], [0], [r],
                                    rp.req_to_token, runner.device)
            best = {True: float("inf"), False: float("inf")}
            for rep in range(reps + 1):  # the first round warms both paths up
                for on_kernel in (True, False):
                    set_max_rows(model, weights, lambda _w: r if on_kernel else r - 1)  # noqa: B023
                    t0 = time.perf_counter()
                    runner.forward(fb)
                    if rep:
                        best[on_kernel] = min(best[on_kernel], time.perf_counter() - t0)
            out.append(CrossoverTiming(r, best[True] * 1e3, best[False] * 1e3))
            if out[-1].dense_wins():
                break
    finally:
        set_max_rows(model, weights, lambda w: saved[id(w)])
        kp.free(slots)
        rp.free(req)
    return out


def tune_crossover(runner: ExtendRunner,
                   measure_fn: Callable[..., list[CrossoverTiming]] = measure
                   ) -> tuple[int, int, list[CrossoverTiming]] | None:
    """Measure and apply the crossover (module docstring): (old, new, timings), or None where
    no weight keeps a dense copy. Weights whose max_rows is below a new crossover keep theirs."""
    weights = dense_copy_weights(runner.model)
    if not weights:
        return None
    current = max(w.max_rows for w in weights)
    # one request of r tokens must fit its context and the free KV slots
    room = min(runner.req_to_token_pool.max_context_len,
               runner.token_to_kv_pool.available_size())
    candidates = [r for r in CANDIDATES if r <= min(current, room)]
    timings = measure_fn(runner, weights, candidates) if candidates else []
    new = choose_crossover(current, timings)
    if new < current:
        set_max_rows(runner.model, weights, lambda w: min(w.max_rows, new))
    return current, new, timings


def _greedy_head(head: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the head's logits, as a greedy decode step computes it
    (`LlamaForCausalLM._head`, then the sampler's argmax where the kernel picked none)."""
    ids = head.greedy_ids(x)
    if ids is not None:
        return ids
    logits, ids = head.logits_argmax(x)
    return logits.argmax(-1) if ids is None else ids


def _head_call(head: QuantizedWeight, x: torch.Tensor, max_rows: int) -> None:
    """`_greedy_head` on x with the head's crossover at `max_rows`."""
    head.max_rows = max_rows
    _greedy_head(head, x)


def measure_head(head: QuantizedWeight, candidates: Sequence[int], dtype: torch.dtype,
                 reps: int = HEAD_REPS, budget_s: float = HEAD_BUDGET_S
                 ) -> list[CrossoverTiming]:
    """Best times of the head's greedy call on r random rows (`dtype`) at each of `candidates`,
    on its kernel (max_rows = r) against its dense copy (r - 1), alternated
    (`probe_timing.interleaved_best`, one untimed call of each before the first count);
    ascending, stopping after the first count where the dense copy wins and starting none after
    `budget_s`. Restores the head's max_rows."""
    saved = head.max_rows
    out: list[CrossoverTiming] = []
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    try:
        for i, r in enumerate(sorted(candidates)):
            if out and time.perf_counter() - start > budget_s:
                break
            x = torch.randn(r, head.in_features, generator=g).to(dtype)
            best = interleaved_best({True: partial(_head_call, head, x, r),
                                     False: partial(_head_call, head, x, r - 1)},
                                    min_reps=reps, max_reps=reps, warmup=1 if i == 0 else 0)
            out.append(CrossoverTiming(r, best[True] * 1e3, best[False] * 1e3))
            if out[-1].dense_wins():
                break
    finally:
        head.max_rows = saved
    return out


def head_crossover(timings: Sequence[CrossoverTiming], margin: float = MARGIN,
                   every_call_margin: float = EVERY_CALL_MARGIN) -> int:
    """The LM head's crossover after `timings` (module docstring): `choose_crossover` without
    a ceiling, and EVERY_CALL where the kernel won every count and the last by
    `every_call_margin` (else the last count won); 0 with no timing."""
    if not timings:
        return 0
    ordered = sorted(timings, key=lambda t: t.rows)
    last = ordered[-1]
    new = choose_crossover(last.rows, ordered, margin)
    if new == last.rows and last.dense_ms >= every_call_margin * last.kernel_ms:
        return EVERY_CALL
    return new


def tune_head_crossover(model: torch.nn.Module, dtype: torch.dtype,
                        measure_fn: Callable[..., list[CrossoverTiming]] = measure_head
                        ) -> tuple[int, int, list[CrossoverTiming]] | None:
    """Measure and apply the LM head's crossover (module docstring): (old, new, timings), or
    None where the head keeps no dense copy or nothing was timed. A head that runs every call
    drops its dense copy: otherwise batch-invariant calls (prompt scoring) would still take it,
    so a start whose quantization probe kept one for the 8-bit width (on Zen 3 one of three)
    would score prompts unlike a start where it kept none (stop 82)."""
    head = lm_head_weight(model)
    if head is None:
        return None
    timings = measure_fn(head, HEAD_CANDIDATES, dtype)
    if not timings:
        return None
    old = head.max_rows
    head.max_rows = head_crossover(timings)
    if head.max_rows >= EVERY_CALL:
        head.dense = None
    return old, head.max_rows, timings


def describe(result: tuple[int, int, list[CrossoverTiming]], timed: str = "extend steps") -> str:
    old, new, timings = result

    def n(rows: int) -> str:
        return "every call" if rows >= EVERY_CALL else str(rows)

    rows = ", ".join(f"{t.rows} rows {t.kernel_ms:.1f} / {t.dense_ms:.1f} ms" for t in timings)
    return f"max_rows {n(old)} -> {n(new)} ({timed}, kernel / dense copy: {rows or 'none timed'})"
