"""Scheduler, SchedulePolicy and PrefillAdder (CPU).

Policy and adder tests run over a real `RadixCache` on tiny pools. Scheduler tests drive an
in-process `ModelRunner` + `Scheduler` on the tiny random Llama (greedy, `ignore_eos`), so a
request's tokens depend only on its prompt: every run under memory pressure, chunking, prefix
sharing, aborts or failures is compared with a roomy reference run. `check_invariants()` runs
after every step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from radixrt.cli import add_server_args, args_from_namespace
from radixrt.config import ServerArgs
from radixrt.core.forward_batch import ForwardBatch
from radixrt.core.messages import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    AbortReq,
    CacheEvicted,
    CheckInvariantsReq,
    ControlReply,
    FlushCacheReq,
    GenerateReq,
    ReqTokenOut,
    StatsReq,
)
from radixrt.core.sampling_params import SamplingParams
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.chunk_cache import NoPrefixCache
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.mem.radix_cache import RadixCache
from radixrt.model.runner import ModelRunner
from radixrt.sched import schedule_policy
from radixrt.sched import scheduler as scheduler_mod
from radixrt.sched.kv_owner import KVOwner
from radixrt.sched.req import Req
from radixrt.sched.schedule_policy import (
    IN_BATCH_SHARE_MIN_TOKENS,
    PrefillAdder,
    PrefillPacer,
    SchedulePolicy,
    prefill_work,
    tokens_within,
)
from radixrt.sched.scheduler import Scheduler

POLICIES = ("lpm", "fcfs", "dfs-weight")
CACHE_AWARE = ("lpm", "dfs-weight")
COUNTERS = ("num_requests_total", "num_finished_requests_total", "prompt_tokens_total",
            "cached_tokens_total", "generated_tokens_total", "retractions_total",
            "evicted_tokens_total", "forward_steps_total")


# =============================================================================================
# Helpers: pools, cache and requests without a model
# =============================================================================================
@dataclass
class Pools:
    req_pool: ReqToTokenPool
    kv_pool: TokenToKVPool
    cache: RadixCache
    kv: KVOwner

    def insert(self, ids: Sequence[int]) -> torch.Tensor:
        """Cache `ids` the way a finished request would (slots from the pool); returns the slots
        the tree now holds for them."""
        slots = self.kv_pool.alloc(len(ids))
        assert slots is not None
        already = self.cache.insert(list(ids), slots)
        self.kv_pool.free(slots[:already])
        return self.cache.match_prefix(list(ids)).indices

    def check(self, live: Iterable[Req] = (), held: Sequence[torch.Tensor] = ()) -> None:
        """Ownership check; `held` are slots taken from the pool by the test itself."""
        if held:
            for h in held:
                self.kv_pool.free(h)
        self.kv.check(list(live))


def make_pools(slots: int = 256, rows: int = 8, ctx: int = 256) -> Pools:
    req_pool = ReqToTokenPool(rows, ctx)
    kv_pool = TokenToKVPool(slots, 1, 1, 1)
    cache = RadixCache()
    return Pools(req_pool, kv_pool, cache, KVOwner(req_pool, kv_pool, cache))


def make_req(rid: str, ids: Sequence[int], arrival: float = 0.0, max_new: int = 8) -> Req:
    req = Req(rid, list(ids), SamplingParams(max_new_tokens=max_new, temperature=0.0))
    req.arrival_time = arrival
    return req


def rids(reqs: Iterable[Req]) -> list[str]:
    return [r.rid for r in reqs]


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def policy(name: str, cache: BasePrefixCache, enabled: bool = True, fallback: int = 128,
           timeout: float = 10.0, now: float = 0.0) -> SchedulePolicy:
    return SchedulePolicy(name, cache, enabled, fallback, timeout, clock=lambda: now)


# =============================================================================================
# 1. SchedulePolicy
# =============================================================================================
def test_lpm_longest_cached_prefix_first_ties_by_arrival() -> None:
    p = make_pools()
    long_pfx = seq(3, 20)
    other = seq(100, 10)
    p.insert(long_pfx)
    p.insert(other)
    reqs = [
        make_req("none", seq(200, 6), arrival=0.0),  # no match
        make_req("other", [*other, 5, 6], arrival=1.0),  # match 10
        make_req("p15_late", [*long_pfx[:15], 250, 251], arrival=4.0),  # match 15
        make_req("full", [*long_pfx, 9], arrival=3.0),  # match 20 (ids[:-1] is the prefix)
        make_req("p15_early", [*long_pfx[:15], 260, 261], arrival=2.0),  # match 15
    ]
    for order_in in (reqs, reqs[::-1]):
        ordered, deferred = policy("lpm", p.cache).order(list(order_in))
        assert rids(ordered) == ["full", "p15_early", "p15_late", "other", "none"]
        assert deferred == set()
    assert {r.rid: r.match_len for r in reqs} == {
        "none": 0, "other": 10, "p15_late": 15, "full": 20, "p15_early": 15}
    p.check()


def test_lpm_does_not_count_the_last_token_as_cached() -> None:
    """A prompt that is entirely cached still needs its last token computed to sample."""
    p = make_pools()
    p.insert(seq(3, 10))
    req = make_req("a", seq(3, 10))
    policy("lpm", p.cache).order([req])
    assert req.match_len == 9
    p.check()


def test_fcfs_keeps_arrival_order_and_defers_nothing() -> None:
    p = make_pools()
    p.insert(seq(3, 20))
    shared = seq(50, 40)  # long uncached shared prefix: fcfs does not defer
    reqs = [make_req(f"r{i}", [*(seq(3, 20) if i % 2 else shared), 300 + i], arrival=float(i))
            for i in range(6)]
    rng = random.Random(0)
    shuffled = list(reqs)
    rng.shuffle(shuffled)
    ordered, deferred = policy("fcfs", p.cache).order(shuffled)
    assert rids(ordered) == rids(reqs)
    assert deferred == set()
    p.check()


def test_fcfs_matches_each_prompt_once_for_the_backlog() -> None:
    """Under fcfs (asked for, or lpm's fallback on a long queue) the order ignores the cache,
    but the pacer's backlog counts each waiting prompt past its cached prefix: each prompt is
    matched once when it enters the queue, and again after a retraction (`matched` reset)."""
    p = make_pools()
    cached = seq(3, 20)
    p.insert(cached)
    a, b = make_req("a", [*cached, 7, 8]), make_req("b", seq(200, 6))
    pol = policy("fcfs", p.cache)
    pol.order([a, b])
    assert (a.match_len, b.match_len) == (20, 0) and a.matched and b.matched
    p.insert([*cached, 7])  # the cache grows; a matched prompt is not matched again
    pol.order([a, b])
    assert a.match_len == 20
    a.matched = False  # as a retraction leaves it
    pol.order([a, b])
    assert a.match_len == 21
    for name, fallback in (("lpm", 1), ("fcfs", 128)):  # lpm's fcfs fallback does the same
        c = make_req("c", [*cached, 9])
        policy(name, p.cache, fallback=fallback).order([c, make_req("d", seq(300, 4))])
        assert c.match_len == 20
    fresh = make_req("e", [*cached, 9])
    policy("fcfs", p.cache, enabled=False).order([fresh])  # no cache: nothing matched
    assert fresh.match_len == 0 and not fresh.matched
    p.check()


@pytest.mark.parametrize("b_count", [2, 4])
def test_dfs_weight_keeps_subtrees_contiguous_heaviest_first(b_count: int) -> None:
    p = make_pools()
    a = seq(3, 8)
    a1 = [*a, *seq(20, 4)]
    a2 = [*a, *seq(30, 5)]
    b = seq(50, 9)
    for ids in (a1, a2, b):
        p.insert(ids)
    reqs = [
        make_req("x1", [*a1, 200, 201], arrival=1.0),
        make_req("x2", [*a2, 202, 203], arrival=3.0),
        make_req("x3", [*a2, 204, 205], arrival=4.0),
    ]
    ys = [make_req(f"y{i}", [*b, 210 + 2 * i, 211 + 2 * i], arrival=0.5 + 2.0 * i)
          for i in range(b_count)]
    waiting = sorted([*reqs, *ys], key=lambda r: r.arrival_time)
    ordered, deferred = policy("dfs-weight", p.cache).order(waiting)
    # Subtree A (a1: 1 request, a2: 2) weighs 3; B weighs `b_count`.
    a_part = ["x2", "x3", "x1"]  # inside A, the heavier a2 goes first; arrival order within a node
    b_part = [f"y{i}" for i in range(b_count)]
    expected = a_part + b_part if b_count < 3 else b_part + a_part
    assert rids(ordered) == expected
    assert deferred == set()
    p.check()


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("enabled", [True, False])
def test_starved_requests_go_first_in_every_policy(name: str, enabled: bool) -> None:
    p = make_pools()
    cached = seq(3, 30)
    p.insert(cached)
    cache: BasePrefixCache = p.cache if enabled else NoPrefixCache()
    # The two old requests have no cached prefix; the young ones match 30 tokens.
    old = [make_req("old0", seq(100, 5), arrival=0.0), make_req("old1", seq(120, 5), arrival=1.0)]
    young = [make_req(f"young{i}", [*cached, 300 + i], arrival=95.0 + i) for i in range(3)]
    now = [5.0]
    pol = SchedulePolicy(name, cache, enabled, 128, 10.0, clock=lambda: now[0])
    ordered, _ = pol.order([*young, *old[::-1]])
    if name == "lpm" and enabled:  # not starved yet: the policy decides (cache hits first)
        assert rids(ordered)[:3] == ["young0", "young1", "young2"]
    now[0] = 100.0  # old0/old1 have waited ≥ 10 s, the young ones 3..5 s
    ordered, deferred = pol.order([*young, *old[::-1]])
    assert rids(ordered)[:2] == ["old0", "old1"]
    assert set(rids(ordered)) == {r.rid for r in old + young}
    assert not deferred & {"old0", "old1"}
    p.check()


@pytest.mark.parametrize("name", CACHE_AWARE)
def test_starved_requests_still_share_their_uncached_prefix(name: str) -> None:
    """Aging reorders but does not turn sharing off: of several starved requests with one
    uncached prefix, only the first runs this step."""
    p = make_pools()
    shared = seq(10, 48)
    reqs = [make_req(f"s{i}", [*shared, 300 + i], arrival=float(i)) for i in range(3)]
    ordered, deferred = policy(name, p.cache, now=100.0).order(list(reqs))
    assert rids(ordered) == ["s0", "s1", "s2"]
    assert deferred == {"s1", "s2"}
    p.check()


def test_lpm_falls_back_to_fcfs_above_queue_len() -> None:
    p = make_pools()
    cached = seq(3, 20)
    p.insert(cached)
    shared = seq(100, 40)
    reqs = [
        make_req("a", [*shared, 1], arrival=0.0),
        make_req("b", [*shared, 2], arrival=1.0),
        make_req("c", [*cached, 3], arrival=2.0),
    ]
    ordered, deferred = policy("lpm", p.cache, fallback=3).order(list(reqs))
    assert rids(ordered) == ["c", "a", "b"] and deferred == {"b"}
    ordered, deferred = policy("lpm", p.cache, fallback=2).order(list(reqs))
    assert rids(ordered) == ["a", "b", "c"] and deferred == set()
    p.check()


@pytest.mark.parametrize("name", CACHE_AWARE)
def test_in_batch_deferral_only_first_of_shared_uncached_prefix_runs(name: str) -> None:
    p = make_pools()
    shared = seq(10, 40)
    reqs = [make_req(f"r{i}", [*shared, 300 + i, 301], arrival=float(i)) for i in range(3)]
    lone = make_req("lone", seq(100, 50), arrival=3.0)
    ordered, deferred = policy(name, p.cache).order([*reqs, lone])
    first = [r for r in ordered if r.rid.startswith("r")][0]
    assert first.rid == "r0"
    assert deferred == {"r1", "r2"}
    p.check()


@pytest.mark.parametrize("name", CACHE_AWARE)
@pytest.mark.parametrize("shared_len", [IN_BATCH_SHARE_MIN_TOKENS - 1, IN_BATCH_SHARE_MIN_TOKENS])
def test_in_batch_deferral_threshold(name: str, shared_len: int) -> None:
    p = make_pools()
    shared = seq(10, shared_len)
    reqs = [make_req(f"r{i}", [*shared, 300 + i, 301], arrival=float(i)) for i in range(3)]
    _, deferred = policy(name, p.cache).order(reqs)
    assert deferred == ({"r1", "r2"} if shared_len >= IN_BATCH_SHARE_MIN_TOKENS else set())


@pytest.mark.parametrize("name", CACHE_AWARE)
@pytest.mark.parametrize(("shared_len", "expect_deferred"), [(40, False), (60, True)])
def test_in_batch_deferral_counts_only_uncached_tokens(name: str, shared_len: int,
                                                       expect_deferred: bool) -> None:
    p = make_pools()
    shared = seq(10, shared_len)
    p.insert(shared[:20])  # 20 of the shared tokens are cached already
    reqs = [make_req(f"r{i}", [*shared, 300 + i, 301], arrival=float(i)) for i in range(3)]
    ordered, deferred = policy(name, p.cache).order(reqs)
    assert all(r.match_len == 20 for r in reqs)
    assert deferred == ({"r1", "r2"} if expect_deferred else set())
    assert ordered[0].rid not in deferred
    p.check()


@pytest.mark.parametrize("name", POLICIES)
def test_cache_disabled_is_fcfs_without_deferral(name: str) -> None:
    cache = NoPrefixCache()
    shared = seq(10, 64)
    reqs = [make_req(f"r{i}", [*shared, 300 + i], arrival=float(i)) for i in range(4)]
    ordered, deferred = policy(name, cache, enabled=False).order(reqs[::-1])
    assert rids(ordered) == rids(reqs)
    assert deferred == set()


# =============================================================================================
# 2. PrefillAdder
# =============================================================================================
def adder(p: Pools, running: Sequence[Req] = (), max_running: int = 64,
          max_prefill: int = 10_000, chunk: int = 10_000, ratio: float = 0.0,
          free_rows: int | None = None, clip: int = 10**9,
          step_cost: tuple[float, float] | None = None, decode_rows: int = 0,
          work: float = math.inf, pair_weight: float = 0.0) -> PrefillAdder:
    rows = p.req_pool.available_size() if free_rows is None else free_rows
    return PrefillAdder(p.kv, rows, list(running), max_running, max_prefill, chunk, ratio, clip,
                        step_cost, decode_rows, work_budget=work, pair_weight=pair_weight)


def unlock(p: Pools, reqs: Iterable[Req]) -> None:
    for r in reqs:
        p.kv.release(r)


def test_adder_respects_max_prefill_tokens() -> None:
    p = make_pools()
    reqs = [make_req("r0", seq(3, 5)), make_req("r1", seq(20, 30)), make_req("r2", seq(60, 4))]
    a = adder(p, max_prefill=25)
    assert [a.add(r) for r in reqs] == [True, True, False]
    assert [r.extend_len for r in a.admitted] == [5, 20]
    assert sum(r.extend_len for r in a.admitted) == 25
    assert a.has_chunked
    unlock(p, a.admitted)
    p.check()


def test_adder_respects_max_running_and_free_rows() -> None:
    p = make_pools()
    running = [make_req("run0", seq(3, 4)), make_req("run1", seq(8, 4))]
    reqs = [make_req(f"r{i}", seq(10 * i + 20, 5)) for i in range(3)]
    a = adder(p, running=running, max_running=3)
    assert [a.add(r) for r in reqs] == [True, False, False]
    unlock(p, a.admitted)
    a = adder(p, max_running=64, free_rows=2)
    assert [a.add(r) for r in reqs] == [True, True, False]
    unlock(p, reqs)
    p.check()


def test_adder_one_chunked_request_per_step() -> None:
    p = make_pools()
    reqs = [make_req("r0", seq(3, 3)), make_req("r1", seq(13, 10)), make_req("r2", seq(23, 1))]
    a = adder(p, chunk=8)
    assert [a.add(r) for r in reqs] == [True, True, False]
    assert [r.extend_len for r in a.admitted] == [3, 5]
    assert a.admitted[1].extend_len < a.admitted[1].seq_len() - a.admitted[1].kv_len
    unlock(p, reqs)

    # A continuing chunked request takes the budget first.
    mid = make_req("mid", seq(100, 30))
    mid.kv_len = 10
    a = adder(p, chunk=7)
    assert a.add_chunked(mid) and mid.extend_len == 7
    assert not a.add(make_req("new", seq(200, 3)))
    # Its final chunk leaves budget: one more request may start, chunked itself (the step has
    # used less than half its budget).
    a = adder(p, chunk=50)
    assert a.add_chunked(mid) and mid.extend_len == 20
    new = [make_req("n0", seq(200, 40)), make_req("n1", seq(250, 10))]
    assert a.add(new[0]) and new[0].extend_len == 30
    assert not a.add(new[1])
    unlock(p, new)
    p.check()


def test_adder_does_not_start_a_prompt_it_cannot_finish_late_in_a_step() -> None:
    """Four ~75-token agent calls under a 128-token budget, 2 decode rows: the first step
    finishes one call and does not start the next (its chunk would delay the first call's first
    token by more than one more step costs the calls queued after it); with many prompts
    queued, below half the budget used, or nothing measured (pacing off), chunks fill steps."""
    p = make_pools()
    cost = {"step_cost": (0.0035, 0.008), "decode_rows": 2}  # Zen 1-like b, c
    calls = [make_req(f"c{i}", seq(100 * i + 3, n)) for i, n in enumerate((75, 65, 86))]
    a = adder(p, chunk=128, **cost)
    # 1 x 53 x 3.5 ms = 186 ms > (1 + 1) x 8 ms x 3 = 48 ms: left out
    assert [a.add(r, behind=2 - i) for i, r in enumerate(calls)] == [True, False, False]
    assert [r.extend_len for r in a.admitted] == [75]
    assert not a.has_chunked
    unlock(p, a.admitted)
    a = adder(p, chunk=128, **cost)  # 56 queued behind: 186 ms < 57 x 24 ms: the step fills
    assert a.add(calls[0], behind=57) and a.add(calls[1], behind=56)
    assert calls[1].extend_len == 53 and a.has_chunked
    unlock(p, calls[:2])
    a = adder(p, chunk=128)  # nothing measured: the step fills
    assert a.add(calls[0], behind=2) and a.add(calls[1], behind=1) and a.has_chunked
    unlock(p, calls[:2])
    a = adder(p, chunk=128, **cost)  # whole prompts that fit are admitted however full the step
    short = [make_req("s0", seq(400, 70)), make_req("s1", seq(500, 50))]
    assert [a.add(r) for r in short] == [True, True]
    unlock(p, short)
    a = adder(p, chunk=128, **cost)
    small, long_ = make_req("small", seq(600, 40)), make_req("long", seq(700, 200))
    assert a.add(small) and a.add(long_) and long_.extend_len == 88 and a.has_chunked
    unlock(p, [small, long_])
    mid = make_req("mid", seq(900, 100))
    mid.kv_len = 30  # mid-chunk: its last 70 tokens finish this step, 55% of the budget
    a = adder(p, chunk=128, **cost)
    assert a.add_chunked(mid) and not a.add(make_req("next", seq(1100, 80)))
    p.check()


def test_adder_kv_room_counts_free_evictable_and_reserved() -> None:
    p = make_pools(slots=64)
    p.insert(seq(300, 20))  # 20 evictable
    held = p.kv_pool.alloc(14)  # e.g. a running request's private tail
    assert held is not None
    assert p.kv_pool.available_size() == 30 and p.cache.evictable_size() == 20
    running = [make_req("run", seq(3, 5), max_new=20)]
    a = adder(p, running=running, ratio=0.5)  # reserves int(20 * 0.5) = 10
    # room = 30 + 20 - 10 = 40
    big = make_req("big", seq(100, 26), max_new=20)  # nothing cached: all 26 tokens computed
    assert a.add(big) and big.extend_len == 26  # 26 + 10 = 36 <= 40
    # room now 50 - (10 + 36) = 4
    assert not a.add(make_req("over", seq(150, 4), max_new=2))  # 4 + 1 > 4
    exact = make_req("exact", seq(160, 3), max_new=2)  # 3 + 1 == 4
    assert a.add(exact)
    assert not a.add(make_req("one", [170], max_new=1))  # 1 + 0 > 0
    unlock(p, a.admitted)
    p.check(held=[held])


def test_prefill_pacer_cap_follows_the_measured_rate() -> None:
    pacer = PrefillPacer(0.5, ceiling=2048)
    assert pacer.token_cap() == 2048  # nothing measured yet
    pacer.observe([(50, 0)], 1.0)  # a short step (< half the floor): fixed costs, not a rate
    assert pacer.rate is None and pacer.token_cap() == 2048
    pacer.observe([(2048, 0)], 2.0)  # 1024 tok/s -> 512 tokens in 0.5 s
    assert pacer.rate == pytest.approx(1024) and pacer.token_cap() == 512
    pacer.observe([(512, 0)], 0.25)  # 2048 tok/s, weighted in (a weighted least-squares rate)
    assert 1024 < pacer.rate < 2048 and pacer.token_cap() == int(pacer.rate * 0.5)
    for _ in range(3):
        pacer.observe([(1000, 0)], 100.0)  # very slow steps: the floor holds
    assert pacer.token_cap() == PrefillPacer.MIN_TOKENS
    fast = PrefillPacer(0.5, ceiling=2048)
    fast.observe([(2048, 0)], 0.01)  # a GPU: the ceiling alone applies
    assert fast.token_cap() == 2048
    off = PrefillPacer(0.0, ceiling=2048)
    off.observe([(2048, 0)], 10.0)
    assert off.rate is None and off.token_cap() == 2048
    # A fresh server whose prompts are all shorter than half the ceiling still measures its
    # rate (stop 49: against the cap alone it never did, and never paced).
    fresh = PrefillPacer(0.25, ceiling=2048)
    fresh.observe([(748, 0)], 2.9)
    assert fresh.rate == pytest.approx(748 / 2.9) and fresh.token_cap() == PrefillPacer.MIN_TOKENS


def test_prefill_pacer_gives_costly_decode_rows_a_larger_prefill() -> None:
    """A mixed step's prefill gets max(target - D, DECODE_SHARE x D) seconds, D being its decode
    rows' measured cost: cheap rows leave the step at about the target, costly ones (64 rows on
    a slow CPU) make the prefill DECODE_SHARE times as long as they are."""
    b, c = 1 / 400, 0.005  # 400 prefill tok/s; 5 ms per decode row (Zen 1-like)
    pacer = PrefillPacer(0.25, ceiling=2048, floor=16)
    assert pacer.step_cost() is None  # nothing measured
    pacer.observe([(1024, 0)], 1024 * b)  # a prefill step alone
    assert pacer.rate == pytest.approx(400) and pacer.decode_seconds(8) == 0.0
    assert pacer.step_cost() == pytest.approx((b, b))  # c not told apart yet: taken as b
    assert pacer.token_cap(64) == 100  # the rows' cost is not known yet: the target alone
    for rows in (8, 24, 64):
        pacer.observe([], rows * c, rows)  # plain decode steps
    for rows in (8, 40):  # mixed steps: their prefill time is told from their rows' time
        tokens = pacer.token_cap(rows)
        pacer.observe([(tokens, 0)], tokens * b + rows * c, rows)
    assert pacer.rate == pytest.approx(400, rel=1e-6)
    assert pacer.decode_seconds(64) == pytest.approx(64 * c, rel=1e-6)
    assert pacer.step_cost() == pytest.approx((b, c), rel=1e-6)
    assert abs(pacer.token_cap(0) - 100) <= 1  # 0.25 s of prefill
    assert abs(pacer.token_cap(8) - (0.25 - 8 * c) * 400) <= 1  # the step stays at about the target
    assert abs(pacer.token_cap(64) - PrefillPacer.DECODE_SHARE * 64 * c * 400) <= 1  # 3 x 0.32 s
    small = PrefillPacer(0.25, ceiling=256, floor=16)
    small.cost = pacer.cost
    assert small.token_cap(64) == 256



def _measured_pacer(b: float, c: float, target_s: float = 0.25, **kw: float) -> PrefillPacer:
    """A pacer whose fit holds b seconds per prefill token and c per decode row."""
    pacer = PrefillPacer(target_s, ceiling=4096, floor=16, **kw)
    pacer.observe([(1024, 0)], 1024 * b)  # a prefill step alone
    for rows in (8, 24, 64):
        pacer.observe([], rows * c, rows)  # plain decode steps
    for rows, tokens in ((8, 90), (40, 300)):  # mixed steps tell the rows' time apart
        pacer.observe([(tokens, 0)], tokens * b + rows * c, rows)
    assert pacer.step_cost() == pytest.approx((b, c), rel=1e-6)
    return pacer


def test_prefill_pacer_calls_a_backlog_from_the_queue_and_the_rows() -> None:
    """W prompts of Q seconds' prefill in all are a backlog worth holding D seconds of decode
    rows back for when both W x D and Q / W exceed the mixed step's prefill P: not a few
    prompts, not cheap ones (follow-up turns over a cached conversation), not without decode
    rows or before their cost is measured, and never with max_stall at most the target."""
    b, c = 1 / 400, 0.005  # 400 prefill tok/s; 5 ms per decode row
    pacer = _measured_pacer(b, c, max_stall_s=1.0)
    assert pacer.prefill_seconds(16) == pytest.approx(0.24)  # D = 80 ms: max(170, 3 x 80) ms
    assert not pacer.backlogged(16, 3, 3 * 300.0)  # 3 D = 240 ms: not more than P
    assert pacer.backlogged(16, 4, 4 * 300.0)  # 4 D = 320 ms, 0.75 s a prompt
    assert not pacer.backlogged(16, 40, 40 * 80.0)  # 0.2 s a prompt: cheap
    assert pacer.backlogged(16, 40, 40 * 120.0)  # 0.3 s a prompt
    assert not pacer.backlogged(0, 40, 40 * 300.0)  # nothing decoding
    assert not pacer.backlogged(2, 7, 7 * 300.0)  # 7 x 10 ms < target - D
    assert pacer.backlogged(2, 30, 30 * 300.0)  # 300 ms > 240 ms
    assert not pacer.backlogged(16, 0, 0.0)
    for max_stall in (0.0, 0.25):
        assert not _measured_pacer(b, c, max_stall_s=max_stall).backlogged(16, 40, 12000.0)
    assert not PrefillPacer(0.25, ceiling=512, max_stall_s=1.0).backlogged(16, 40, 12000.0)


def test_a_backlog_holds_the_decode_rows_back_within_the_stall_bound(
        make_sched: Callable[..., Scheduler]) -> None:
    """Behind four decoding requests, twelve queued prompts are a backlog: steps prefill alone
    (what a mixed step would prefill, without the rows' time), a decoding step comes whenever
    the next would end past `decode_stall_max_ms` after the last one, the queue is admitted
    sooner than with mixed steps alone (`decode_stall_max_ms` at the target), and the greedy
    tokens are unchanged. Time is simulated: each step takes its prefill tokens x b, plus
    rows x c when it decodes."""
    b, c = 1 / 200, 0.01  # 200 prefill tok/s, 10 ms per decode row
    rng = random.Random(9)
    first = {f"d{i}": (prompt(rng, 6), 60) for i in range(4)}
    queued = {f"q{i}": (prompt(rng, 40), 4) for i in range(12)}
    ref = reference(make_sched, {**first, **queued})

    def admitted_after(stall_ms: int) -> tuple[float, int]:
        """Simulated seconds until the queue is admitted, and the steps that prefilled alone."""
        sched = make_sched(prefill_step_target_ms=100, decode_stall_max_ms=stall_ms)
        pacer = PrefillPacer(0.1, sched.args.chunked_prefill_size, floor=4,
                             max_stall_s=stall_ms / 1000)
        pacer.cost = _measured_pacer(b, c).cost
        pacer.observe = lambda *args: None  # type: ignore[method-assign]
        sched.pacer = pacer
        submit(sched, first)
        run = Run()
        while len(sched.running) < len(first):
            run.record(sched)
        submit(sched, queued)
        seconds = stalled = 0.0  # stalled: since the last step that decoded
        alone = 0
        while sched.waiting or sched.chunked_req is not None:
            before = {r.rid: len(r.output_ids) for r in sched.running}
            todo = [*sched.waiting, *([sched.chunked_req] if sched.chunked_req else [])]
            kv = {id(r): r.kv_len for r in todo}
            expected = pacer.prefill_seconds(len(before))
            sched._decode_t = time.perf_counter() - stalled  # the simulated stall
            run.record(sched)
            prefill = sum(r.extend_len for r in todo if r.kv_len != kv[id(r)]) * b
            assert prefill <= expected + b
            if any(len(r.output_ids) > before[r.rid] for r in sched.running if r.rid in before):
                seconds += prefill + len(before) * c
                stalled = 0.0
            else:
                alone += 1
                seconds += prefill
                stalled += expected
                assert stalled <= stall_ms / 1000 + 1e-9
        held = sched.stats()["held_totals"]
        assert held["steps"] == alone and held["decode_rows"] >= 4 * alone  # type: ignore[index]
        run.drive(sched)
        for rid in {**first, **queued}:
            assert run.tokens[rid] == ref[rid], rid
        assert_clean(sched)
        return seconds, alone

    (held, alone), (mixed, never) = admitted_after(600), admitted_after(100)
    assert alone > 0 and never == 0 and held < mixed


def test_prefill_work_counts_attention_pairs_and_tokens_within_inverts_it() -> None:
    """A chunk's work is its tokens plus pair_weight per causal (query, key) pair;
    `tokens_within` gives the most tokens whose work fits, for any prefix and weight."""
    assert prefill_work(4, 10, 0.0) == 4
    # 4 queries over 10 cached keys plus 1..4 of their own: 40 + 10 pairs
    assert prefill_work(4, 10, 0.5) == pytest.approx(4 + 0.5 * 50)
    rng = random.Random(3)
    for _ in range(500):
        w = rng.choice((0.0, 1e-4, 3.3e-4, 5e-3, 0.3))
        prefix, work = rng.randrange(0, 9000), rng.uniform(0, 5000)
        n = tokens_within(work, prefix, w)
        assert n >= 0 and prefill_work(n, prefix, w) <= work + 1e-9
        assert prefill_work(n + 1, prefix, w) > work
    assert tokens_within(0.5, 0, 0.0) == 0


def test_prefill_pacer_holds_the_target_deep_in_a_long_prompt() -> None:
    """Steps whose time follows the work model (b per token, b x weight per attention pair):
    once the pacer has measured b, a chunk 4000 tokens into a prompt gets fewer tokens than one
    at its start and both take about the target; counted in tokens (weight 0, b averaged over the
    chunks seen) the deep chunk overshoots by 1.6x."""
    weight, b, target = 5e-4, 1 / 2000, 0.25

    def seconds(n: int, prefix: int) -> float:
        return b * prefill_work(n, prefix, weight)

    for w, deep_over in ((weight, 1.05), (0.0, None)):
        pacer = PrefillPacer(target, ceiling=2048, prior_weight=w)
        prefix = 0
        for _ in range(12):  # one long prompt, chunk by chunk, the pacer learning as it goes
            n = pacer.token_cap(0, prefix)
            pacer.observe([(n, prefix)], seconds(n, prefix))
            prefix += n
        start, deep = pacer.token_cap(0, 0), pacer.token_cap(0, 4000)
        if deep_over is not None:
            assert deep < 0.5 * start
            for n, at in ((start, 0), (deep, 4000)):
                assert 0.9 * target <= seconds(n, at) <= deep_over * target
        else:
            assert deep == start and seconds(deep, 4000) > 1.5 * target
    assert PrefillPacer(target, ceiling=64, prior_weight=weight).token_cap(0, 4000) == 64


def test_prefill_pacer_measures_the_pair_weight_of_its_cpu() -> None:
    """The pair weight is a prior (Zen 4's): on a CPU whose attention costs 3x or 1/3 of what it
    predicts, short fresh prompts (little attention) leave the weight near the prior, and a long
    document's chunks measure the CPU's own: a chunk 4000 tokens deep then takes about the
    target, where the prior's chunk would take 1.7x it (or 0.6x). A weight far off is held
    within 4x the prior."""
    prior, b, target = 5e-4, 1 / 2000, 0.25

    for factor in (3.0, 1 / 3, 20.0):
        true = prior * factor

        def seconds(n: int, prefix: int, w: float = true) -> float:
            return b * prefill_work(n, prefix, w)

        pacer = PrefillPacer(target, ceiling=2048, prior_weight=prior)
        assert pacer.pair_weight == prior
        for n in (300, 500, 400, 450):
            pacer.observe([(n, 0)], seconds(n, 0))
        assert pacer.pair_weight == pytest.approx(prior, rel=0.35)
        prefix = 0
        for _ in range(16):  # one long document, chunk by chunk
            n = pacer.token_cap(0, prefix)
            pacer.observe([(n, prefix)], seconds(n, prefix))
            prefix += n
        if factor == 20.0:
            assert pacer.pair_weight == pytest.approx(4 * prior)
            continue
        assert pacer.pair_weight == pytest.approx(true, rel=0.15)
        deep = pacer.token_cap(0, 4000)
        assert 0.9 * target <= seconds(deep, 4000) <= 1.1 * target
        at_prior = tokens_within(target / b, 4000, prior)
        assert not 0.7 * target <= seconds(at_prior, 4000) <= 1.3 * target
    # Noisy step times (+-10%) of short fresh prompts, where attention is a few percent of a
    # step, do not move the weight far from the prior.
    for seed in range(10):
        rng = random.Random(seed)
        pacer = PrefillPacer(target, ceiling=2048, prior_weight=prior)
        for _ in range(60):
            n = rng.randint(64, 600)
            pacer.observe([(n, 0)], b * prefill_work(n, 0, prior) * rng.uniform(0.9, 1.1))
        assert 0.6 * prior <= pacer.pair_weight <= 1.5 * prior


def test_adder_gives_a_chunk_over_a_long_prefix_fewer_tokens() -> None:
    """With a work budget the adder cuts each prompt where its work (tokens plus attention over
    the cached prefix) fills the budget: behind 100 cached tokens a prompt gets fewer tokens
    than a fresh one; a second request gets what work is left; the first always gets one."""
    p = make_pools(slots=512, ctx=512)
    cached = seq(1000, 100)
    p.insert(cached)
    w = 0.05
    fresh = make_req("fresh", seq(3, 300))
    deep = make_req("deep", cached + seq(200, 200))
    a = adder(p, work=60, pair_weight=w)
    assert a.add(fresh) and not a.add(deep)
    assert fresh.extend_len == tokens_within(60, 0, w) and a.has_chunked
    unlock(p, a.admitted)
    a = adder(p, work=60, pair_weight=w)
    assert a.add(deep)
    assert deep.extend_len == tokens_within(60, 100, w) < fresh.extend_len
    assert prefill_work(deep.extend_len, 100, w) <= 60
    unlock(p, a.admitted)
    small = [make_req("s0", seq(3, 4)), make_req("s1", seq(50, 30))]
    a = adder(p, work=prefill_work(4, 0, w) + 10, pair_weight=w)
    assert [a.add(r) for r in small] == [True, True]
    assert small[1].extend_len == tokens_within(10, 0, w)
    unlock(p, a.admitted)
    tiny = make_req("tiny", cached + seq(200, 8))
    a = adder(p, work=0.5, pair_weight=w)  # under one token's work: the first still moves
    assert a.add(tiny) and tiny.extend_len == 1
    unlock(p, a.admitted)
    p.check()


def test_prefill_step_target_is_validated_and_on_the_cli() -> None:
    with pytest.raises(ValueError, match="ServerArgs.prefill_step_target_ms"):
        ServerArgs(prefill_step_target_ms=-1)
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    args = args_from_namespace(ap.parse_args(["--prefill-step-target-ms", "0",
                                              "--decode-stall-max-ms", "600"]))
    assert args.prefill_step_target_ms == 0 and ServerArgs().prefill_step_target_ms == 250
    assert args.decode_stall_max_ms == 600 and ServerArgs().decode_stall_max_ms == 1000
    with pytest.raises(ValueError, match="ServerArgs.decode_stall_max_ms"):
        ServerArgs(decode_stall_max_ms=-1)


def test_adder_alone_ignores_its_own_decode_reserve() -> None:
    p = make_pools(slots=32)
    held = p.kv_pool.alloc(22)
    assert held is not None
    a = adder(p, ratio=1.0)
    r = make_req("a", seq(3, 10), max_new=500)
    assert a.add(r)  # 10 <= 10 free, although its reserve is 500
    assert not a.add(make_req("b", [40], max_new=1))
    a = adder(p, ratio=1.0)
    assert not a.add(make_req("c", seq(50, 11), max_new=1))  # 11 > 10 even alone
    p.check(held=[held])


def test_adder_locks_matched_prefix_and_unlocks_on_refusal() -> None:
    p = make_pools(slots=32)
    prefix = seq(3, 10)
    slots = p.insert(prefix)
    held = p.kv_pool.alloc(21)  # 1 free slot, 10 evictable (the prefix)
    assert held is not None

    x = make_req("x", [*prefix, 50, 51])
    a = adder(p)
    # Room must be computed after locking: the locked prefix cannot be evicted for the new
    # tokens, so 2 new tokens do not fit in 1 free slot.
    assert not a.add(x)
    assert p.cache.protected_size() == 0 and p.cache.evictable_size() == 10
    assert x.kv_len == 0 and len(x.prefix_indices) == 0 and x.cached_tokens is None
    p.cache.check_invariants()

    p.kv_pool.free(held[:5])
    a = adder(p)
    assert a.add(x)
    assert p.cache.protected_size() == 10 and p.cache.evictable_size() == 0
    assert torch.equal(x.prefix_indices, slots)
    assert x.kv_len == 10 and x.extend_len == 2 and x.cached_tokens == 10
    y = make_req("y", [*prefix, 60, 61])
    assert a.add(y)  # same prefix: a second lock, same protected size
    assert p.cache.protected_size() == 10 and y.last_node is x.last_node
    assert y.last_node.lock_ref == 2
    z = make_req("z", [*prefix[:5], 70, 71, 72, 73])  # splits the prefix node; does not fit
    assert not a.add(z)
    assert p.cache.protected_size() == 10 and p.cache.evictable_size() == 0
    p.cache.check_invariants()
    unlock(p, [x, y])
    assert p.cache.protected_size() == 0 and p.cache.evictable_size() == 10
    p.check(held=[held[5:]])


# =============================================================================================
# 3. Scheduler with the tiny model
# =============================================================================================
def greedy(max_new: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 390) for _ in range(n)]


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, ReqTokenOut] = field(default_factory=dict)
    first_out: dict[str, ReqTokenOut] = field(default_factory=dict)
    steps: int = 0

    def record(self, sched: Scheduler) -> list[ReqTokenOut]:
        out = sched.step()
        sched.check_invariants()
        self.steps += 1
        outs = out.outs if out is not None else []
        seen = set()
        for o in outs:
            assert o.rid not in seen, f"{o.rid}: two outs in one step"
            seen.add(o.rid)
            assert o.rid not in self.finals, f"{o.rid}: out after its final out"
            toks = self.tokens.setdefault(o.rid, [])
            toks.extend(o.new_ids)
            self.first_out.setdefault(o.rid, o)
            assert o.completion_tokens == len(toks), f"{o.rid}: completion_tokens off"
            if o.finish_reason is not None:
                self.finals[o.rid] = o
        return outs

    def drive(self, sched: Scheduler, max_steps: int = 5000) -> Run:
        while sched.has_work:
            assert self.steps < max_steps, "scheduler does not converge"
            self.record(sched)
        assert sched.step() is None
        return self


@pytest.fixture
def make_sched(tiny_llama_dir: Path) -> Callable[..., Scheduler]:
    def make(**kw: object) -> Scheduler:
        kw.setdefault("max_total_tokens", 1024)
        kw.setdefault("dtype", "float32")  # parity with the fp32 HF reference
        args = ServerArgs(model_path=str(tiny_llama_dir), num_threads=1, **kw)  # type: ignore[arg-type]
        return Scheduler(args, ModelRunner(args))

    return make


_REF_CACHE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference(make: Callable[..., Scheduler], jobs: dict[str, tuple[list[int], int]]
              ) -> dict[str, list[int]]:
    """Greedy tokens of each (prompt, max_new) from a roomy scheduler, radix cache disabled."""
    todo = {k: v for k, v in jobs.items() if (tuple(v[0]), v[1]) not in _REF_CACHE}
    if todo:
        sched = make(max_total_tokens=2048, disable_radix_cache=True)
        for rid, (ids, n) in todo.items():
            sched.handle(GenerateReq(rid, ids, greedy(n)))
        run = Run().drive(sched)
        for rid, (ids, n) in todo.items():
            assert run.finals[rid].finish_reason == FINISH_LENGTH
            _REF_CACHE[(tuple(ids), n)] = run.tokens[rid]
    return {rid: _REF_CACHE[(tuple(ids), n)] for rid, (ids, n) in jobs.items()}


def assert_clean(sched: Scheduler) -> None:
    """Nothing live, no lock left; after a flush every slot and row is free."""
    sched.check_invariants()
    assert not sched.live_reqs() and not sched.has_work
    assert sched.cache.protected_size() == 0
    kv, rp = sched.kv_pool, sched.req_pool
    assert kv.available_size() + sched.cache.evictable_size() == kv.size
    assert rp.available_size() == rp.size
    ok, err = sched.flush_cache()
    assert ok, err
    assert kv.available_size() == kv.size and rp.available_size() == rp.size
    assert sched.cache.total_size() == 0 and sched.cache.owned_slots().numel() == 0
    sched.check_invariants()


def submit(sched: Scheduler, jobs: dict[str, tuple[list[int], int]]) -> None:
    for rid, (ids, n) in jobs.items():
        sched.handle(GenerateReq(rid, ids, greedy(n)))


def pressure_jobs(seed: int = 0, n: int = 6) -> dict[str, tuple[list[int], int]]:
    rng = random.Random(seed)
    return {f"r{i}": (prompt(rng, rng.randrange(8, 17)), 24) for i in range(n)}


TINY_POOL = {"max_total_tokens": 64, "init_new_token_ratio": 0.1, "min_new_token_ratio": 0.05}


# -- the greedy fast path takes the LM head's picks ---------------------------------------------
def test_all_greedy_steps_sample_the_ids_the_lm_head_picked(
        make_sched: Callable[..., Scheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose rows are all greedy runs `ModelRunner.forward_greedy` and samples its ids
    (here forged: token 7); a step with a sampled row or a logprobs row runs `forward` and the
    sampler picks from the logits."""
    sched = make_sched()
    runner = sched.runner
    calls = {"greedy": 0, "plain": 0}
    real_greedy, real_forward = runner.forward_greedy, runner.forward

    def forged(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls["greedy"] += 1
        logits, _ = real_greedy(fb)
        return logits, torch.full((fb.batch_size,), 7, dtype=torch.long)

    def plain(fb: ForwardBatch) -> torch.Tensor:
        calls["plain"] += 1
        return real_forward(fb)

    monkeypatch.setattr(runner, "forward_greedy", forged)
    monkeypatch.setattr(runner, "forward", plain)
    ids = prompt(random.Random(5), 10)
    sched.handle(GenerateReq("g", ids, greedy(4)))
    run = Run().drive(sched)
    assert run.tokens["g"] == [7] * 4 and calls == {"greedy": 4, "plain": 0}
    sampled = SamplingParams(max_new_tokens=3, temperature=1.0, seed=3, ignore_eos=True)
    sched.handle(GenerateReq("s", ids, sampled))
    sched.handle(GenerateReq("l", ids, greedy(3, logprobs=True)))
    run = Run().drive(sched)
    assert calls["greedy"] == 4 and calls["plain"] >= 3
    ref = reference(make_sched, {"l": (ids, 3)})["l"]
    assert run.tokens["l"] == ref  # picked from the logits, not forged
    assert_clean(sched)


# -- (a) retraction keeps outputs ---------------------------------------------------------------
@pytest.mark.parametrize("name", POLICIES)
def test_outputs_identical_under_retraction(make_sched: Callable[..., Scheduler], name: str) -> None:
    jobs = pressure_jobs()
    ref = reference(make_sched, jobs)
    sched = make_sched(schedule_policy=name, **TINY_POOL)
    submit(sched, jobs)
    run = Run().drive(sched)
    st = sched.stats()
    assert st["retractions_total"] > 0 and st["evicted_tokens_total"] > 0
    for rid, (ids, n) in jobs.items():
        fin = run.finals[rid]
        assert fin.finish_reason == FINISH_LENGTH and not fin.error
        assert fin.completion_tokens == n and fin.prompt_tokens == len(ids)
        assert run.tokens[rid] == ref[rid], rid
    assert st["num_finished_requests_total"] == len(jobs)
    assert st["generated_tokens_total"] == sum(n for _, n in jobs.values())
    assert st["prompt_tokens_total"] == sum(len(ids) for ids, _ in jobs.values())
    assert_clean(sched)


# -- (e) retracted requests hit the cache on re-admission ---------------------------------------
@pytest.mark.parametrize("name", ["lpm", "fcfs"])
def test_retracted_requests_readmitted_with_cache_hit(make_sched: Callable[..., Scheduler],
                                                      name: str) -> None:
    """... and the policy's `match_len` (the backlog's count) is matched again after a
    retraction (`matched` reset, set again by the policy before re-admission), under fcfs too."""
    jobs = pressure_jobs(seed=1)
    ref = reference(make_sched, jobs)
    sched = make_sched(schedule_policy=name, **TINY_POOL)
    readmits: list[tuple[str, int, int, int]] = []  # rid, prefix, computed (first chunk), seq_len
    orig = sched.builder.build_extend
    orig_retract = sched._retract

    def spy(reqs: list[Req]) -> ForwardBatch:
        for r in reqs:
            if r.req_pool_idx is None and r.num_retractions > 0:
                readmits.append((r.rid, r.kv_len, r.extend_len, r.seq_len()))
                assert r.matched, r.rid
        return orig(reqs)

    def retract_spy(need: int) -> None:
        before = {r.rid: r.num_retractions for r in sched.live_reqs()}
        orig_retract(need)
        moved = [r for r in sched.waiting if r.num_retractions > before.get(r.rid, 0)]
        assert moved and not any(r.matched for r in moved)

    sched.builder.build_extend = spy  # type: ignore[method-assign]
    sched._retract = retract_spy  # type: ignore[method-assign]
    submit(sched, jobs)
    run = Run().drive(sched)
    assert sched.stats()["retractions_total"] > 0
    assert readmits, "retracted requests were never re-admitted"
    for _rid, prefix, computed, total in readmits:
        assert prefix + computed == total  # unchunked: the rest of the sequence in one go
    hits = [r for r in readmits if r[1] > 0]
    assert hits, f"no re-admission hit the cache: {readmits}"
    # Re-prefill computes fewer tokens than the full sequences.
    assert sum(r[2] for r in readmits) < sum(r[3] for r in readmits)
    # cached_tokens reports the first admission only (retraction hits are not prompt hits).
    for rid in jobs:
        assert run.finals[rid].cached_tokens == run.first_out[rid].cached_tokens
        assert run.tokens[rid] == ref[rid]
    assert_clean(sched)


def test_retracted_request_kv_goes_to_tree(make_sched: Callable[..., Scheduler]) -> None:
    """Right after a retraction the victims hold no row, slot or lock, and their whole computed
    KV is in the tree, unlocked (evictable), before the decode allocation evicts anything."""
    jobs = pressure_jobs(seed=2)
    sched = make_sched(**TINY_POOL)
    orig = sched._retract
    checked = [0]

    def spy(need: int) -> None:
        kv_before = {r.rid: (r.all_ids()[: r.kv_len], r.kv_len) for r in sched.running}
        evictable = sched.cache.evictable_size()
        orig(need)
        sched.check_invariants()
        victims = [r for r in sched.waiting if r.rid in kv_before]
        assert victims and victims[0] is sched.waiting[0]
        running_arrivals = [r.arrival_time for r in sched.running]
        for v in victims:
            assert v.req_pool_idx is None and v.kv_len == 0 and v.last_node is None
            assert all(v.arrival_time >= a for a in running_arrivals)  # newest go first
            key, kv_len = kv_before[v.rid]
            assert int(sched.cache.match_prefix(key).indices.numel()) == kv_len
        assert sched.cache.evictable_size() > evictable
        assert sched.kv_pool.available_size() + sched.cache.evictable_size() >= len(sched.running)
        checked[0] += 1

    sched._retract = spy  # type: ignore[method-assign]
    submit(sched, jobs)
    Run().drive(sched)
    assert checked[0] > 0
    assert_clean(sched)


@pytest.mark.parametrize("radix", [True, False])
def test_mid_chunk_request_is_retracted_instead_of_starving_decode(
        make_sched: Callable[..., Scheduler], radix: bool) -> None:
    """Regression: a mid-prefill `chunked_req` holds KV but is not in `running`. When the last
    running request needs a decode slot and only the chunked request's KV is left, it must go
    back to the queue (it used to fail the batch: "need 1 KV slots, 0 free")."""
    rng = random.Random(12)
    jobs = {"a": (prompt(rng, 10), 45), "b": (prompt(rng, 58), 3)}
    ref = reference(make_sched, jobs)
    sched = make_sched(max_total_tokens=64, chunked_prefill_size=4, init_new_token_ratio=0.05,
                       min_new_token_ratio=0.05, disable_radix_cache=not radix)
    chunked_retracted = [0]
    orig = sched._retract

    def spy(need: int) -> None:
        chunked = sched.chunked_req
        orig(need)
        if chunked is not None and sched.chunked_req is None:
            assert chunked in sched.waiting and chunked.req_pool_idx is None
            chunked_retracted[0] += 1

    sched._retract = spy  # type: ignore[method-assign]
    run = Run()
    submit(sched, {"a": jobs["a"]})
    _advance_until(sched, run, lambda: bool(sched.running and sched.running[0].output_ids))
    submit(sched, {"b": jobs["b"]})
    run.drive(sched)
    assert chunked_retracted[0] > 0
    for rid in jobs:
        assert run.finals[rid].finish_reason == FINISH_LENGTH, run.finals[rid]
        assert run.tokens[rid] == ref[rid]
    assert_clean(sched)


# -- (b) chunked prefill --------------------------------------------------------------------------
@pytest.mark.parametrize(("chunk", "max_prefill"), [(7, 8192), (2048, 5), (7, 9)])
@pytest.mark.parametrize("radix", [True, False])
def test_chunked_prefill_matches_unchunked(make_sched: Callable[..., Scheduler], chunk: int,
                                          max_prefill: int, radix: bool) -> None:
    rng = random.Random(3)
    base = prompt(rng, 20)
    jobs = {f"c{i}": (prompt(rng, rng.randrange(5, 41)), 6) for i in range(4)}
    jobs["s0"] = ([*base, *prompt(rng, 9)], 5)  # shared prefixes: chunks meet the tree
    jobs["s1"] = ([*base, *prompt(rng, 15)], 5)
    jobs["one"] = (prompt(rng, 23), 1)
    ref = reference(make_sched, jobs)
    sched = make_sched(chunked_prefill_size=chunk, max_prefill_tokens=max_prefill,
                       disable_radix_cache=not radix)
    budget = min(chunk, max_prefill)
    steps_per_req: dict[str, int] = {}
    orig = sched.builder.build_extend

    def spy(reqs: list[Req]) -> ForwardBatch:
        ext = [r for r in reqs if r not in sched.running]  # a mixed step's decode rows aside
        assert sum(r.extend_len for r in ext) <= budget
        assert sum(r.kv_len + r.extend_len < r.seq_len() for r in ext) <= 1  # ≤ 1 chunked
        for r in ext:
            steps_per_req[r.rid] = steps_per_req.get(r.rid, 0) + 1
        return orig(reqs)

    sched.builder.build_extend = spy  # type: ignore[method-assign]
    submit(sched, jobs)
    run = Run()
    while sched.has_work:
        run.record(sched)
        c = sched.chunked_req
        if c is not None:  # mid-chunk: holds a row, no token yet, counted as running
            assert c.req_pool_idx is not None and not c.output_ids and 0 < c.kv_len < c.seq_len()
            assert sched.stats()["num_running"] == len(sched.running) + 1
    run.drive(sched)
    assert max(steps_per_req.values()) >= 3
    for rid in jobs:
        assert run.finals[rid].finish_reason == FINISH_LENGTH
        assert run.tokens[rid] == ref[rid], rid
    assert_clean(sched)


def test_paced_prefill_steps_keep_outputs(make_sched: Callable[..., Scheduler]) -> None:
    """With a measured rate of 120 tok/s and a 100 ms target, no step prefills more than 12
    tokens (prompts are chunked to fit), and the greedy tokens are unchanged."""
    rng = random.Random(5)
    jobs = {f"p{i}": (prompt(rng, rng.randrange(20, 41)), 6) for i in range(4)}
    ref = reference(make_sched, jobs)
    sched = make_sched(prefill_step_target_ms=100)
    sched.pacer = PrefillPacer(0.1, sched.args.chunked_prefill_size, floor=4)
    sched.pacer.cost.observe(120, 0, 1.0)  # 120 prefill tok/s, decode rows' cost unknown
    sched.pacer.observe = lambda *args: None  # type: ignore[method-assign]
    assert sched.pacer.cap() == sched.pacer.cap(3) == 12
    seen: list[int] = []
    orig = sched.builder.build_extend

    def spy(reqs: list[Req]) -> ForwardBatch:
        seen.append(sum(r.extend_len for r in reqs if r not in sched.running))
        return orig(reqs)

    sched.builder.build_extend = spy  # type: ignore[method-assign]
    submit(sched, jobs)
    run = Run().drive(sched)
    assert seen and max(seen) == 12 and len(seen) >= sum(len(i) for i, _ in jobs.values()) // 12
    for rid in jobs:
        assert run.tokens[rid] == ref[rid], rid
    assert sched.stats()["prefill_token_cap"] == 12
    assert sched.stats()["prefill_work_cap"] == 12
    assert_clean(sched)
    # before any prefill step the work budget is unbounded: stats say None (they travel as
    # JSON, which has no infinity), the token cap is the chunk size
    fresh = make_sched(prefill_step_target_ms=100).stats()
    assert fresh["prefill_work_cap"] is None
    assert fresh["prefill_token_cap"] == sched.args.chunked_prefill_size
    json.dumps(fresh, allow_nan=False)


def test_warm_up_measures_the_prefill_rate_and_gives_everything_back(
        make_sched: Callable[..., Scheduler]) -> None:
    """A fresh scheduler has no prefill rate: its first step may take a whole
    `chunked_prefill_size` chunk. `warm_up` times dummy prefills (the pacer observes a median),
    leaving the pools as they were, nothing cached or counted, and requests then run as before."""
    sched = make_sched(prefill_step_target_ms=50, chunked_prefill_size=512)
    assert sched.pacer.rate is None
    free = (sched.kv_pool.available_size(), sched.req_pool.available_size())
    seconds = sched.warm_up(tokens=200)
    assert seconds is not None and seconds > 0
    assert sched.pacer.rate == pytest.approx(sched.pacer.work([(200, 0)]) / seconds)
    assert sched.stats()["prefill_work_cap"] is not None
    assert (sched.kv_pool.available_size(), sched.req_pool.available_size()) == free
    assert sched.cache.evictable_size() == 0 and sched.counters.forward_steps == 0
    sched.check_invariants()
    jobs = {"a": (list(range(5, 45)), 6), "b": (list(range(50, 70)), 4)}
    ref = reference(make_sched, jobs)
    submit(sched, jobs)
    run = Run().drive(sched)
    for rid in jobs:
        assert run.tokens[rid] == ref[rid], rid
    assert_clean(sched)
    assert make_sched(prefill_step_target_ms=0).warm_up() is None  # pacing off: nothing runs


def test_warm_up_observes_the_median_past_the_first_run(
        make_sched: Callable[..., Scheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run pays one-time costs and one slow reading on a shared host must not set
    the first steps' cap: runs of 5.0, 0.2, 0.9 and 0.3 s are observed as 0.3 s."""
    sched = make_sched(prefill_step_target_ms=50, chunked_prefill_size=512)
    clock = iter([0.0, 5.0, 10.0, 10.2, 20.0, 20.9, 30.0, 30.3])
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert sched.warm_up(tokens=200, runs=4) == pytest.approx(0.3)
    assert sched.pacer.rate == pytest.approx(sched.pacer.work([(200, 0)]) / 0.3)


# -- (c) in-batch prefix sharing ------------------------------------------------------------------
@pytest.mark.parametrize("name", CACHE_AWARE)
def test_in_batch_prefix_sharing(make_sched: Callable[..., Scheduler], name: str) -> None:
    rng = random.Random(4)
    shared = prompt(rng, 64)
    jobs = {f"r{i}": ([*shared, *prompt(rng, 3 + i)], 4) for i in range(4)}
    ref = reference(make_sched, jobs)
    sched = make_sched(schedule_policy=name)
    batches: list[list[str]] = []
    orig = sched.builder.build_extend

    def spy(reqs: list[Req]) -> ForwardBatch:
        batches.append(rids(reqs))
        return orig(reqs)

    sched.builder.build_extend = spy  # type: ignore[method-assign]
    submit(sched, jobs)
    run = Run().drive(sched)
    assert batches[0] == ["r0"]  # the others wait one step for r0's prefix
    assert run.first_out["r0"].cached_tokens == 0
    for rid in ("r1", "r2", "r3"):
        assert run.first_out[rid].cached_tokens >= 64
        assert run.finals[rid].cached_tokens >= 64
    st = sched.stats()
    assert st["cached_tokens_total"] >= 3 * 64
    assert st["cached_tokens_total"] == sum(f.cached_tokens for f in run.finals.values())
    for rid in jobs:
        assert run.tokens[rid] == ref[rid], rid
    assert_clean(sched)


@pytest.mark.parametrize("name", CACHE_AWARE)
def test_followers_wait_for_a_leader_mid_chunk(make_sched: Callable[..., Scheduler],
                                               name: str) -> None:
    """A leader whose prompt is prefilled in chunks is in flight, not waiting: requests sharing
    its prompt must still wait for it instead of recomputing the shared part."""
    rng = random.Random(7)
    shared = prompt(rng, 120)
    jobs = {"lead": ([*shared, *prompt(rng, 4)], 3)}  # chunks of 64 and 60 (the final one)
    sched = make_sched(schedule_policy=name, chunked_prefill_size=64)
    submit(sched, jobs)
    sched.step()  # the leader's first chunk
    assert sched.chunked_req is not None
    follow = {f"f{i}": ([*shared, *prompt(rng, 5 + i)], 3) for i in range(3)}
    submit(sched, follow)
    run = Run().drive(sched)
    for rid in follow:
        assert run.finals[rid].cached_tokens >= 120, rid
    assert_clean(sched)


@pytest.mark.parametrize("kw", [{"schedule_policy": "fcfs"}, {"disable_radix_cache": True}])
def test_no_deferral_without_cache_aware_policy(make_sched: Callable[..., Scheduler],
                                                kw: dict[str, object]) -> None:
    rng = random.Random(4)
    shared = prompt(rng, 64)
    jobs = {f"r{i}": ([*shared, *prompt(rng, 3 + i)], 4) for i in range(4)}
    ref = reference(make_sched, jobs)
    sched = make_sched(**kw)
    submit(sched, jobs)
    run = Run()
    outs = run.record(sched)
    assert sorted(o.rid for o in outs) == sorted(jobs)  # all prefilled together
    run.drive(sched)
    for rid in jobs:
        assert run.tokens[rid] == ref[rid]
    assert_clean(sched)


# -- (d) abort in every state ---------------------------------------------------------------------
def _advance_until(sched: Scheduler, run: Run, cond: Callable[[], bool], limit: int = 500) -> None:
    for _ in range(limit):
        if cond():
            return
        assert sched.has_work
        run.record(sched)
    raise AssertionError("state never reached")


@pytest.mark.parametrize("state", ["waiting", "mid_chunk", "running", "retracted", "deferred"])
def test_abort_in_every_state(make_sched: Callable[..., Scheduler], state: str) -> None:
    rng = random.Random(5)
    if state == "retracted":
        jobs = pressure_jobs(seed=5)
        sched = make_sched(**TINY_POOL)
    elif state == "deferred":
        shared = prompt(rng, 40)
        jobs = {f"r{i}": ([*shared, *prompt(rng, 4)], 6) for i in range(3)}
        sched = make_sched()
    else:
        jobs = {"r0": (prompt(rng, 30), 10), "r1": (prompt(rng, 12), 10),
                "r2": (prompt(rng, 9), 10)}
        sched = make_sched(chunked_prefill_size=7)
    ref = reference(make_sched, jobs)
    submit(sched, jobs)
    run = Run()
    if state == "waiting":
        victim = "r2"
        assert any(r.rid == victim for r in sched.waiting)
    elif state == "mid_chunk":
        victim = "r0"
        _advance_until(sched, run, lambda: sched.chunked_req is not None
                       and sched.chunked_req.rid == victim and sched.chunked_req.kv_len >= 7)
    elif state == "running":
        victim = "r0"
        _advance_until(sched, run, lambda: any(r.rid == victim and len(r.output_ids) >= 3
                                               for r in sched.running))
    elif state == "deferred":
        victim = "r1"
        run.record(sched)
        assert any(r.rid == victim for r in sched.waiting)
    else:
        def retracted() -> bool:
            return any(r.num_retractions > 0 and r.output_ids for r in sched.waiting)

        _advance_until(sched, run, retracted)
        victim = next(r.rid for r in sched.waiting if r.num_retractions > 0)
    sent = len(run.tokens.get(victim, []))
    sched.handle(AbortReq(victim))
    sched.check_invariants()
    assert victim not in rids(sched.live_reqs())
    outs = run.record(sched)
    fin = [o for o in outs if o.rid == victim]
    assert len(fin) == 1 and fin[0].finish_reason == FINISH_ABORT
    assert fin[0].new_ids == [] and fin[0].completion_tokens == sent
    run.drive(sched)
    assert run.tokens.get(victim, []) == ref[victim][:sent]
    for rid in jobs:
        if rid != victim:
            assert run.finals[rid].finish_reason == FINISH_LENGTH
            assert run.tokens[rid] == ref[rid], rid
    # Aborting a finished or unknown request is a no-op.
    before = sched.stats()
    for rid in (victim, "r1" if victim != "r1" else "r0", "nope"):
        sched.handle(AbortReq(rid))
        sched.check_invariants()
        assert sched.step() is None
    after = sched.stats()
    assert all(after[k] == before[k] for k in COUNTERS)
    assert_clean(sched)


def test_abort_reason_and_message_propagate(make_sched: Callable[..., Scheduler]) -> None:
    rng = random.Random(6)
    sched = make_sched()
    sched.handle(GenerateReq("a", prompt(rng, 10), greedy(20)))
    run = Run()
    run.record(sched)
    run.record(sched)
    sched.handle(AbortReq("a", reason=FINISH_STOP, message="stop string hit"))
    run.record(sched)
    fin = run.finals["a"]
    assert fin.finish_reason == FINISH_STOP and fin.error == "stop string hit"
    assert fin.completion_tokens == 2
    assert_clean(sched)


# -- (f) prompt longer than the context ----------------------------------------------------------
def test_prompt_longer_than_context(make_sched: Callable[..., Scheduler]) -> None:
    rng = random.Random(7)
    sched = make_sched(max_total_tokens=64)
    assert sched.max_context_len == 64
    ok_ids = prompt(rng, 10)
    edge_ids = prompt(rng, 63)  # 63 + 1 == context: accepted, ends after one token
    sched.handle(GenerateReq("long", prompt(rng, 200), greedy(5)))
    sched.handle(GenerateReq("exact", prompt(rng, 64), greedy(5)))
    sched.handle(GenerateReq("ok", ok_ids, greedy(5)))
    sched.handle(GenerateReq("edge", edge_ids, greedy(5)))
    sched.check_invariants()
    run = Run().drive(sched)
    for rid in ("long", "exact"):
        fin = run.finals[rid]
        assert fin.finish_reason == FINISH_ABORT and "input_ids" in fin.error
        assert run.tokens[rid] == [] and fin.completion_tokens == 0
    ref = reference(make_sched, {"ok": (ok_ids, 5), "edge": (edge_ids, 1)})
    assert run.finals["ok"].finish_reason == FINISH_LENGTH and run.tokens["ok"] == ref["ok"]
    assert run.finals["edge"].finish_reason == FINISH_LENGTH
    assert run.tokens["edge"] == ref["edge"] and len(ref["edge"]) == 1
    assert_clean(sched)


def test_stats_report_the_decode_path_tuners_choices(
        make_sched: Callable[..., Scheduler]) -> None:
    """`stats()["decode_paths"]`: the runner's tuner's choices per row range (empty when off)."""
    sched = make_sched()
    tuner = sched.runner.model.decode_path_tuner
    assert tuner is not None and sched.stats()["decode_paths"] == {}
    for _ in range(tuner.pairs):
        for _ in range(2):
            p = tuner.pick(20)
            tuner.record(20, p, 0.012 if p else 0.010)
    paths = sched.stats()["decode_paths"]
    assert paths == {"16-22": {"path": "team", "ratio": pytest.approx(1.2), "decisions": 1}}
    assert make_sched(disable_decode_path_tuning=True).stats()["decode_paths"] == {}


def test_logit_bias_greedy_matches_hf_sequence_bias(
        make_sched: Callable[..., Scheduler], tiny_llama_dir: Path) -> None:
    """Greedy with `logit_bias`, batched beside an unbiased request, gives HF `generate`'s
    tokens with the same biases as `sequence_bias` (fp32, token for token); the unbiased
    request keeps its own reference."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(21)
    ids = prompt(rng, 14)
    plain = reference(make_sched, {"p": (ids, 10)})["p"]
    other = next(t for t in plain if t != plain[0])
    bias = {plain[0]: -100.0, other: 4.0, 7: 2.5}
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                           sequence_bias={(t,): v for t, v in bias.items()})[0, len(ids):]
    sched = make_sched()
    sched.handle(GenerateReq("b", ids, greedy(10, logit_bias=bias)))
    sched.handle(GenerateReq("p", ids, greedy(10)))
    run = Run().drive(sched)
    assert run.tokens["b"] == want.tolist()
    assert run.tokens["b"] != plain and run.tokens["b"][0] != plain[0]
    assert run.tokens["p"] == plain
    assert_clean(sched)


def test_repetition_penalty_greedy_matches_hf(
        make_sched: Callable[..., Scheduler], tiny_llama_dir: Path) -> None:
    """Greedy with `repetition_penalty` (the request's distinct prompt + output ids kept across
    steps, `SeenIds`), batched beside an unpenalized request, gives HF `generate`'s tokens with
    the same `repetition_penalty` (fp32, token for token)."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(23)
    ids = prompt(rng, 16)
    plain = reference(make_sched, {"p": (ids, 12)})["p"]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                           repetition_penalty=3.0)[0, len(ids):].tolist()
    assert want != plain  # the penalty changes this prompt's tokens
    sched = make_sched()
    sched.handle(GenerateReq("r", ids, greedy(12, repetition_penalty=3.0)))
    sched.handle(GenerateReq("p", ids, greedy(12)))
    run = Run().drive(sched)
    assert run.tokens["r"] == want
    assert run.tokens["p"] == plain
    assert_clean(sched)


# -- outs gather per stream_interval ------------------------------------------------------------
def test_outs_gather_per_stream_interval(make_sched: Callable[..., Scheduler]) -> None:
    """With stream_interval 4: a streamed request's first token goes out alone, then every 4
    tokens, the rest with its final out; one not streamed and without stop strings every
    HELD_INTERVAL (32); one not streamed with stop strings every 4 (the detokenizer finds
    them). Tokens and logprobs concatenate to the greedy reference; interval 1 sends each."""
    rng = random.Random(11)
    ids = prompt(rng, 12)
    ref = reference(make_sched, {"x": (ids, 70)})["x"]
    for interval, expect in ((4, {"s": [1, *[4] * 17, 1], "h": [1, 32, 32, 5],
                                  "t": [1, *[4] * 17, 1]}),
                             (1, {"s": [1] * 70, "h": [1, 32, 32, 5], "t": [1] * 70})):
        sched = make_sched(stream_interval=interval)
        sched.handle(GenerateReq("s", ids, greedy(70, logprobs=True)))
        sched.handle(GenerateReq("h", ids, greedy(70, logprobs=True), stream=False))
        sched.handle(GenerateReq("t", ids, greedy(70, stop=("zz",)), stream=False))
        sizes: dict[str, list[int]] = {}
        logprobs: dict[str, int] = {}
        run = Run()
        while sched.has_work:
            for o in run.record(sched):
                sizes.setdefault(o.rid, []).append(len(o.new_ids))
                if o.logprobs is not None:
                    assert len(o.logprobs.token_logprobs) == len(o.new_ids)
                    logprobs[o.rid] = logprobs.get(o.rid, 0) + len(o.new_ids)
        assert sizes == expect, interval
        assert all(run.tokens[r] == ref for r in "sht")
        assert logprobs == {"s": 70, "h": 70}
        assert_clean(sched)
    with pytest.raises(ValueError, match="stream_interval"):
        ServerArgs(stream_interval=0)


# -- (g) counters and flush_cache -----------------------------------------------------------------
def test_counters_monotonic_across_flush(make_sched: Callable[..., Scheduler]) -> None:
    rng = random.Random(8)
    shared = prompt(rng, 20)
    jobs = {f"r{i}": ([*shared, *prompt(rng, 5)], 4) for i in range(3)}
    sched = make_sched()

    def counters() -> dict[str, int]:
        st = sched.handle(StatsReq(1))
        assert st is not None and st.ok
        return {k: int(st.data[k]) for k in COUNTERS}

    history = [counters()]
    submit(sched, jobs)
    reply = sched.handle(FlushCacheReq(7))  # waiting requests: refused
    assert reply is not None and reply.req_id == 7 and not reply.ok and reply.error
    run = Run()
    run.record(sched)
    run.record(sched)
    assert sched.running
    ok, err = sched.flush_cache()  # running requests: refused, nothing touched
    assert not ok and err
    sched.check_invariants()
    run.drive(sched)
    history.append(counters())
    assert sched.cache.total_size() > 0
    sched.take_evicted()
    back = sched.answer(FlushCacheReq(8), replica=1)  # the notice goes ahead of the reply
    assert [type(m) for m in back] == [CacheEvicted, ControlReply]
    assert back[0].replica == 1 and back[0].prefixes == [[]]
    assert back[1].req_id == 8 and back[1].ok
    alone = sched.answer(StatsReq(9))  # no notice pending: the reply alone
    assert len(alone) == 1 and alone[0].req_id == 9
    history.append(counters())
    assert sched.cache.total_size() == 0
    assert history[-1] == history[-2]  # flush keeps the totals
    # Same prompts again: nothing cached any more (r0 misses), counters keep growing.
    submit(sched, {f"again{i}": v for i, v in enumerate(jobs.values())})
    run2 = Run().drive(sched)
    assert run2.first_out["again0"].cached_tokens == 0
    history.append(counters())
    for a, b in zip(history, history[1:], strict=False):
        assert all(b[k] >= a[k] for k in COUNTERS), (a, b)
    assert history[-1]["num_requests_total"] == 6
    assert history[-1]["num_finished_requests_total"] == 6
    assert history[-1]["forward_steps_total"] > history[-2]["forward_steps_total"]
    for i in range(3):
        assert run2.tokens[f"again{i}"] == run.tokens[f"r{i}"]
    ci = sched.handle(CheckInvariantsReq(9))
    assert ci is not None and ci.ok
    assert_clean(sched)


# -- (h) a failing batch --------------------------------------------------------------------------
@pytest.mark.parametrize(("fail_call", "chunk"), [(1, 2048), (3, 2048), (2, 7)])
def test_failed_batch_aborts_its_requests_only(make_sched: Callable[..., Scheduler],
                                               fail_call: int, chunk: int) -> None:
    rng = random.Random(9)
    jobs = {"a": (prompt(rng, 20), 6), "b": (prompt(rng, 12), 6)}
    later = {"c": (jobs["a"][0], 6), "d": (prompt(rng, 15), 6)}
    ref = reference(make_sched, {**jobs, **later})
    sched = make_sched(chunked_prefill_size=chunk)
    calls = [0]
    last_batch: list[list[str]] = [[]]
    orig_forward, orig_greedy = sched.runner.forward, sched.runner.forward_greedy
    orig_ext, orig_dec = sched.builder.build_extend, sched.builder.build_decode

    def forward(fb: ForwardBatch) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == fail_call:
            raise RuntimeError("boom")
        return orig_forward(fb)

    def forward_greedy(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls[0] += 1  # all-greedy steps (every step here) take this path
        if calls[0] == fail_call:
            raise RuntimeError("boom")
        return orig_greedy(fb)

    def ext(reqs: list[Req]) -> ForwardBatch:
        last_batch[0] = rids(reqs)
        return orig_ext(reqs)

    def dec(reqs: list[Req]) -> ForwardBatch:
        last_batch[0] = rids(reqs)
        return orig_dec(reqs)

    sched.runner.forward = forward  # type: ignore[method-assign]
    sched.runner.forward_greedy = forward_greedy  # type: ignore[method-assign]
    sched.builder.build_extend = ext  # type: ignore[method-assign]
    sched.builder.build_decode = dec  # type: ignore[method-assign]
    submit(sched, jobs)
    run = Run()
    failed: list[str] = []
    while sched.has_work:
        n = calls[0]
        run.record(sched)
        if calls[0] == fail_call and n < fail_call:
            failed = list(last_batch[0])
    assert failed
    for rid in jobs:
        fin = run.finals[rid]
        if rid in failed:
            assert fin.finish_reason == FINISH_ABORT and "boom" in fin.error
            assert run.tokens.get(rid, []) == ref[rid][: len(run.tokens.get(rid, []))]
        else:
            assert fin.finish_reason == FINISH_LENGTH and run.tokens[rid] == ref[rid]
    assert sched.cache.protected_size() == 0
    submit(sched, later)
    run2 = Run().drive(sched)
    for rid in later:
        assert run2.finals[rid].finish_reason == FINISH_LENGTH and not run2.finals[rid].error
        assert run2.tokens[rid] == ref[rid], rid
    assert_clean(sched)


# -- (i) max_new_tokens=1 and stop tokens --------------------------------------------------------
def test_max_new_tokens_one_and_stop_token_ids(make_sched: Callable[..., Scheduler]) -> None:
    rng = random.Random(10)
    ids = prompt(rng, 12)
    ref = reference(make_sched, {"x": (ids, 12)})["x"]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    stop_tok = ref[k]
    sched = make_sched(chunked_prefill_size=5)
    sched.handle(GenerateReq("one", ids, greedy(1)))
    sched.handle(GenerateReq("stop", ids, greedy(12, stop_token_ids=[stop_tok])))
    sched.handle(GenerateReq("stop_first", ids, greedy(12, stop_token_ids=(ref[0],))))
    run = Run().drive(sched)
    assert run.finals["one"].finish_reason == FINISH_LENGTH and run.tokens["one"] == ref[:1]
    assert run.finals["stop"].finish_reason == FINISH_STOP
    assert run.tokens["stop"] == ref[: k + 1]
    assert run.finals["stop_first"].finish_reason == FINISH_STOP
    assert run.tokens["stop_first"] == ref[:1]
    st = sched.stats()
    assert st["generated_tokens_total"] == 1 + (k + 1) + 1
    assert st["num_finished_requests_total"] == 3
    assert_clean(sched)


def test_eos_stops_unless_ignored(make_sched: Callable[..., Scheduler]) -> None:
    rng = random.Random(11)
    ids = prompt(rng, 12)
    ref = reference(make_sched, {"x": (ids, 8)})["x"]
    sched = make_sched()
    sched.outputs.eos_token_ids = frozenset({ref[2]})  # pretend the model "emits EOS" at step 3
    sched.handle(GenerateReq("eos", ids, SamplingParams(max_new_tokens=8, temperature=0.0)))
    sched.handle(GenerateReq("ign", ids, greedy(8)))
    run = Run().drive(sched)
    k = ref.index(ref[2])
    assert run.finals["eos"].finish_reason == FINISH_STOP and run.tokens["eos"] == ref[: k + 1]
    assert run.finals["ign"].finish_reason == FINISH_LENGTH and run.tokens["ign"] == ref
    assert_clean(sched)


# -- randomized: arrivals, aborts and budgets under memory pressure ------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_matches_reference(make_sched: Callable[..., Scheduler], seed: int) -> None:
    rng = random.Random(100 + seed)
    cfg: dict[str, object] = {
        "schedule_policy": rng.choice(POLICIES),
        "disable_radix_cache": rng.random() < 0.25,
        "max_total_tokens": rng.choice([64, 80, 1024]),
        "chunked_prefill_size": rng.choice([5, 7, 16, 2048]),
        "max_prefill_tokens": rng.choice([8, 40, 8192]),
        "max_running_requests": rng.choice([2, 3, 64]),
        "init_new_token_ratio": rng.choice([0.05, 0.3, 0.7]),
        "min_new_token_ratio": 0.05,
        "disable_mixed_chunk": rng.random() < 0.3,
    }
    ctx = min(int(cfg["max_total_tokens"]), 1024)  # type: ignore[call-overload]
    bases = [prompt(rng, rng.randrange(10, 40)) for _ in range(3)]
    jobs: dict[str, tuple[list[int], int]] = {}
    for i in range(10):
        head = rng.choice(bases)[: rng.randrange(0, 40)] if rng.random() < 0.7 else []
        ids = [*head, *prompt(rng, rng.randrange(1, 12))]
        max_new = rng.randrange(1, 20)
        ids = ids[: ctx - max_new - 1] or [5]
        jobs[f"q{i}"] = (ids, max_new)
    ref = reference(make_sched, jobs)
    sched = make_sched(**cfg)
    pending = list(jobs)
    aborted: set[str] = set()
    run = Run()
    while pending or sched.has_work:
        assert run.steps < 5000, f"no progress: {cfg}"
        for _ in range(rng.randrange(0, 3)):
            if pending:
                rid = pending.pop(0)
                sched.handle(GenerateReq(rid, jobs[rid][0], greedy(jobs[rid][1])))
        if rng.random() < 0.05:
            live = [r.rid for r in sched.live_reqs()]
            if live:
                victim = rng.choice(live)
                aborted.add(victim)
                sched.handle(AbortReq(victim))
                sched.check_invariants()
        if sched.has_work:
            run.record(sched)
    assert set(run.finals) == set(jobs)
    for rid in jobs:
        fin = run.finals[rid]
        if rid in aborted:
            assert fin.finish_reason == FINISH_ABORT
            assert run.tokens[rid] == ref[rid][: len(run.tokens[rid])]
        else:
            assert fin.finish_reason == FINISH_LENGTH, (rid, fin, cfg)
            assert run.tokens[rid] == ref[rid], (rid, cfg)
    assert_clean(sched)


# -- mixed steps: a prefill also advances the decoding requests ---------------------------------
@pytest.mark.parametrize("disable_cache", [False, True])
def test_mixed_steps_match_separate_steps(make_sched: Callable[..., Scheduler],
                                          disable_cache: bool) -> None:
    """Requests arriving while others decode: their prefill steps carry the running requests'
    decode tokens (one step fewer each), and every output equals the reference's."""
    rng = random.Random(7)
    base = prompt(rng, 20)
    jobs = {f"m{i}": ([*base[: 10 + i], *prompt(rng, 4)], 10) for i in range(5)}
    ref = reference(make_sched, jobs)

    def staggered(disable_mixed: bool) -> tuple[Run, Scheduler, dict[str, int]]:
        sched = make_sched(disable_radix_cache=disable_cache, disable_mixed_chunk=disable_mixed)
        run = Run()
        done_at: dict[str, int] = {}
        arrivals = list(jobs.items())
        while arrivals or sched.has_work:
            if arrivals and run.steps % 2 == 0:  # one arrival every other step
                rid, (ids, n) = arrivals.pop(0)
                sched.handle(GenerateReq(rid, ids, greedy(n)))
            for o in run.record(sched):
                if o.finish_reason is not None:
                    done_at[o.rid] = run.steps
        return run, sched, done_at

    mixed, sched, mixed_done = staggered(False)
    plain, plain_sched, plain_done = staggered(True)
    st, pst = sched.stats(), plain_sched.stats()
    assert st["mixed_totals"]["steps"] >= len(jobs) - 1  # type: ignore[index]
    assert st["mixed_totals"]["decode_rows"] >= len(jobs) - 1  # type: ignore[index]
    assert pst["mixed_totals"] == {"steps": 0, "decode_rows": 0}
    # decode tokens that ride along with later prefills: earlier requests finish sooner
    assert all(mixed_done[r] <= plain_done[r] for r in jobs)
    assert mixed_done["m0"] < plain_done["m0"]
    for rid in jobs:
        assert mixed.finals[rid].finish_reason == FINISH_LENGTH
        assert mixed.tokens[rid] == ref[rid] == plain.tokens[rid], rid
    assert st["generated_tokens_total"] == pst["generated_tokens_total"]
    assert_clean(sched)
    assert_clean(plain_sched)


def test_in_batch_share_threshold_is_used_by_the_scheduler(
        make_sched: Callable[..., Scheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    """Raising the threshold above the shared length turns in-batch deferral off."""
    monkeypatch.setattr(schedule_policy, "IN_BATCH_SHARE_MIN_TOKENS", 1000)
    rng = random.Random(4)
    shared = prompt(rng, 64)
    jobs = {f"r{i}": ([*shared, *prompt(rng, 3 + i)], 2) for i in range(3)}
    sched = make_sched()
    submit(sched, jobs)
    run = Run()
    outs = run.record(sched)
    assert sorted(o.rid for o in outs) == sorted(jobs)
    assert all(o.cached_tokens == 0 for o in outs)
    run.drive(sched)
    assert all(run.finals[rid].finish_reason == FINISH_LENGTH for rid in jobs)
    assert_clean(sched)


# -- (j) only the KV owner writes a request's KV fields ------------------------------------------
KV_FIELDS = {"kv_len", "req_pool_idx", "prefix_indices", "last_node", "exact_len"}


def test_only_the_kv_owner_assigns_request_kv_fields() -> None:
    import ast

    root = Path(__file__).resolve().parent.parent / "radixrt"
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        allowed: set[int] = set()  # Req.__init__ sets the initial (empty) state
        if rel == "radixrt/sched/req.py":
            for fn in ast.walk(tree):
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    allowed |= {n.lineno for n in ast.walk(fn) if hasattr(n, "lineno")}
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for tgt in targets:
                for t in ast.walk(tgt):
                    if (isinstance(t, ast.Attribute) and t.attr in KV_FIELDS
                            and rel != "radixrt/sched/kv_owner.py" and node.lineno not in allowed):
                        bad.append(f"{rel}:{node.lineno} assigns .{t.attr}")
    assert not bad, "\n".join(sorted(set(bad)))


# -- (k) a step failing at any point: every slot owned once, every request finished once -------
@pytest.mark.parametrize(("point", "nth", "chunk"), [
    ("forward", 1, 2048), ("forward", 3, 2048), ("forward", 2, 7),
    ("sample", 1, 2048), ("sample", 4, 2048),
    ("append", 2, 2048),  # mid-process: some requests committed their slots, others not
    ("append", 5, 2048),
    ("cache_unfinished", 2, 7),
    ("retire", 2, 2048),  # after another request of the same step finished and was counted
])
def test_step_failure_at_any_point_keeps_ownership(make_sched: Callable[..., Scheduler],
                                                   point: str, nth: int, chunk: int) -> None:
    rng = random.Random(11)
    jobs = {"a": (prompt(rng, 20), 6), "b": (prompt(rng, 12), 1), "c": (prompt(rng, 15), 4),
            "d": (prompt(rng, 9), 1)}
    ref = reference(make_sched, jobs)
    sched = make_sched(chunked_prefill_size=chunk)
    calls = [0]

    def failing(orig: Callable[..., object], when: Callable[..., bool] = lambda *a: True):
        def wrapper(*args: object, **kw: object) -> object:
            if when(*args):
                calls[0] += 1
                if calls[0] == nth:
                    raise RuntimeError("boom")
            return orig(*args, **kw)
        return wrapper

    if point == "forward":  # either way a step runs the model (all-greedy steps: the second)
        sched.runner.forward = failing(sched.runner.forward)  # type: ignore[method-assign]
        sched.runner.forward_greedy = failing(  # type: ignore[method-assign]
            sched.runner.forward_greedy)
    elif point == "sample":
        sched.sampler.sample = failing(sched.sampler.sample)  # type: ignore[method-assign]
    elif point == "append":
        sched.outputs._append = failing(sched.outputs._append)  # type: ignore[method-assign]
    elif point == "cache_unfinished":
        sched.kv.cache_unfinished = failing(sched.kv.cache_unfinished)  # type: ignore[method-assign]
    else:
        sched.kv.release = failing(sched.kv.release,  # type: ignore[method-assign]
                                   when=lambda req: req.finished)
    submit(sched, jobs)
    run = Run().drive(sched)  # check_invariants after every step
    assert calls[0] >= nth, "the failure was never injected"
    assert set(run.finals) == set(jobs)
    aborted = {rid for rid, f in run.finals.items() if f.finish_reason == FINISH_ABORT}
    assert aborted, "some request must have failed"
    for rid, fin in run.finals.items():
        toks = run.tokens.get(rid, [])
        if rid in aborted:
            assert "boom" in fin.error and toks == ref[rid][: len(toks)]
        else:
            assert fin.finish_reason == FINISH_LENGTH and toks == ref[rid], rid
    assert sched.stats()["num_finished_requests_total"] == len(jobs)  # each finished once
    assert_clean(sched)


# -- (l) the decode reserve of a request without max_tokens is clipped --------------------------
def test_adder_clips_the_decode_reserve() -> None:
    p = make_pools(slots=4096, rows=16)
    reqs = [make_req(f"r{i}", seq(10 * i + 3, 10), max_new=8000) for i in range(8)]
    a = adder(p, ratio=0.7)  # unclipped: the first reserves 5600 > the whole pool
    assert [a.add(r) for r in reqs[:2]] == [True, False]
    unlock(p, reqs)
    a = adder(p, ratio=0.7, clip=256)  # 10 + int(256 * 0.7) = 189 per request
    assert all(a.add(r) for r in reqs)
    assert a.reserved == 8 * (10 + 179)
    unlock(p, reqs)
    p.check()


def test_clipped_reserve_admits_at_once_and_retracts_on_real_shortage(
        make_sched: Callable[..., Scheduler]) -> None:
    rng = random.Random(12)
    jobs = {f"r{i}": (prompt(rng, 20), 200) for i in range(8)}  # 8 × 220 > 1024 slots
    ref = reference(make_sched, jobs)
    first_step_running = {}
    for clip in (16, 1024):
        sched = make_sched(max_total_tokens=1024, clip_max_new_tokens_estimation=clip)
        submit(sched, jobs)
        run = Run()
        run.record(sched)
        first_step_running[clip] = len(sched.running)
        run.drive(sched)
        for rid in jobs:
            assert run.finals[rid].finish_reason == FINISH_LENGTH and run.tokens[rid] == ref[rid]
        if clip == 16:
            assert sched.stats()["retractions_total"] > 0  # the shortage is real: decode retracts
        assert_clean(sched)
    assert first_step_running[16] == 8  # not throttled by the reserve
    assert first_step_running[1024] < 8  # 0.7 × 199 per request is


# -- bf16 decode over a shared cached prefix (the cascade path) ----------------------------------
def test_bf16_shared_prefix_decode_agrees_with_fp32(make_sched: Callable[..., Scheduler]) -> None:
    """A bf16 runner decodes requests sharing a >= CASCADE_MIN_SHARED cached prefix through the
    cascade merge (it used to abort on a dtype mismatch) and agrees with fp32 greedy tokens over
    the first steps (later ones may part on near-ties of the random model's logits)."""
    from radixrt.attention import torch_native

    rng = random.Random(8)
    shared = prompt(rng, 2 * torch_native.CASCADE_MIN_SHARED)
    jobs = {f"r{i}": ([*shared, *prompt(rng, 2 + i)], 6) for i in range(3)}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        sched = make_sched(dtype=dtype)
        assert sched.runner.dtype == getattr(torch, dtype)
        backend = sched.runner.attn_backend
        cascades: list[int] = []
        orig = backend.init_forward_metadata

        def spy(fb: object, _orig=orig, _seen=cascades, _b=backend) -> None:  # type: ignore[no-untyped-def]
            _orig(fb)
            kernel = _b._kernel  # the C++ paged-decode plan, or the torch path's cascade plan
            if (kernel is not None and kernel.num_groups) or _b._cascade is not None:
                _seen.append(1)

        backend.init_forward_metadata = spy  # type: ignore[method-assign]
        submit(sched, jobs)
        runs[dtype] = Run().drive(sched)
        assert cascades, f"{dtype}: no decode step took the cascade path"
        assert all(f.finish_reason == FINISH_LENGTH for f in runs[dtype].finals.values())
        assert_clean(sched)
    for rid in jobs:
        assert runs["bfloat16"].tokens[rid][:3] == runs["float32"].tokens[rid][:3], rid


def test_decode_totals_count_decode_steps_only(make_sched: Callable[..., Scheduler]) -> None:
    """`stats()["decode_totals"]`: one step and its rows per decode batch, none for prefill."""
    sched = make_sched()
    submit(sched, {"a": (seq(10, 12), 5), "b": (seq(40, 7), 3)})
    modes: list[tuple[str, int]] = []
    real_run = sched._run

    def spy(reqs: list[Req], mode: str) -> None:
        modes.append((mode, len(reqs)))
        real_run(reqs, mode)

    sched._run = spy  # type: ignore[method-assign]
    Run().drive(sched)
    dec = [n for m, n in modes if m == "decode"]
    assert dec and any(m == "extend" for m, _ in modes)
    totals = sched.stats()["decode_totals"]
    assert totals["steps"] == len(dec) and totals["rows"] == sum(dec)
    assert 0 < totals["time_s"] <= sum(sched.stats()["step_time_s"].values())


def test_mixed_step_cost_tells_tokens_from_rows_only_when_they_vary_apart() -> None:
    from radixrt.sched.step_cost import MixedStepCost

    cost = MixedStepCost()
    assert cost.fit() is None
    cost.observe(0, 8, 0.04)  # decode steps alone: no prefill rate yet
    assert cost.fit() is None
    cost = MixedStepCost()
    for k in (1, 2, 3):  # tokens and rows in one proportion: b and c cannot be told apart
        cost.observe(100 * k, 10 * k, 0.5 * k)
    fit = cost.fit()
    assert fit is not None and not fit.rows_told
    assert fit.b == pytest.approx(0.005) and fit.c == fit.b  # rows' time counted as prefill
    assert fit.a == pytest.approx(fit.b)  # no attention seen: the prior holds
    cost.observe(0, 20, 0.1)  # a plain decode step: 5 ms a row
    fit = cost.fit()
    assert fit is not None and fit.rows_told
    assert fit.c == pytest.approx(0.005) and fit.b == pytest.approx(0.0045)
