"""The `--dp` front end's handling of a lost replica, without processes: fake schedulers are
bare sockets, outputs are pushed by hand. A lost replica's non-streamed requests and streams
that handed over nothing go again to a live replica under a new wire id; a late output of the
lost run is dropped; the caller sees only its own rid; a stream with output fails."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest
import zmq

from radixrt.core import ipc
from radixrt.core.messages import AbortReq, GenerateReq, ReqTextOut, TextBatchOut, Usage
from radixrt.core.sampling_params import SamplingParams
from radixrt.routing.policy import make_policy
from tokenizer_proc.manager import TokenizerManager


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class FakeReplicas:
    """Two replicas' scheduler sockets (what the manager sends) and the detokenizers' side of
    the tokenizer socket (what it receives)."""

    def __init__(self) -> None:
        self.paths, self.dir = ipc.IpcPaths.in_new_tempdir()
        self.ctx = zmq.Context()
        self.scheds = [ipc.pull_socket(self.ctx, self.paths.for_replica(i).scheduler)
                       for i in range(2)]
        self.dead: dict[int, str] = {}
        self.stopped: list[int] = []
        self.tm = TokenizerManager(self.paths, lambda: None,
                                   [self.paths.for_replica(i) for i in range(2)],
                                   dead_replicas=lambda: dict(self.dead),
                                   on_lost=self.stopped.append)
        self.tm.set_policy(make_policy("round_robin", [0, 1]))
        self.detok = ipc.push_socket(self.ctx, self.paths.tokenizer)
        self.received: list[list[object]] = [[], []]

    def sent_to(self, replica: int, n: int) -> list[object]:
        """The first `n` messages replica `replica`'s scheduler received."""
        def got() -> bool:
            self.received[replica] += ipc.recv_all(self.scheds[replica])
            return len(self.received[replica]) >= n
        wait_for(got, f"{n} messages to replica {replica}")
        return self.received[replica][:n]

    def out(self, rid: str, ids: list[int], finish: str | None = None) -> None:
        ipc.send(self.detok, TextBatchOut([ReqTextOut(
            rid=rid, text_delta="".join(f"<{i}>" for i in ids), new_ids=ids,
            finish_reason=finish, usage=Usage(prompt_tokens=3, completion_tokens=len(ids)))]))

    def close(self) -> None:
        self.tm.close()
        for s in [*self.scheds, self.detok]:
            s.close(0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fake():
    f = FakeReplicas()
    f.tm.start()
    yield f
    f.close()


def test_lost_replica_reruns_what_the_caller_cannot_have_seen(fake):
    tm = fake.tm
    sp = SamplingParams(max_new_tokens=4)
    # Round-robin: plain, s_out and s_none on replica 0; the others on replica 1.
    plain = tm.submit([1, 2, 3], sp)
    other = tm.submit([4, 5, 6], sp)
    s_out = tm.submit([7, 8, 9], sp, stream=True)
    tm.submit([4, 5, 6], sp)
    s_none = tm.submit([10, 11, 12], sp, stream=True)
    assert [m.rid for m in fake.sent_to(0, 3)] == [plain.rid, s_out.rid, s_none.rid]
    fake.out(plain.rid, [41])  # partial output of the doomed run
    fake.out(s_out.rid, [42])
    wait_for(lambda: plain.token_ids == [41] and s_out.delivered, "the partial outputs")

    fake.dead[0] = "scheduler exited with -9"
    tm.check_alive()  # the replica is lost; the runtime lives on
    assert s_out.done.is_set() and "replica 0 died" in s_out.error
    assert s_out.token_ids == [42]  # what it had streamed stays; it is not re-run
    reruns = fake.sent_to(1, 4)[2:]
    assert all(isinstance(m, GenerateReq) for m in reruns)
    assert [(m.rid, m.input_ids) for m in reruns] == [
        (f"{plain.rid}.2", [1, 2, 3]), (f"{s_none.rid}.2", [10, 11, 12])]
    assert plain.token_ids == [] and plain.attempts == 2 and not plain.done.is_set()
    assert tm.retried == 2
    wait_for(lambda: fake.stopped == [0], "the lost replica's leftover process stopped")

    fake.out(plain.rid, [43], "length")  # late output of the lost run: dropped
    fake.out(f"{plain.rid}.2", [7, 8], "length")
    fake.out(other.rid, [9], "length")
    assert plain.done.wait(10) and other.done.wait(10)
    assert plain.token_ids == [7, 8] and plain.text == "<7><8>" and plain.error == ""
    assert plain.result().rid == plain.rid

    tm.abort(s_none.rid)  # the caller's rid reaches the re-run
    assert fake.sent_to(1, 5)[4] == AbortReq(rid=f"{s_none.rid}.2")
    fake.out(f"{s_none.rid}.2", [5], "length")  # after the abort: nobody is told
    time.sleep(0.1)
    assert not s_none.delivered
    assert tm.num_outstanding() == 1  # the fourth request, still on replica 1


def test_rerun_outputs_reach_an_async_caller_under_its_rid(fake):
    import asyncio

    async def run() -> list[str]:
        st = fake.tm.submit([1, 2, 3], SamplingParams(max_new_tokens=2),
                            loop=asyncio.get_running_loop(), stream=False)
        fake.sent_to(0, 1)
        fake.dead[0] = "detokenizer exited"
        fake.tm.check_alive()
        assert fake.sent_to(1, 1)[0].rid == f"{st.rid}.2"
        fake.out(f"{st.rid}.2", [3], "stop")
        assert st.queue is not None
        item = await asyncio.wait_for(st.queue.get(), 10)
        return [item.rid, st.rid]

    rid_seen, rid = asyncio.run(run())
    assert rid_seen == rid


def test_nothing_is_rerun_once_every_replica_is_lost(fake):
    st = fake.tm.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
    fake.sent_to(0, 1)
    fake.dead.update({0: "gone", 1: "gone too"})
    with pytest.raises(Exception, match="gone"):
        fake.tm.check_alive()
    assert st.done.is_set() and st.error and fake.tm.retried == 0
