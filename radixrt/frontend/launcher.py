"""Process launch and supervision: start the scheduler and detokenizer (one pair per `--dp`
replica), tell when one died, stop them."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

from detok_proc.detokenizer import run_detokenizer
from radixrt.config import ServerArgs, available_cores
from radixrt.core import cpu_policy, ipc


def replica_plan(dp: int, threads: int, cores: list[int]) -> list[tuple[int, list[int] | None]]:
    """(torch threads, CPUs to pin to or None) per replica. One replica keeps today's setup
    (`threads`, unpinned). Several split `threads` evenly (at least 1 each) and, when there are
    at least as many cores as replicas, each gets its own contiguous share of `cores` (the
    first `len(cores) % dp` one more), so replicas never compete for a core."""
    if dp == 1:
        return [(threads, None)]
    per = max(1, threads // dp)
    if len(cores) < dp:
        return [(per, None)] * dp
    base, extra = divmod(len(cores), dp)
    plan, start = [], 0
    for i in range(dp):
        n = base + (i < extra)
        plan.append((per, sorted(cores)[start:start + n]))
        start += n
    return plan


class ChildProcess:
    """A runtime child started with `ipc.spawn_child`."""

    def __init__(self, name: str, popen: subprocess.Popen):
        self.name = name
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.is_alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)


class Launcher:
    """Owns the private socket dir (`paths`) and the children: per replica (`args.dp`) a
    scheduler and its detokenizer (so a stop string's abort goes straight back to the scheduler
    that runs the request, and the per-replica paths stay the single-replica ones).
    `start` spawns them; each reports readiness to the tokenizer socket, which its owner waits
    on (`expected_ready`)."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.paths, self.workdir = ipc.IpcPaths.in_new_tempdir()
        self.replica_paths = ([self.paths] if args.dp == 1 else
                              [self.paths.for_replica(i) for i in range(args.dp)])
        self.plan = replica_plan(args.dp, args.resolved_threads(),
                                 sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else list(range(available_cores())))
        self.children: list[ChildProcess] = []
        self.schedulers: list[ChildProcess] = []
        self.replica_children: dict[int, list[ChildProcess]] = {}

    @staticmethod
    def expected_ready(replicas: int) -> dict[str, int]:
        """How many `ReadyMsg`s the children of `replicas` replicas send, by kind."""
        return {"scheduler": replicas, "detokenizer": replicas}

    def start(self, replicas: Iterable[int] | None = None, dtype: str | None = None) -> None:
        """Spawn the children of `replicas` (default: all), with `dtype` instead of the
        configured one when given (so later replicas reuse the first one's `auto` choice)."""
        # Imported here: the scheduler module pulls in torch and the model code, which only a
        # process that launches a runtime needs.
        from radixrt.sched.scheduler import run_scheduler

        pid = os.getpid()
        for i in range(self.args.dp) if replicas is None else replicas:
            paths, (threads, cpus) = self.replica_paths[i], self.plan[i]
            suffix = "" if self.args.dp == 1 else f"-{i}"
            args = self.args if self.args.dp == 1 else self.args.replace(num_threads=threads)
            if dtype is not None:
                args = args.replace(dtype=dtype)
            sched = ChildProcess(f"scheduler{suffix}", ipc.spawn_child(
                f"scheduler{suffix}", run_scheduler,
                {"args": args, "paths": paths, "parent_pid": pid, "replica": i}, self.workdir,
                # OpenMP reads its settings once, at load: they go in the environment.
                env=cpu_policy.omp_env(threads, self.args.thread_wait),
                cpus=cpus))
            self.children.append(sched)
            self.schedulers.append(sched)
            detok = ChildProcess(f"detokenizer{suffix}", ipc.spawn_child(
                f"detokenizer{suffix}", run_detokenizer,
                {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path,
                 "ipc": paths, "parent_pid": pid, "nice": self.args.helper_nice}, self.workdir,
                env=cpu_policy.helper_env()))
            self.children.append(detok)
            self.replica_children[i] = [sched, detok]
            if i == 0:
                self.scheduler, self.detokenizer = sched, detok

    def dead_child(self) -> str | None:
        """A message naming the first child that exited, or None while all run."""
        for proc in self.children:
            if not proc.is_alive():
                return f"radixrt {proc.name} process died (exit code {proc.exitcode})"
        return None

    def dead_replicas(self) -> dict[int, str]:
        """Replica -> a message naming its first child that exited, for every replica that
        lost a process."""
        out = {}
        for i, procs in self.replica_children.items():
            for proc in procs:
                if not proc.is_alive():
                    out[i] = f"radixrt {proc.name} process died (exit code {proc.exitcode})"
                    break
        return out

    def stop_replica(self, replica: int) -> None:
        """Stop what is left of a replica that lost a process (it can serve nothing now)."""
        for proc in self.replica_children.get(replica, []):
            if proc.is_alive():
                proc.popen.terminate()
        for proc in self.replica_children.get(replica, []):
            proc.stop(timeout_s=2.0)

    def stop(self) -> None:
        for proc in self.children:  # signal all first: replicas shut down in parallel
            if proc.is_alive():
                proc.popen.terminate()
        for proc in self.children:
            proc.stop()

    def remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
