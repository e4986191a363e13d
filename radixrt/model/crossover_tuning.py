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
the kernel won (just below it when that is the first). It only lowers the crossover, never moves calls onto the kernel. The
result holds for the process: the two paths round differently, so a request's output must not
depend on when it ran. `ServerArgs.quant_max_rows` given, `disable_crossover_tuning`, or a plan
without dense copies skips it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.model.linear import QuantizedWeight
from radixrt.model.model_config import ModelConfig

CANDIDATES = (16, 24, 32, 40, 48, 56, 64)
REPS = 5
MARGIN = 1.05


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
    """The model's quantized weights that keep a dense copy (their max_rows is the crossover)."""
    return [m for m in model.modules() if isinstance(m, QuantizedWeight) and m.dense is not None]


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


def describe(result: tuple[int, int, list[CrossoverTiming]]) -> str:
    old, new, timings = result
    rows = ", ".join(f"{t.rows} rows {t.kernel_ms:.1f} / {t.dense_ms:.1f} ms" for t in timings)
    return f"max_rows {old} -> {new} (extend steps, kernel / dense copy: {rows or 'none timed'})"
