"""Reply routing on the tokenizer side, in the caller's process (the Engine or the HTTP server).

`TokenizerManager` assigns request ids, sends requests to the scheduler, and routes the
detokenizer's outputs and the scheduler's control replies back to waiting callers (threads or
asyncio). It starts no process: it is told how to learn that one died (`dead_child`; with
several replicas, `dead_replicas` says which replicas lost a process).

With several replicas a dead one is *lost*, not fatal: its requests in flight run again on a
live replica when that is invisible to the caller (`ReqState.retriable`: not streamed, or a
stream that has handed over nothing yet), the others fail with `ReplicaDeadError`; its control
waiters are woken, the routing policy stops sending it requests (`on_lost` is told, to stop its
remaining process), and the others keep serving; the runtime is dead only once every replica
is lost.

A re-run goes out under a new wire id (`<rid>.<attempt>`), so an output of the lost run still
queued in the socket can never reach the caller: outputs are matched by wire id, the caller
only ever sees its own `rid`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import zmq

from radixrt.core import ipc
from radixrt.core.errors import EngineDeadError, ReplicaDeadError
from radixrt.core.messages import (
    AbortReq,
    CacheEvicted,
    ControlReply,
    GenerateReq,
    ReadyMsg,
    TextBatchOut,
    Usage,
)
from radixrt.core.sampling_params import SamplingParams
from radixrt.routing.eviction_log import EvictionLog
from radixrt.routing.policy import Decision, RoutingPolicy
from tokenizer_proc.request_state import ReqState

logger = logging.getLogger(__name__)

CHILD_CHECK_S = 0.2  # how often the receive thread looks for dead children


class TokenizerManager:
    """Binds the tokenizer's PULL socket and connects to the scheduler's; call `wait_ready`
    once the children are started, then `start` the receive thread (which an event loop may
    relieve of the reading: `receive_on`)."""

    def __init__(self, paths: ipc.IpcPaths, dead_child: Callable[[], str | None],
                 replica_paths: list[ipc.IpcPaths] | None = None,
                 dead_replicas: Callable[[], dict[int, str]] | None = None,
                 on_lost: Callable[[int], None] | None = None):
        self.paths = paths
        self.dead_child = dead_child
        self.dead_replicas = dead_replicas
        self.on_lost = on_lost
        # Replica -> why it is gone (several replicas only).
        self.lost: dict[int, str] = {}
        self._to_stop: list[int] = []  # lost replicas whose leftover process `on_lost` stops
        self._last_check = 0.0
        self._child_lock = threading.Lock()  # one thread handles a death
        self.ctx = zmq.Context()
        self.recv_sock = ipc.pull_socket(self.ctx, paths.tokenizer)
        self.send_socks = [ipc.push_socket(self.ctx, p.scheduler)
                           for p in (replica_paths or [paths])]
        self.send_sock = self.send_socks[0]
        # Set by the owner when there are several replicas (`set_policy`); None: replica 0.
        self.policy: RoutingPolicy | None = None
        self._replica_of: dict[str, Decision] = {}  # wire rid -> where it was routed
        self._reqs: dict[str, GenerateReq] = {}  # wire rid -> the request (several replicas)
        self._wire: dict[str, str] = {}  # caller rid -> wire rid, for requests re-run
        self.retried = 0  # requests re-run on another replica after theirs died
        self.eviction_log = EvictionLog()
        self._send_lock = threading.Lock()
        self.states: dict[str, ReqState] = {}  # wire rid -> state
        self._control: dict[int, tuple[threading.Event, list[ControlReply], int]] = {}
        self._control_ids = itertools.count()
        self._rid_prefix = uuid.uuid4().hex[:8]
        self._rid_counter = itertools.count()
        self.dead_error: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        # Where outputs are read: the receive thread, or (`receive_on`) an event loop's reader,
        # the thread then only checking for dead children. `_parked`: the thread has seen the
        # loop take over and no longer touches the socket; `_resume`: hand reading back.
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._parked = threading.Event()
        self._resume = threading.Event()

    # -- start-up -----------------------------------------------------------------------------------
    def wait_ready(self, processes: Iterable[str] | Mapping[str, int],
                   timeout_s: float = 900.0) -> dict[str, Any]:
        """Wait for every child's `ReadyMsg` (`processes`: names, or name → how many send one);
        returns the (first) scheduler's info (model, sizes)."""
        deadline = time.monotonic() + timeout_s
        waiting = dict(processes) if isinstance(processes, Mapping) else dict.fromkeys(processes, 1)
        waiting = {k: v for k, v in waiting.items() if v > 0}
        info: dict[str, Any] = {}
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError("radixrt: runtime processes did not start in time")
            err = self.dead_child()
            if err is not None:
                raise EngineDeadError(f"{err} during start-up")
            if self.recv_sock.poll(100):
                for m in ipc.recv_all(self.recv_sock):
                    if isinstance(m, ReadyMsg):
                        if not m.ok:
                            raise RuntimeError(f"{m.process} failed to start: {m.error}")
                        if m.process == "scheduler" and not info:
                            info = m.info
                        if m.process in waiting:
                            waiting[m.process] -= 1
                            if waiting[m.process] == 0:
                                del waiting[m.process]
        return info

    def set_policy(self, policy: RoutingPolicy) -> None:
        """Route requests over the replicas with `policy` (its workers are replica indices)."""
        self.policy = policy

    def start(self) -> None:
        self._thread = threading.Thread(target=self._recv_loop, name="radixrt-recv", daemon=True)
        self._thread.start()

    # -- receiving ----------------------------------------------------------------------------------
    def receive_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Read outputs on `loop` (the HTTP server's event loop), or again on the receive thread
        with None; call from `loop`'s thread (None: from the loop that took over).

        On the loop, a step's outputs reach their requests' queues with no thread hand-off (a
        thread wake-up and a `call_soon_threadsafe` per output, on the cores the scheduler
        decodes on: README, "Serving"). The thread keeps checking for dead children.
        Hand-over: the thread finishes its current poll (at most 0.2 s) and parks before the
        loop reads."""
        fd = self.recv_sock.getsockopt(zmq.FD)
        if loop is None:
            current = self._reader_loop
            if current is not None:
                try:
                    current.remove_reader(fd)
                except (RuntimeError, ValueError, OSError):  # loop or socket already closed
                    pass
                self._reader_loop = None
                self._resume.set()
            return
        if self._reader_loop is not None:
            raise RuntimeError("outputs are already read on an event loop")
        self._parked.clear()
        self._reader_loop = loop
        if self._thread is not None and self._thread.is_alive():
            self._parked.wait(timeout=2 * CHILD_CHECK_S + 1.0)
        loop.add_reader(fd, self._read_ready)
        self._read_ready()  # the thread may have taken the socket's last wake-up

    def _read_ready(self) -> None:
        """The loop's reader: every waiting message (the socket's fd only signals that its
        state changed, so read until `EVENTS` shows none)."""
        try:
            while self.recv_sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                for msg in ipc.recv_all(self.recv_sock):
                    self._dispatch(msg)
        except zmq.ZMQError:  # closed under us (shutdown)
            return

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_sock, zmq.POLLIN)
        while not self._closed:
            if self._reader_loop is not None:  # an event loop reads: only watch the children
                self._parked.set()
                if self._resume.wait(CHILD_CHECK_S):
                    self._resume.clear()
            else:
                try:
                    events = dict(poller.poll(timeout=200))
                except zmq.ZMQError:
                    return
                if self.recv_sock in events and self._reader_loop is None:
                    for msg in ipc.recv_all(self.recv_sock):
                        self._dispatch(msg)
            # Also under steady traffic: one replica's outputs must not hide another's death.
            now = time.monotonic()
            if not self._closed and now - self._last_check >= CHILD_CHECK_S:
                self._last_check = now
                if self._check_children():
                    return

    def _check_children(self) -> bool:
        """Handle dead children; True once the whole runtime is dead."""
        with self._child_lock:
            dead = self._check_children_locked()
            stop, self._to_stop = self._to_stop, []
        # Outside the lock (it takes up to seconds): outputs of the live replicas keep flowing.
        for replica in stop:
            if self.on_lost is not None:
                try:
                    self.on_lost(replica)
                except Exception:  # stopping the leftover process is best effort
                    logger.exception("stopping replica %d's processes failed", replica)
        return dead

    def _check_children_locked(self) -> bool:
        if self.dead_error is not None:
            return True
        if self.dead_replicas is None or len(self.send_socks) == 1:
            err = self.dead_child()
            if err is not None:
                self._die(err)
            return err is not None
        new = {r: e for r, e in sorted(self.dead_replicas().items()) if r not in self.lost}
        self.lost.update(new)  # all first: a re-run must not go to another dying replica
        for replica, err in new.items():
            self._lose(replica, err)
        if len(self.lost) == len(self.send_socks):
            self._die("; ".join(self.lost[i] for i in sorted(self.lost)))
            return True
        return False

    def _lose(self, replica: int, err: str) -> None:
        """Replica `replica` lost a process: re-run its retriable requests elsewhere, fail the
        others, and stop routing to it."""
        msg = (f"radixrt replica {replica} died ({err}); its requests in flight that had "
               f"streamed output failed, the other replicas keep serving")
        self.lost[replica] = err
        logger.error(msg)
        exc = ReplicaDeadError(msg)
        live = len(self.lost) < len(self.send_socks)
        if self.policy is not None:
            self.policy.forget(replica)
        for rid, d in list(self._replica_of.items()):
            if d.worker == replica:
                state = self.states.pop(rid, None)
                req = self._reqs.pop(rid, None)
                self._release(rid, error=True)
                if state is None:
                    continue
                if live and req is not None and state.retriable():
                    self._rerun(state, req)
                else:
                    self._wire.pop(state.rid, None)
                    state.fail(msg, exc)
        if live and self.retried:
            logger.warning("%d request(s) re-run on the live replicas so far", self.retried)
        for event, _, r in list(self._control.values()):
            if r == replica:
                event.set()
        self._to_stop.append(replica)

    def _rerun(self, state: ReqState, req: GenerateReq) -> None:
        """Send a lost run's request again, on a live replica, under a new wire id."""
        state.restart()
        wire = f"{state.rid}.{state.attempts}"
        assert self.policy is not None
        d = self.policy.route(req.input_ids, exclude=set(self.lost),
                              output_tokens=req.sampling.max_new_tokens)
        again = dataclasses.replace(req, rid=wire)
        self._wire[state.rid] = wire
        self._replica_of[wire] = d
        self._reqs[wire] = again
        self.states[wire] = state
        self.retried += 1
        self._send(again, int(d.worker))  # type: ignore[call-overload]

    def _apply_outs(self, msg: TextBatchOut) -> None:
        for out in msg.outs:
            state = self.states.get(out.rid)  # by wire id: a lost run's outputs find none
            if state is None:
                continue
            wire = out.rid
            if wire != state.rid:  # a re-run: the caller knows only its own rid
                out = dataclasses.replace(out, rid=state.rid)
            state.apply(out)
            if state.finish_reason is not None:
                self.states.pop(wire, None)
                self._reqs.pop(wire, None)
                self._wire.pop(state.rid, None)
                replica = self._release(wire, error=bool(out.error))
                if self.policy is not None and replica is not None:
                    self.policy.observed(replica, out.usage.prompt_tokens,
                                         out.usage.cached_tokens)
            state.notify(out)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, TextBatchOut):
            # Under the death lock: a replica lost by another thread (`check_alive`) must not
            # restart a state while one of its lost run's outputs is being applied.
            with self._child_lock:
                self._apply_outs(msg)
        elif isinstance(msg, ControlReply):
            waiter = self._control.get(msg.req_id)
            if waiter is not None:
                waiter[1].append(msg)
                waiter[0].set()
        elif isinstance(msg, CacheEvicted):
            if self.policy is not None:
                self.policy.evicted(msg.replica, msg.prefixes)
            self.eviction_log.append(msg.prefixes)

    def _release(self, rid: str, error: bool = False) -> int | None:
        """The request left its replica (finished or aborted): lower that replica's load.
        Returns the replica (0 with one replica; None if `rid` was already released)."""
        d = self._replica_of.pop(rid, None)
        if d is None:
            return 0 if self.policy is None else None
        if self.policy is not None:
            self.policy.finish(d, error=error)
        return int(d.worker)  # type: ignore[call-overload]

    def _die(self, err: str) -> None:
        self.dead_error = err
        logger.error(err)
        exc = EngineDeadError(err)
        for state in list(self.states.values()):
            state.fail(err, exc)
        self.states.clear()
        self._reqs.clear()
        self._wire.clear()
        for rid in list(self._replica_of):
            self._release(rid, error=True)
        for event, _, _ in list(self._control.values()):
            event.set()

    def check_alive(self) -> None:
        """Raise `EngineDeadError` if the runtime is dead (a child died; with several
        replicas, a process of every replica), now or earlier."""
        if self.dead_error is None and not self._closed:
            self._check_children()
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    def live_replicas(self) -> list[int]:
        """Indices of the replicas not lost."""
        return [i for i in range(len(self.send_socks)) if i not in self.lost]

    # -- requests -----------------------------------------------------------------------------------
    def _send(self, msg: object, replica: int = 0) -> None:
        with self._send_lock:
            ipc.send(self.send_socks[replica], msg)

    def new_rid(self) -> str:
        return f"{self._rid_prefix}-{next(self._rid_counter)}"

    def submit(self, input_ids: list[int], sampling: SamplingParams,
               loop: asyncio.AbstractEventLoop | None = None,
               queue: asyncio.Queue | None = None, stream: bool | None = None) -> ReqState:
        """Send a validated request; the returned state fills in as outputs arrive.

        With `loop`, every `ReqTextOut` (or an exception if the runtime dies) is also put on
        `queue` (a new one unless given: several requests may share one) on that loop.
        `stream`: the caller shows outputs as they come (default: when it gets a queue), so
        once one is handed over the request is not re-run if its replica dies.
        """
        self.check_alive()
        rid = self.new_rid()
        state = ReqState(rid=rid, usage=Usage(prompt_tokens=len(input_ids)),
                         stream=loop is not None if stream is None else stream)
        if loop is not None:
            state.loop = loop
            state.queue = queue if queue is not None else asyncio.Queue()
        replica = 0
        if self.policy is not None:
            d = self.policy.route(input_ids, exclude=set(self.lost),
                                  output_tokens=sampling.max_new_tokens)
            replica = int(d.worker)  # type: ignore[call-overload]
            self._replica_of[rid] = d
        req = GenerateReq(rid=rid, input_ids=input_ids, sampling=sampling, stream=state.stream)
        if self.policy is not None:
            self._reqs[rid] = req
        self.states[rid] = state
        self._send(req, replica)
        return state

    def abort(self, rid: str) -> None:
        """The caller gave up on `rid`: forget it here and tell the scheduler to free it."""
        wire = self._wire.pop(rid, rid)
        self.states.pop(wire, None)
        self._reqs.pop(wire, None)
        replica = self._release(wire)
        if (replica is not None and replica not in self.lost and self.dead_error is None
                and not self._closed):
            self._send(AbortReq(rid=wire), replica)

    def num_outstanding(self) -> int:
        """Requests submitted and neither finished nor aborted."""
        return len(self.states)

    def control(self, msg: Any, timeout_s: float = 60.0, replica: int = 0) -> ControlReply:
        """Send a control request (it has a `req_id` field) to one scheduler and wait for its
        reply."""
        self.check_alive()
        req_id = next(self._control_ids)
        msg.req_id = req_id
        event = threading.Event()
        box: list[ControlReply] = []
        self._control[req_id] = (event, box, replica)
        try:
            if replica in self.lost:
                raise ReplicaDeadError(f"radixrt replica {replica} died ({self.lost[replica]})")
            self._send(msg, replica)
            if not event.wait(timeout_s):
                raise TimeoutError(f"scheduler did not answer {type(msg).__name__}")
            self.check_alive()
            if not box:
                raise ReplicaDeadError(f"radixrt replica {replica} died "
                                       f"({self.lost.get(replica, 'no reply')})")
            return box[0]
        finally:
            self._control.pop(req_id, None)

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the receive thread and close the sockets (after the children are stopped)."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        self.recv_sock.close(0)
        for sock in self.send_socks:
            sock.close(0)
        self.ctx.term()
