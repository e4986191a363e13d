"""Process launch and supervision: start the scheduler and detokenizer, tell when one died,
stop them."""

from __future__ import annotations

import os
import shutil
import subprocess

from detok_proc.detokenizer import run_detokenizer
from radixrt.config import ServerArgs
from radixrt.core import cpu_policy, ipc


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
    """Owns the private socket dir (`paths`) and the two children. `start` spawns them; each
    reports readiness to the tokenizer socket, which its owner waits on."""

    PROCESSES = ("scheduler", "detokenizer")

    def __init__(self, args: ServerArgs):
        self.args = args
        self.paths, self.workdir = ipc.IpcPaths.in_new_tempdir()
        self.children: list[ChildProcess] = []

    def start(self) -> None:
        # Imported here: the scheduler module pulls in torch and the model code, which only a
        # process that launches a runtime needs.
        from radixrt.sched.scheduler import run_scheduler

        pid = os.getpid()
        # OpenMP reads its settings once, when a process loads it: they go in the environment.
        self.scheduler = ChildProcess("scheduler", ipc.spawn_child(
            "scheduler", run_scheduler,
            {"args": self.args, "paths": self.paths, "parent_pid": pid}, self.workdir,
            env=cpu_policy.omp_env(self.args.resolved_threads(), self.args.thread_wait)))
        self.children.append(self.scheduler)
        self.detokenizer = ChildProcess("detokenizer", ipc.spawn_child(
            "detokenizer", run_detokenizer,
            {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path,
             "ipc": self.paths, "parent_pid": pid, "nice": self.args.helper_nice},
            self.workdir, env=cpu_policy.helper_env()))
        self.children.append(self.detokenizer)

    def dead_child(self) -> str | None:
        """A message naming the first child that exited, or None while all run."""
        for proc in self.children:
            if not proc.is_alive():
                return f"radixrt {proc.name} process died (exit code {proc.exitcode})"
        return None

    def stop(self) -> None:
        for proc in self.children:
            proc.stop()

    def remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
