"""The start-up probes' timing loop: variants timed in alternation, each keeping its best.

Taking turns call by call means load from another process hits every variant alike, and the
minimum over the reps rarely keeps it. The dtype probe and the prepack decision time with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

K = TypeVar("K")


def interleaved_best(steps: Mapping[K, Callable[[], object]], *, min_reps: int, max_reps: int,
                     warmup: int = 0, budget_s: float = math.inf) -> dict[K, float]:
    """Best wall time (s) of each step over reps that call every step once, in order: first
    `warmup` untimed reps, then at most `max_reps`, stopping early once `min_reps` are in and
    `budget_s` has passed since the first timed one."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    best = {key: math.inf for key in steps}
    start = time.perf_counter()
    for rep in range(max_reps):
        for key, step in steps.items():
            t0 = time.perf_counter()
            step()
            best[key] = min(best[key], time.perf_counter() - t0)
        if rep + 1 >= min_reps and time.perf_counter() - start > budget_s:
            break
    return best
