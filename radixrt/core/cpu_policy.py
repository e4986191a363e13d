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
