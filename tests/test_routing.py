"""Routing logic (no processes): the per-worker approximate prefix tree against a naive
reference, eviction reports mirroring the real radix cache, the three policies' decisions on
synthetic prompt groups, the eviction log, the --dp replica plan and stats merging."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.config import ServerArgs
from radixrt.frontend.engine import merge_stats
from radixrt.frontend.launcher import replica_plan
from radixrt.mem.radix_cache import RadixCache
from radixrt.routing.eviction_log import EvictionLog
from radixrt.routing.policy import (
    CacheAwarePolicy,
    LeastLoadPolicy,
    NoWorkerError,
    RoundRobinPolicy,
    make_policy,
    policy_from_args,
)
from radixrt.routing.prefix_tree import ApproxPrefixTree


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ref_match(seqs: list[list[int]], q: list[int]) -> int:
    return max((common(s, q) for s in seqs), default=0)


# Small alphabet so sequences share prefixes and split edges often.
seq = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "drop"]), seq), max_size=30),
       st.lists(seq, min_size=1, max_size=10))
def test_tree_matches_naive_reference(ops, queries):
    """Unbounded: match_len equals the longest common prefix with any stored sequence, where
    `drop_extensions(P)` cuts every stored sequence starting with P to len(P) - 1 tokens."""
    tree = ApproxPrefixTree(10_000)
    ref: list[list[int]] = []
    for op, s in ops:
        if op == "insert":
            assert tree.insert(s) == ref_match(ref, s)
            ref.append(list(s))
        else:
            tree.drop_extensions(s)
            ref = [r[: len(s) - 1] if r[: len(s)] == s else r for r in ref]
            ref = [r for r in ref if r]
        tree.check_invariants()
    for q in queries + [r for r in ref]:
        assert tree.match_len(q) == ref_match(ref, q)
    # Size = distinct non-empty prefixes of what is stored.
    assert len(tree) == len({tuple(r[:i]) for r in ref for i in range(1, len(r) + 1)})


def test_tree_lru_bound_keeps_recent_sequences():
    tree = ApproxPrefixTree(100)
    seqs = [[g] * 30 for g in range(10)]  # 10 disjoint sequences of 30 tokens
    for s in seqs:
        tree.insert(s)
        assert len(tree) <= 100
        tree.check_invariants()
    # The three most recent fit; older ones are gone, least recently used first.
    assert [tree.match_len(s) for s in seqs[-3:]] == [30, 30, 30]
    assert all(tree.match_len(s) == 0 for s in seqs[:6])
    # Touching an old survivor protects it over a newer one.
    tree2 = ApproxPrefixTree(60)
    tree2.insert([1] * 30)
    tree2.insert([2] * 30)
    tree2.match_len([1] * 30, touch=True)
    tree2.insert([3] * 30)
    assert tree2.match_len([1] * 30) == 30 and tree2.match_len([2] * 30) == 0


def test_tree_sequence_longer_than_bound_is_cut():
    tree = ApproxPrefixTree(10)
    tree.insert(list(range(25)))
    assert len(tree) == 10 and tree.match_len(list(range(25))) == 10


@settings(max_examples=60, deadline=None)
@given(st.lists(seq, min_size=1, max_size=20), st.integers(1, 60), st.lists(seq, max_size=10))
def test_eviction_reports_keep_the_tree_equal_to_the_radix_cache(inserts, evict_n, queries):
    """Every leaf the real RadixCache evicts is reported; applying the reports to a tree that
    saw the same inserts leaves it predicting exactly the cache's matches."""
    cache = RadixCache()
    reports: list[list[int]] = []
    cache.on_evict = reports.append
    tree = ApproxPrefixTree(10_000)
    next_slot = 1
    for s in inserts:
        value = torch.arange(next_slot, next_slot + len(s))
        next_slot += len(s)
        cache.insert(s, value)
        tree.insert(s)
    cache.evict(evict_n)
    for p in reports:
        tree.drop_extensions(p)
    for q in queries + inserts:
        assert tree.match_len(q) == int(cache.match_prefix(q).indices.numel())
    assert len(tree) == cache.total_size()


def interleaved_groups(groups: int, per_group: int, prefix_len: int = 64, seed: int = 0,
                       ) -> list[tuple[int, list[int]]]:
    """(group, prompt) pairs: each group's prompts share a `prefix_len`-token system prompt
    and end in 8 distinct tokens; groups interleaved at random."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        system = [1000 * (g + 1) + rng.randrange(1000) for _ in range(prefix_len)]
        for _ in range(per_group):
            out.append((g, system + [rng.randrange(100_000) for _ in range(8)]))
    rng.shuffle(out)
    return out


def test_cache_aware_keeps_groups_together_and_spreads_them():
    policy = CacheAwarePolicy(["a", "b"])
    placed: dict[int, set] = {}
    for g, ids in interleaved_groups(8, 8):
        d = policy.route(ids)
        placed.setdefault(g, set()).add(d.worker)
        policy.finish(d)  # one at a time: loads stay equal
    assert all(len(ws) == 1 for ws in placed.values()), placed  # every group on one worker
    per_worker = [sum(1 for ws in placed.values() if w in ws) for w in ("a", "b")]
    assert per_worker == [4, 4]  # new groups go where the least is cached
    tokens = [policy.stats[w].routed_tokens for w in ("a", "b")]
    assert max(tokens) / (sum(tokens) / 2) <= 1.3
    # 8 of 64 requests were misses (each group's first); the rest routed for their cache.
    assert sum(policy.stats[w].cache_routed for w in ("a", "b")) == 56


def test_round_robin_scatters_groups():
    policy = RoundRobinPolicy(["a", "b"])
    placed: dict[int, set] = {}
    for g, ids in interleaved_groups(8, 8):
        placed.setdefault(g, set()).add(policy.route(ids).worker)
    assert sum(len(ws) == 2 for ws in placed.values()) >= 6


def test_cache_aware_spills_when_the_work_gap_exceeds_the_recompute():
    """Same prefix (100 tokens matched): it stays on its worker until that worker's pending
    work exceeds the other's by more than balance_factor x 100 tokens."""
    policy = CacheAwarePolicy(["a", "b"], balance_factor=2.0)
    busy = policy.route([9] * 10, output_tokens=0)  # keeps the other worker from being idle
    system = list(range(100))
    first = policy.route(system + [7], output_tokens=10)
    assert first.reason == "miss" and first.work == 101 + 10
    assert first.worker != busy.worker  # within one request's work: the smaller tree
    placed = []
    for i in range(20):  # each adds 1 uncached token + 10 output tokens of work
        d = policy.route(system + [1000 + i], output_tokens=10)
        placed.append((d.worker, d.reason))
        if d.worker == busy.worker:
            break
    # The gap (111 + k * 11) - 10 first exceeds 2 x 100 at k = 10: ten stay, the next spills.
    assert placed[:10] == [(first.worker, "cache")] * 10
    assert placed[10] == (busy.worker, "balance")
    assert policy.stats[first.worker].pending == 111 + 10 * 11
    # finish() gives the work back.
    policy.finish(first)
    assert policy.stats[first.worker].pending == 10 * 11


def test_cache_aware_idle_worker_takes_a_busy_groups_request():
    policy = CacheAwarePolicy(["a", "b"])
    system = list(range(100))
    ds = [policy.route(system + [i], output_tokens=4) for i in range(3)]
    assert ds[0].worker == ds[1].worker != ds[2].worker  # 2 in flight, the other idle
    assert ds[2].reason == "balance"


def test_cache_aware_spills_from_a_full_worker():
    policy = CacheAwarePolicy(["a", "b"], balance_factor=100.0)
    policy.set_capacity("a", 2)
    policy.set_capacity("b", 2)
    system = list(range(50))
    ws = [policy.route(system + [i], output_tokens=1).worker for i in range(3)]
    assert ws[0] == ws[1] != ws[2]  # the third would wait for a row: it goes where one is free
    assert policy.route(system + [9], output_tokens=1).worker == ws[2]


def simulate_window(policy, pairs, window: int, seed: int = 0) -> dict[int, set]:
    """Keep `window` requests in flight, finishing a random one before each new arrival
    (a closed-loop client); returns the workers each group was routed to."""
    rng = random.Random(seed)
    inflight, placed = [], {}
    for g, ids in pairs:
        if len(inflight) == window:
            policy.finish(inflight.pop(rng.randrange(window)))
        d = policy.route(ids, output_tokens=16)
        placed.setdefault(g, set()).add(d.worker)
        inflight.append(d)
    return placed


@pytest.mark.parametrize("groups,per_group,prefix,window", [(8, 8, 512, 16), (4, 4, 192, 8)])
def test_cache_aware_keeps_interleaved_groups_whole_under_concurrency(groups, per_group, prefix,
                                                                      window):
    """The benchmark's shapes (more groups than workers, interleaved, a closed-loop client):
    the predicted hits stay within 95% of one replica's optimum and routed tokens balanced."""
    policy = CacheAwarePolicy(["a", "b"])
    pairs = interleaved_groups(groups, per_group, prefix_len=prefix, seed=3)
    simulate_window(policy, pairs, window)
    optimum = groups * (per_group - 1) * prefix
    predicted = sum(policy.stats[w].matched_tokens for w in ("a", "b"))
    assert predicted >= 0.95 * optimum, (predicted, optimum)
    tokens = [policy.stats[w].routed_tokens for w in ("a", "b")]
    assert max(tokens) / (sum(tokens) / 2) <= 1.3


def test_cache_aware_spreads_a_group_larger_than_the_window():
    """One group of 64 prompts, 16 in flight: the prefix is recomputed once on the second
    worker, then the group uses both."""
    policy = CacheAwarePolicy(["a", "b"])
    pairs = interleaved_groups(1, 64, prefix_len=512, seed=4)
    simulate_window(policy, pairs, 16)
    routed = [policy.stats[w].routed for w in ("a", "b")]
    assert min(routed) >= 16, routed
    assert sum(policy.stats[w].matched_tokens for w in ("a", "b")) >= 62 * 512  # 2 misses


def test_output_estimate_and_measured_usage():
    policy = CacheAwarePolicy(["a"])
    assert policy.route([1, 2, 3]).work == 3 + 128  # unknown output budget
    assert policy.route([1, 2, 3, 4], output_tokens=10**6).work == 1 + 1024  # capped
    policy.observed("a", 10, 4)
    policy.observed("a", 6, 0)
    s = policy.stats["a"]
    assert (s.measured_requests, s.measured_prompt_tokens, s.measured_cached_tokens) == (2, 16, 4)


def test_cache_aware_misses_spread_at_low_concurrency():
    """Unrelated prompts one at a time (equal loads) do not pile on one worker."""
    policy = CacheAwarePolicy(["a", "b", "c"])
    seen = []
    for i in range(9):
        d = policy.route([50_000 + i] * 20)
        assert d.reason == "miss"
        seen.append(d.worker)
        policy.finish(d)
    assert {w: seen.count(w) for w in "abc"} == {"a": 3, "b": 3, "c": 3}


def test_cache_threshold_ignores_short_shared_heads():
    """A shared chat-template head (a few tokens) is no reason to pick a worker."""
    policy = CacheAwarePolicy(["a", "b"], cache_threshold=0.5)
    head = [1, 2, 3]
    d1 = policy.route(head + [10] * 40)
    policy.finish(d1)
    d2 = policy.route(head + [20] * 40)
    assert d2.reason == "miss" and d2.worker != d1.worker


def test_evicted_prefix_is_no_longer_a_hit():
    policy = CacheAwarePolicy(["a", "b"])
    ids = list(range(50))
    d = policy.route(ids)
    w = d.worker
    policy.finish(d)
    d = policy.route(ids)
    assert d.reason == "cache"
    policy.finish(d)
    policy.evicted(w, [ids[:1]])  # the worker dropped everything from token 0 on
    assert policy.tree_tokens(w) == 0
    assert policy.route(ids).reason == "miss"


def test_least_load_and_exclusion():
    policy = LeastLoadPolicy(["a", "b"])
    first = policy.route([1])
    assert first.worker == "a"
    assert policy.route([1]).worker == "b"
    policy.finish(first)
    assert policy.route([1]).worker == "a"
    assert policy.route([1], exclude={"a"}).worker == "b"
    with pytest.raises(NoWorkerError, match="excluded"):
        policy.route([1], exclude={"a", "b"})
    policy.remove_worker("b")
    assert policy.workers() == ["a"]
    with pytest.raises(ValueError, match="already registered"):
        policy.add_worker("a")


def test_make_policy_names():
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="routing policy"):
        make_policy("random")
    p = policy_from_args(ServerArgs(routing_max_tree_tokens=77), ["x"])
    assert isinstance(p, CacheAwarePolicy) and p.trees["x"].max_tokens == 77


@pytest.mark.parametrize("field,value", [
    ("dp", 0), ("routing_policy", "random"), ("routing_cache_threshold", 1.5),
    ("routing_balance_factor", -1.0),
    ("worker_urls", ("ftp://host:1",)), ("worker_urls", ("http://host:notaport",)),
    ("worker_urls", ("localhost:30000",)),
])
def test_config_rejects_bad_routing_fields(field, value):
    with pytest.raises(ValueError, match=f"ServerArgs.{field}"):
        ServerArgs(**{field: value})


def test_eviction_log_since_lost_and_epoch():
    log = EvictionLog(capacity=3)
    log.append([[1], [2]])
    s = log.since(0)
    assert s.prefixes == [[1], [2]] and s.next_seq == 2 and not s.lost
    log.append([[3], [4]])  # [1] falls out of the ring
    assert log.since(2).prefixes == [[3], [4]]
    assert log.since(0).lost and log.since(0).next_seq == 4
    assert log.since(9).lost
    assert EvictionLog().epoch != log.epoch


def test_replica_plan_splits_threads_and_cores():
    assert replica_plan(1, 8, list(range(8))) == [(8, None)]
    assert replica_plan(2, 2, [0, 1]) == [(1, [0]), (1, [1])]
    assert replica_plan(3, 8, list(range(8))) == [(2, [0, 1, 2]), (2, [3, 4, 5]), (2, [6, 7])]
    assert replica_plan(4, 2, [0, 1]) == [(1, None)] * 4  # fewer cores than replicas: unpinned


def test_merge_stats_sums_and_recomputes_ratios():
    a = {"prompt_tokens_total": 100, "cached_tokens_total": 50, "max_total_tokens": 10,
         "used_tokens": 5, "cache_hit_rate": 0.5, "token_usage": 0.5, "new_token_ratio": 0.2,
         "step_time_s": {"forward": 1.0}}
    b = {"prompt_tokens_total": 300, "cached_tokens_total": 0, "max_total_tokens": 10,
         "used_tokens": 0, "cache_hit_rate": 0.0, "token_usage": 0.0, "new_token_ratio": 0.4,
         "step_time_s": {"forward": 2.0}}
    m = merge_stats([a, b])
    assert m["prompt_tokens_total"] == 400 and m["cache_hit_rate"] == 50 / 400
    assert m["token_usage"] == 5 / 20 and m["new_token_ratio"] == pytest.approx(0.3)
    assert m["step_time_s"] == {"forward": 3.0} and m["replicas"] == [a, b]
    # what does not add up stays per replica only
    a["decode_paths"] = {"16-22": {"path": "team", "ratio": 1.04, "decisions": 1}}
    b["decode_paths"] = {}
    m = merge_stats([a, b])
    assert "decode_paths" not in m and m["replicas"][0]["decode_paths"]["16-22"]["path"] == "team"
