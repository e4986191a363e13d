"""How the runtime's processes share the CPU: thread counts, OpenMP waiting, priorities.

The scheduler is the only process doing tensor work. Its intra-op threads (OpenMP, used by
ATen and MKL) meet at a barrier after every parallel region, a few hundred times per decode
step. When another process holds one of their cores, a thread that *spins* at the barrier burns
its time slice waiting for a peer that cannot run, and every region stalls for a scheduler
tick: on the shared 2-core machine a bare batch-8 decode step took 2.0-2.7 s with OpenMP's
default spinning against 0.37-0.59 s with passive waiting (bench/results/*-step-overhead.md).
So:

- the scheduler's OpenMP threads spin only briefly at a barrier, then sleep (`ServerArgs.
  thread_wait` "brief"; "passive" sleeps at once, which made every one of a decode step's few
  hundred regions pay a futex wake-up: a batch-1 step 13.6 ms passive vs 7.6 ms brief), set
  through the environment of the child *before* it loads the OpenMP runtime (GNU libgomp reads
  `OMP_WAIT_POLICY` / `GOMP_SPINCOUNT`, Intel's libiomp `KMP_BLOCKTIME`, once, at load);
- helper processes (the detokenizer; the HTTP server's own process under `radixrt serve`) do no
  tensor work: one torch thread, passive, and a lower priority (`ServerArgs.helper_nice`), so
  the little work they do per step yields to the scheduler instead of preempting its threads.

No affinity is set: pinning the scheduler's threads would stop the kernel from moving them off a
core another process holds, which is the case this policy is for.
"""

from __future__ import annotations

import logging
import os
import time

from radixrt.config import THREAD_WAITS

logger = logging.getLogger(__name__)


# "brief": spin iterations of libgomp's wait loop before sleeping (each a `pause`, tens of ns:
# ~tens of us in all), and Intel libiomp's equivalent (ms, its smallest non-zero value).
BRIEF_SPINCOUNT = 3000
BRIEF_BLOCKTIME_MS = 1


def omp_env(threads: int, wait: str) -> dict[str, str | None]:
    """Environment for a process whose torch runs `threads` OpenMP threads waiting per `wait`:
    "brief" spins BRIEF_SPINCOUNT iterations at a barrier, then sleeps (a decode step's next
    parallel region, microseconds later, finds its threads awake; a peer preempted by another
    process costs at most that spin); "passive" sleeps at once (every region pays a futex wake);
    "spin" keeps the OpenMP runtime's default (spin up to ~0.1-1 ms, then sleep). A None value
    means "unset": an inherited OMP_WAIT_POLICY would override "brief"'s spin count."""
    if wait not in THREAD_WAITS:
        raise ValueError(f"thread_wait must be one of {THREAD_WAITS}, got {wait!r}")
    env: dict[str, str | None] = {"OMP_NUM_THREADS": str(threads),
                                  "MKL_NUM_THREADS": str(threads)}
    if wait == "passive":
        env.update({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"})
    elif wait == "brief":
        env.update({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": str(BRIEF_SPINCOUNT),
                    "KMP_BLOCKTIME": str(BRIEF_BLOCKTIME_MS)})
    return env


def helper_env() -> dict[str, str]:
    """Environment of a helper process: one thread everywhere, never spinning."""
    env = {k: v for k, v in omp_env(1, "passive").items() if v is not None}
    return {**env, "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def become_helper(nice: int) -> None:
    """Called by a helper process on itself: one torch thread (no pool to spin up, whatever its
    environment said) and `nice` added to its priority. Never raises: a process that may not
    change its priority keeps it (logged)."""
    for var, val in helper_env().items():
        os.environ.setdefault(var, val)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    if nice > 0:
        try:
            os.nice(nice)
        except OSError as e:  # pragma: no cover - e.g. a sandbox forbidding it
            logger.warning("could not lower this process's priority: %s", e)


# -- start-up probes on a quiet CPU -------------------------------------------------------------
# The scheduler's start-up probes (dtype, quantized kernels, prepacked weights) time kernels on
# its threads and keep what they decide for the process's life. Started beside it, the
# detokenizer and the HTTP process import their libraries and load a tokenizer for a second or
# two, and a probe that overlaps them reads distorted ratios: bf16 over fp32 read 1.27-1.57x at
# `radixrt serve` starts on an AMX Xeon where a quiet probe reads 2.0-2.6x, and one start chose
# 2x slower prefill matmuls from such a reading. So before its first probe times anything, the
# model runner waits, a bounded time, until the other processes leave its cores alone
# (`QuietBeforeTiming`); a runner whose choices are all given (no probe) never waits.

def _busy_ticks(cpus: set[int] | None) -> int | None:
    """Busy clock ticks (user, nice, system, irq, softirq) summed over `cpus` (None: all), from
    /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or len(fields) < 7:
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
        total += user + nice + system + irq + softirq
    return total


def _own_ticks() -> int | None:
    """This process's CPU time (every thread, user + system) in clock ticks."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)


def other_cpu_use(interval_s: float = 0.2) -> float | None:
    """How many cores' worth of CPU time every other process used over the next `interval_s` on
    the CPUs this process may run on; None where /proc cannot tell."""
    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    b0, o0, t0 = _busy_ticks(cpus), _own_ticks(), time.monotonic()
    if b0 is None or o0 is None:
        return None
    time.sleep(interval_s)
    b1, o1, t1 = _busy_ticks(cpus), _own_ticks(), time.monotonic()
    if b1 is None or o1 is None:
        return None
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((b1 - b0) - (o1 - o0)) / ticks_per_s / (t1 - t0))


def wait_for_quiet_cpus(max_wait_s: float, threshold_cores: float = 0.25,
                        interval_s: float = 0.2) -> tuple[float, float | None]:
    """Sleeps until other processes use under `threshold_cores` of this process's CPUs (each
    reading over `interval_s`), or `max_wait_s` has passed; returns (seconds waited, the last
    reading: None where /proc cannot tell, which returns at once)."""
    start = time.monotonic()
    while True:
        use = other_cpu_use(interval_s)
        waited = time.monotonic() - start
        if use is None or use < threshold_cores or waited >= max_wait_s:
            return waited, use


class QuietBeforeTiming:
    """Waits for quiet CPUs (`wait_for_quiet_cpus(max_wait_s)`, logged) the first time it is
    called, never again; with max_wait_s 0 it never waits. The model runner calls it before each
    start-up probe."""

    def __init__(self, max_wait_s: float):
        self.max_wait_s = max_wait_s
        self.done = max_wait_s <= 0

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        waited, use = wait_for_quiet_cpus(self.max_wait_s)
        logger.info("start-up probes: waited %.1f s for other processes to leave the CPUs (their "
                    "use at the last reading: %s cores)", waited,
                    "unknown" if use is None else f"{use:.2f}")
