"""The tokenizer side, living in the caller's process (the Engine or the HTTP server).

It tokenizes and validates, assigns request ids, starts and watches the scheduler and
detokenizer processes, and routes their replies back to waiting callers (threads or asyncio).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixrt.config import ServerArgs
from radixrt.core import ipc
from radixrt.core.messages import (
    FINISH_ABORT,
    AbortReq,
    ControlReply,
    GenerateReq,
    ReadyMsg,
    ReqTextOut,
    TextBatchOut,
    TokenLogprobs,
)
from radixrt.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A runtime child process died; the engine cannot serve any more requests."""


@dataclass
class ReqState:
    """What the caller sees of one request; filled by the receive thread.

    Sync callers wait on `done`; async callers read deltas from `queue` (on their own loop).
    """

    rid: str
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: TokenLogprobs | None = None
    error: str = ""
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    deltas: collections.deque = field(default_factory=collections.deque)

    def apply(self, out: ReqTextOut) -> None:
        self.text += out.text_delta
        self.token_ids.extend(out.new_ids)
        if out.new_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.cached_tokens = out.cached_tokens
        self.completion_tokens = out.completion_tokens
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = TokenLogprobs()
            self.logprobs.extend(out.logprobs)
        if out.error:
            self.error = out.error
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    def notify(self, item: ReqTextOut | BaseException) -> None:
        if self.loop is not None and self.queue is not None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass
        else:
            self.deltas.append(item)
        if isinstance(item, BaseException) or self.finish_reason is not None:
            self.done.set()


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


class TokenizerManager:
    def __init__(self, args: ServerArgs):
        ipc.quiet_torch_threads()  # no tensor work here: leave the cores to the scheduler
        from radixrt.model.loader import default_model_path
        from radixrt.model.tokenizer import load_tokenizer

        model_path = args.model_path or str(default_model_path())
        self.args = args.replace(model_path=model_path)
        self.tokenizer = load_tokenizer(model_path, args.tokenizer_path)
        self.paths, self.tmpdir = ipc.IpcPaths.in_new_tempdir()
        self.ctx = zmq.Context()
        self.recv_sock = ipc.pull_socket(self.ctx, self.paths.tokenizer)
        self.send_sock = ipc.push_socket(self.ctx, self.paths.scheduler)
        self._send_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}
        self._control: dict[int, tuple[threading.Event, list[ControlReply]]] = {}
        self._control_ids = itertools.count()
        self._rid_prefix = uuid.uuid4().hex[:8]
        self._rid_counter = itertools.count()
        self.dead_error: str | None = None
        self._closed = False
        self.info: dict[str, Any] = {}
        self._start_children()

    # -- processes ----------------------------------------------------------------------------------
    def _start_children(self) -> None:
        pid = os.getpid()
        threads = str(self.args.resolved_threads())
        self.scheduler_proc = ChildProcess("scheduler", ipc.spawn_child(
            "scheduler", "radixrt.sched.scheduler:run_scheduler",
            {"args": self.args, "paths": self.paths, "parent_pid": pid}, self.tmpdir,
            env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}))
        self.detok_proc = ChildProcess("detokenizer", ipc.spawn_child(
            "detokenizer", "detok_proc.detokenizer:run_detokenizer",
            {"model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path,
             "ipc": self.paths, "parent_pid": pid}, self.tmpdir,
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "TOKENIZERS_PARALLELISM": "false"}))
        try:
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._thread = threading.Thread(target=self._recv_loop, name="radixrt-recv", daemon=True)
        self._thread.start()

    def _wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        ready: set[str] = set()
        while ready != {"scheduler", "detokenizer"}:
            if time.monotonic() > deadline:
                raise TimeoutError("radixrt: runtime processes did not start in time")
            for proc in (self.scheduler_proc, self.detok_proc):
                if not proc.is_alive():
                    raise EngineDeadError(f"{proc.name} process exited during start-up "
                                          f"(exit code {proc.exitcode})")
            if self.recv_sock.poll(100):
                for m in ipc.recv_all(self.recv_sock):
                    if isinstance(m, ReadyMsg):
                        if not m.ok:
                            raise RuntimeError(f"{m.process} failed to start: {m.error}")
                        if m.process == "scheduler":
                            self.info = m.info
                        ready.add(m.process)

    def _children_alive(self) -> str | None:
        for proc in (self.scheduler_proc, self.detok_proc):
            if not proc.is_alive():
                return f"radixrt {proc.name} process died (exit code {proc.exitcode})"
        return None

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_sock, zmq.POLLIN)
        while not self._closed:
            try:
                events = dict(poller.poll(timeout=200))
            except zmq.ZMQError:
                return
            if self.recv_sock in events:
                for msg in ipc.recv_all(self.recv_sock):
                    self._dispatch(msg)
            elif not self._closed:
                err = self._children_alive()
                if err is not None:
                    self._die(err)
                    return

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, TextBatchOut):
            for out in msg.outs:
                state = self.states.get(out.rid)
                if state is None:
                    continue
                state.apply(out)
                if state.finish_reason is not None:
                    self.states.pop(out.rid, None)
                state.notify(out)
        elif isinstance(msg, ControlReply):
            waiter = self._control.get(msg.req_id)
            if waiter is not None:
                waiter[1].append(msg)
                waiter[0].set()

    def _die(self, err: str) -> None:
        self.dead_error = err
        logger.error(err)
        exc = EngineDeadError(err)
        for state in list(self.states.values()):
            state.error = err
            state.finish_reason = state.finish_reason or FINISH_ABORT
            state.notify(exc)
        self.states.clear()
        for event, _ in list(self._control.values()):
            event.set()

    def check_alive(self) -> None:
        if self.dead_error is None:
            err = self._children_alive()
            if err is not None:
                self._die(err)
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    # -- requests -----------------------------------------------------------------------------------
    def _send(self, msg: object) -> None:
        with self._send_lock:
            ipc.send(self.send_sock, msg)

    def new_rid(self) -> str:
        return f"{self._rid_prefix}-{next(self._rid_counter)}"

    def submit(self, input_ids: list[int], sampling: SamplingParams, stream: bool = False,
               loop: asyncio.AbstractEventLoop | None = None,
               queue: asyncio.Queue | None = None) -> ReqState:
        """Send a validated request; the returned state fills in as outputs arrive.

        With `loop`, every `ReqTextOut` (or an exception if the runtime dies) is also put on
        `queue` (a new one unless given: several requests may share one) on that loop.
        """
        self.check_alive()
        rid = self.new_rid()
        state = ReqState(rid=rid, prompt_tokens=len(input_ids))
        if loop is not None:
            state.loop = loop
            state.queue = queue if queue is not None else asyncio.Queue()
        self.states[rid] = state
        self._send(GenerateReq(rid=rid, input_ids=input_ids, sampling=sampling, stream=stream))
        return state

    def abort(self, rid: str) -> None:
        """The caller gave up on `rid`: forget it here and tell the scheduler to free it."""
        self.states.pop(rid, None)
        if self.dead_error is None and not self._closed:
            self._send(AbortReq(rid=rid))

    def control(self, msg: Any, timeout_s: float = 60.0) -> ControlReply:
        """Send a control request (it has a `req_id` field) and wait for the scheduler's reply."""
        self.check_alive()
        req_id = next(self._control_ids)
        msg.req_id = req_id
        event = threading.Event()
        box: list[ControlReply] = []
        self._control[req_id] = (event, box)
        try:
            self._send(msg)
            if not event.wait(timeout_s):
                raise TimeoutError(f"scheduler did not answer {type(msg).__name__}")
            self.check_alive()
            return box[0]
        finally:
            self._control.pop(req_id, None)

    # -- shutdown -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs = [p for p in (getattr(self, "scheduler_proc", None),
                             getattr(self, "detok_proc", None)) if p is not None]
        for proc in procs:
            proc.stop()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        self.recv_sock.close(0)
        self.send_sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
