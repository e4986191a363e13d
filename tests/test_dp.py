"""`Engine(dp=2)` on a tiny random model: two scheduler replicas behind one front end, routed
cache-aware. Prompt groups stick to a replica and spread over both, both replicas give HF's
greedy tokens, stats merge, cache flushes reach the routing trees, a dead replica's requests
run again on the other unless they streamed output (which fail), and the other serves the rest
(Engine and a live `radixrt serve --dp 2`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.core.errors import EngineDeadError

SYSTEMS = ["Radix trees share prefixes; caches keep what was computed once. " * 3,
           "The quick brown fox jumps over the lazy dog. " * 4]
QUESTIONS = ["A system prompt", "a few-shot preamble", "and a long tool", "emoji 🚲"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=4096, num_threads=2, dp=2,
                dtype="float32") as eng:
        yield eng


def prompts() -> list[tuple[int, str]]:
    """Two groups interleaved: (group, prompt)."""
    return [(g, SYSTEMS[g] + q) for q in QUESTIONS for g in (0, 1)]


def test_replicas_split_threads_and_cores(engine):
    assert engine.info["dp"] == 2 and len(engine.info["replicas"]) == 2
    assert all(r["threads"] == 1 for r in engine.info["replicas"])
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # pinned to disjoint cores
        a, b = (set(r["cpus"]) for r in engine.info["replicas"])
        assert a and b and not a & b
        for proc, r in zip(engine.launcher.schedulers, engine.info["replicas"], strict=True):
            assert os.sched_getaffinity(proc.pid) == set(r["cpus"])


def test_groups_stick_to_one_replica_and_spread(engine):
    engine.flush_cache()
    before = engine.routing_stats()
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    pairs = prompts()
    outs = engine.generate([p for _, p in pairs], sp, use_tqdm=False)
    after = engine.routing_stats()
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before, strict=True)]
    cache_routed = [a["cache_routed"] - b["cache_routed"] for a, b in zip(after, before,
                                                                          strict=True)]
    assert routed == [4, 4]  # one group per replica
    assert cache_routed == [3, 3]  # each group's first is a miss, the rest follow their prefix
    assert all(a["load"] == 0 for a in after)
    # The replicas really hit: every non-first request of a group reuses the shared prefix.
    for g in (0, 1):
        ids = [engine.tokenize(p) for gg, p in pairs if gg == g]
        shared = min(next((i for i, (x, y) in enumerate(zip(ids[0], o, strict=False)) if x != y),
                          len(o)) for o in ids[1:])
        group_outs = [o for (gg, _), o in zip(pairs, outs, strict=True) if gg == g]
        assert all(o.cached_tokens >= shared for o in group_outs[1:]), \
            ([o.cached_tokens for o in group_outs], shared)
    s = engine.stats()
    assert len(s["replicas"]) == 2
    assert s["num_requests_total"] == sum(r["num_requests_total"] for r in s["replicas"])
    assert s["cache_hit_rate"] == pytest.approx(
        s["cached_tokens_total"] / s["prompt_tokens_total"])
    engine.wait_idle()
    engine.check_invariants()


def test_both_replicas_match_hf_greedy(engine, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    engine.flush_cache()
    before = [r["routed"] for r in engine.routing_stats()]
    for g in (0, 1):  # one prompt per group: a miss each, so one per replica
        ids = engine.tokenize(SYSTEMS[g] + "x")
        out = engine.generate(input_ids=ids, sampling_params=sp, use_tqdm=False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert out.token_ids == ref[0, len(ids):].tolist()
    assert [r["routed"] - b for r, b in zip(engine.routing_stats(), before, strict=True)] == [1, 1]


def test_flush_reaches_the_routing_trees(engine):
    engine.generate(SYSTEMS[0] + "y", SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert sum(r["tree_tokens"] for r in engine.routing_stats()) > 0
    assert engine.flush_cache()
    # Emptied before flush_cache returns: the notice travels ahead of the flush's reply, so
    # requests routed right after a flush do not have their prefixes erased under them.
    assert [r["tree_tokens"] for r in engine.routing_stats()] == [0, 0]
    assert engine.evictions_since(0).prefixes[-2:] == [[], []]


def test_dead_replica_fails_its_requests_and_the_others_serve(engine):
    """Last: kills the scheduler of the replica running a long streamed request. That request
    (it handed over output: not re-run) ends with an error naming the replica (no hang), the
    engine stays up on the other replica, which takes every later request."""
    sp = SamplingParams(max_new_tokens=100_000, temperature=0, ignore_eos=True)
    ids = engine.tokenize(SYSTEMS[0] + "long")
    state = engine.submit(ids, sp, stream=True)
    victim = int(engine._tm._replica_of[state.rid].worker)
    deadline = time.monotonic() + 30
    while not state.token_ids and time.monotonic() < deadline:  # it runs
        time.sleep(0.02)
    os.kill(engine.launcher.schedulers[victim].pid, signal.SIGKILL)
    assert state.done.wait(10), "the request on the dead replica hangs"
    assert state.finish_reason == "abort" and f"replica {victim} died" in state.error
    engine.check_alive()  # the other replica still serves: no EngineDeadError
    assert set(engine.dead_replicas()) == {victim}
    survivor = 1 - victim
    before = [r["routed"] for r in engine.routing_stats()]
    outs = engine.generate([p for _, p in prompts()], SamplingParams(max_new_tokens=3),
                           use_tqdm=False)
    assert all(not o.error and o.finish_reason == "length" for o in outs)
    routed = [r["routed"] - b for r, b in zip(engine.routing_stats(), before, strict=True)]
    assert routed[survivor] == len(outs) and routed[victim] == 0
    assert [r["alive"] for r in engine.routing_stats()] == [i != victim for i in range(2)]
    s = engine.stats()
    assert len(s["replicas"]) == 1 and set(s["dead_replicas"]) == {str(victim)}
    # Its leftover detokenizer is stopped too.
    deadline = time.monotonic() + 5
    procs = engine.launcher.replica_children[victim]
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in procs)
    # Losing the last replica kills the engine.
    os.kill(engine.launcher.schedulers[survivor].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    with pytest.raises(EngineDeadError, match="scheduler"):
        while time.monotonic() < deadline:
            engine.check_alive()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def long_context_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 32768-token context: room for long requests (see
    NON_STREAMED_TOKENS) and for a stream that outlasts the test on a fast CPU (the tiny model streams ~4000 tokens/s on a Zen 5 core)."""
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_8k"),
                            max_position_embeddings=32768)


# Long enough that a re-run request is still running beside the survivor's own ones.
NON_STREAMED_TOKENS = 700


def test_http_server_survives_a_killed_replica(long_context_llama_dir):
    """`radixrt serve --dp 2`: SIGKILL the scheduler running a stream while non-streamed
    requests are in flight on both replicas (the victim stopped first, so that its half is
    still unanswered). Exactly that half is re-run. The stream (it sent output) ends with an error event naming
    the replica (code replica_dead) and [DONE]; every non-streamed request answers 200 once,
    with the text it gets without the kill; the survivor passes its invariant checks, /health
    stays 200 and lists the dead replica, and later requests of every group succeed."""
    import concurrent.futures

    import psutil
    from test_server import start_server, stop_server

    # Round robin: every other request lands on the victim. Cache-aware routing spills them off
    # it while its long stream counts as pending work, so whether it ever got one depended on
    # the CPU's speed (on a fast one the other replica never fell behind).
    server = start_server(str(long_context_llama_dir), "--dp", "2", "--max-total-tokens", "40000",
                          "--routing-policy", "round_robin")
    try:
        kids = psutil.Process(server.proc.pid).children()
        scheds = {i: next(c for c in kids if any(f"scheduler-{i}.pkl" in a
                                                  for a in c.cmdline())) for i in (0, 1)}

        def complete(p: str) -> dict:
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": "default", "prompt": p, "max_tokens": NON_STREAMED_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        texts = [p for _, p in prompts()]
        expected = [complete(p)["choices"][0]["text"] for p in texts]

        def routing() -> list[dict]:
            return httpx.get(server.url + "/debug/stats", timeout=10).json()["routing"]

        body = {"model": "default", "prompt": SYSTEMS[0] + "long", "max_tokens": 30000,
                "ignore_eos": True, "stream": True}
        events: list[str] = []
        pool = concurrent.futures.ThreadPoolExecutor(len(texts))
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert r.status_code == 200
            for line in lines:  # wait for the first token: the request runs somewhere
                if line.startswith("data: {"):
                    break
            victim = [x["load"] for x in routing()].index(1)
            # Stopped, the victim takes requests but answers none, so the ones routed to it are
            # still in flight when it dies (a running victim could finish them between a poll
            # that saw them and the kill). Its stats cannot be read while stopped.
            scheds[victim].suspend()
            # An even count: round robin sends exactly half of them to each replica.
            futures = [(i, pool.submit(complete, p)) for i, p in enumerate(texts)]
            assert len(futures) % 2 == 0
            half = len(futures) // 2

            def answered() -> int:
                return sum(f.done() for _, f in futures)

            wait_for(lambda: answered() >= half, 120, "the survivor's answers")
            time.sleep(0.3)
            assert answered() == half  # the victim's half waits on it
            scheds[victim].kill()
            t0 = time.monotonic()
            events = [line for line in lines if line.startswith("data: ")]
            assert time.monotonic() - t0 < 10
        assert events[-1] == "data: [DONE]"
        err = [e for e in events if '"error"' in e]
        assert err and "replica_dead" in err[-1] and f"replica {victim} died" in err[-1]
        answers = [f.result(timeout=120) for _, f in futures]
        pool.shutdown()
        assert [a["choices"][0]["text"] for a in answers] == [expected[i] for i, _ in futures]
        assert all(a["usage"]["completion_tokens"] == NON_STREAMED_TOKENS for a in answers)
        stats = httpx.get(server.url + "/debug/stats", timeout=10).json()
        assert stats["retried_requests"] == half
        inv = httpx.get(server.url + "/debug/check_invariants", timeout=30)
        assert inv.status_code == 200 and inv.json()["ok"], inv.text
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and set(health.json()["dead_replicas"]) == {str(victim)}
        for _, p in prompts():
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "default", "prompt": p, "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        stop_server(server)


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_killed_replica_reruns_what_showed_nothing(tiny_llama_dir):
    """SIGKILL a replica with requests running and queued on it: every non-streamed request
    (those with partial output included) and every stream that had handed over nothing
    finishes exactly once on the survivor with the tokens it gives without the kill; a stream
    that had output fails naming the replica; the survivor's pools pass their invariants."""
    greedy = SamplingParams(max_new_tokens=160, temperature=0, ignore_eos=True)
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=8192, num_threads=2, dp=2,
                dtype="float32", max_running_requests=2) as eng:
        texts = [p for _, p in prompts()]
        ids = [eng.tokenize(t) for t in texts]
        expected = [o.token_ids for o in eng.generate(texts, greedy, use_tqdm=False)]
        assert all(len(e) == 160 for e in expected)
        # A stream that has shown output pins the victim; then the batch lands on both.
        long = eng.submit(eng.tokenize(SYSTEMS[0] + "long"),
                          SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True),
                          stream=True)
        victim = int(eng._tm._replica_of[long.rid].worker)
        wait_for(lambda: long.delivered, 60, "the long stream's first output")
        plain = [eng.submit(i, greedy) for i in ids]
        streams = [eng.submit(i, greedy, stream=True) for i in ids]
        where = {st.rid: int(eng._tm._replica_of[st.rid].worker) for st in plain + streams}
        on_victim = [st for st in plain if where[st.rid] == victim]
        assert on_victim and len(on_victim) < len(plain)
        # Kill while a non-streamed request on the victim is part-way through.
        wait_for(lambda: any(st.token_ids and st.finish_reason is None for st in on_victim),
                 60, "partial output on the victim")
        os.kill(eng.launcher.schedulers[victim].pid, signal.SIGKILL)
        for st in [*plain, *streams, long]:
            assert st.done.wait(120), "a request hangs after the kill"
        assert long.finish_reason == "abort" and f"replica {victim} died" in long.error
        rerun = [st for st in plain if st.attempts > 1]
        assert rerun and all(where[st.rid] == victim for st in rerun)
        for st, want in zip(plain, expected, strict=True):
            assert not st.error and st.finish_reason == "length"
            assert st.token_ids == want and st.completion_tokens == len(want)
        for st, want in zip(streams, expected, strict=True):
            if st.error:  # only a stream that had shown output on the victim may fail
                assert where[st.rid] == victim and st.attempts == 1
                assert f"replica {victim} died" in st.error
            else:
                assert st.token_ids == want and st.finish_reason == "length"
        assert eng.stats()["retried_requests"] == sum(st.attempts - 1 for st in plain + streams)
        assert eng.num_outstanding() == 0
        eng.wait_idle()  # nothing left running or queued on the survivor
        eng.check_invariants()  # the survivor's pools and radix tree
