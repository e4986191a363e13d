"""ZMQ plumbing and child-process hygiene shared by the three processes."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from radixrt.core import messages


@dataclass(frozen=True)
class IpcPaths:
    """Endpoints of the three PULL sockets (each bound by its owner, pushed to by the others)."""

    scheduler: str
    detokenizer: str
    tokenizer: str

    @property
    def directory(self) -> str:
        """The private temp dir holding the sockets."""
        return os.path.dirname(self.scheduler.removeprefix("ipc://"))

    def for_replica(self, replica: int) -> IpcPaths:
        """Replica `replica` of `--dp`: its own scheduler and detokenizer sockets, the shared
        tokenizer socket (every replica replies to the one front end)."""
        return IpcPaths(scheduler=f"{self.scheduler}-{replica}",
                        detokenizer=f"{self.detokenizer}-{replica}", tokenizer=self.tokenizer)

    @classmethod
    def in_new_tempdir(cls) -> tuple[IpcPaths, str]:
        d = tempfile.mkdtemp(prefix="radixrt-")
        return cls(
            scheduler=f"ipc://{d}/scheduler",
            detokenizer=f"ipc://{d}/detokenizer",
            tokenizer=f"ipc://{d}/tokenizer",
        ), d


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    return s


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def send(sock: zmq.Socket, msg: object) -> None:
    sock.send(messages.encode(msg))


def recv_all(sock: zmq.Socket) -> list[object]:
    """Every message waiting on `sock`, without blocking."""
    out: list[object] = []
    while True:
        try:
            out.append(messages.decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


def exit_with_parent(parent_pid: int, interval_s: float = 0.5,
                     cleanup_dir: str | None = None) -> None:
    """Start a daemon thread that kills this process as soon as its parent is gone (removing
    `cleanup_dir`, the socket dir, which a parent killed by SIGKILL could not remove).

    Polls the parent pid instead of PR_SET_PDEATHSIG, which fires when the *thread* that
    spawned us exits (an Engine built in a worker thread would lose its children).
    """

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                if cleanup_dir:
                    shutil.rmtree(cleanup_dir, ignore_errors=True)
                os._exit(0)
            time.sleep(interval_s)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def entry_point_name(target: Callable[..., object]) -> str:
    """"module:qualname" of a module-level function, which a fresh interpreter can import."""
    module, qualname = target.__module__, target.__qualname__
    if "<" in qualname or "." in qualname or module == "__main__":
        raise ValueError(f"a child entry point must be a module-level function of an importable "
                         f"module, got {module}:{qualname}")
    return f"{module}:{qualname}"


def spawn_child(name: str, target: Callable[..., object], kwargs: dict, workdir: str,
                env: dict[str, str | None] | None = None,
                cpus: list[int] | None = None) -> subprocess.Popen:
    """Start `target(**kwargs)` in a fresh interpreter (`python -m radixrt.core.child_main`),
    pinned to `cpus` (before it imports anything) when given. `env` is laid over this
    process's environment; a None value removes that variable from the child's."""
    path = os.path.join(workdir, f"{name}.pkl")
    with open(path, "wb") as f:
        pickle.dump({"target": entry_point_name(target), "kwargs": kwargs, "cpus": cpus}, f)
    child_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    return subprocess.Popen([sys.executable, "-m", "radixrt.core.child_main", path],
                            env=child_env)
