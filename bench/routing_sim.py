"""Routing policies on simulated closed-loop workloads, no model: how many prompt tokens the
cache-aware policy predicts as hits (vs the one-replica optimum) and how evenly it spreads the
routed tokens, per `--routing-balance-factor`.

    python bench/routing_sim.py                       # factors 1 2 4 8, the benchmark shapes
    python bench/routing_sim.py --pressure            # KV pools smaller than the working set

Each shape is groups x prompts per group sharing a system prompt of `prefix` tokens (+ 8
distinct tokens), shuffled; a client keeps `window` requests in flight and, before each new
arrival, one random in-flight request finishes. Worker speed is not modelled: this measures
the decisions, `bench/routing.py` the served result. Over `--seeds` seeds: median and worst
predicted hits / optimum, median and worst imbalance (max / mean routed tokens).

`--pressure` models each worker's KV pool too (`SimCache`: a radix cache of group prefixes
and request suffixes, least recently used leaf evicted first, requests in flight pinned, its
evictions reported to the policy as the scheduler does) and compares the *served* hit rate of
one worker holding the whole budget with N workers holding 1/N each, per routing policy: the
regime where round-robin makes every worker hold every group's prefix and thrash.

"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
from collections import OrderedDict  # noqa: E402
from collections.abc import Hashable  # noqa: E402

from radixrt.routing.policy import CacheAwarePolicy, RoutingPolicy, make_policy  # noqa: E402

SHAPES = [(8, 8, 512, 16), (4, 4, 192, 8), (16, 4, 256, 16), (32, 2, 256, 16), (1, 64, 512, 16),
          (8, 8, 512, 4)]
PRESSURE_SHAPES = [(8, 6, 256, 8), (8, 8, 256, 8), (12, 4, 256, 8), (16, 4, 192, 8)]


def workload(groups: int, per_group: int, prefix: int, seed: int,
             question: int = 8) -> list[list[int]]:
    """Shuffled prompts; group g's tokens lie in [1000 (g + 1), 1000 (g + 2)), questions'
    at 100_000 and above (so a prompt's group is `ids[0] // 1000 - 1`)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        system = [1000 * (g + 1) + rng.randrange(1000) for _ in range(prefix)]
        out += [system + [100_000 + rng.randrange(100_000) for _ in range(question)]
                for _ in range(per_group)]
    rng.shuffle(out)
    return out


def run(factor: float, shape: tuple[int, int, int, int], seed: int,
        workers: int) -> tuple[float, float]:
    groups, per_group, prefix, window = shape
    names = [f"w{i}" for i in range(workers)]
    policy = CacheAwarePolicy(names, balance_factor=factor)
    rng = random.Random(seed)
    inflight = []
    for ids in workload(groups, per_group, prefix, seed):
        if len(inflight) == window:
            policy.finish(inflight.pop(rng.randrange(window)))
        inflight.append(policy.route(ids, output_tokens=16))
    optimum = groups * (per_group - 1) * prefix
    hits = sum(policy.stats[w].matched_tokens for w in names)
    tokens = [policy.stats[w].routed_tokens for w in names]
    return hits / optimum, max(tokens) / (sum(tokens) / workers)


class SimCache:
    """One worker's KV pool of `capacity` tokens as a radix cache of two levels: a group's
    prefix (an inner node) and each finished request's suffix (question + output, a leaf
    under it). Requests in flight pin their prefix and hold their suffix's slots; when a new
    request needs room, the least recently used unpinned leaf goes first (a prefix is a leaf
    once none of its suffixes is cached). Evictions are reported as the radix cache does:
    the path to the evicted node plus its first token."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lru: OrderedDict[tuple[str, int], list[int]] = OrderedDict()  # key -> tokens
        self.children: dict[int, int] = {}  # group -> cached suffixes
        self.pins: dict[int, int] = {}  # group -> requests in flight
        self.held = 0  # slots of in-flight suffixes
        self.used = 0  # slots of cached nodes
        self.owner: dict[int, int] = {}  # cached suffix's request -> its group

    def admit(self, group: int, prefix: list[int], suffix_len: int) -> tuple[int, list[list[int]]]:
        """A request of `group` arrives: (prefix tokens it finds cached, eviction reports)."""
        key = ("g", group)
        hit = len(prefix) if key in self.lru else 0
        if hit:
            self.lru.move_to_end(key)
        else:
            self.lru[key] = prefix
            self.used += len(prefix)
        self.pins[group] = self.pins.get(group, 0) + 1
        self.held += suffix_len
        return hit, self._evict()

    def release(self, group: int, rid: int, suffix: list[int]) -> list[list[int]]:
        """The request finished: its suffix is cached, its prefix unpinned."""
        self.pins[group] -= 1
        self.held -= len(suffix)
        self.lru[("r", rid)] = suffix
        self.children[group] = self.children.get(group, 0) + 1
        self.used += len(suffix)
        self.owner[rid] = group
        return self._evict()

    def _evict(self) -> list[list[int]]:
        reports: list[list[int]] = []
        while self.used + self.held > self.capacity:
            victim = None
            for key in self.lru:
                kind, k = key
                if kind == "r" or (not self.pins.get(k) and not self.children.get(k)):
                    victim = key
                    break
            if victim is None:
                break  # everything pinned: the real scheduler would queue the request
            tokens = self.lru.pop(victim)
            self.used -= len(tokens)
            if victim[0] == "r":
                g = self.owner.pop(victim[1])
                self.children[g] -= 1
                reports.append(self.lru[("g", g)] + tokens[:1])
            else:
                reports.append(tokens[:1])
        return reports


def run_pressure(policy_name: str, shape: tuple[int, int, int, int], capacity: int, seed: int,
                 workers: int, question: int, output: int) -> tuple[float, float]:
    """(served hit rate = cached / prompt tokens, imbalance) of `workers` workers with
    `capacity` KV tokens each; `policy_name` "single" is one worker with workers x capacity."""
    groups, per_group, prefix, window = shape
    if policy_name == "single":
        workers, capacity, policy_name = 1, capacity * workers, "round_robin"
    names: list[Hashable] = list(range(workers))
    policy: RoutingPolicy = make_policy(policy_name, names, max_tree_tokens=capacity)
    caches = {w: SimCache(capacity) for w in names}
    rng = random.Random(seed)
    inflight: list[tuple[object, int, list[int]]] = []
    hits = prompt_tokens = 0

    def finish(i: int) -> None:
        d, rid, ids = inflight.pop(i)
        policy.finish(d)  # type: ignore[arg-type]
        w = d.worker  # type: ignore[attr-defined]
        suffix = ids[prefix:] + [200_000 + rid] * output
        policy.evicted(w, caches[w].release(ids[0] // 1000 - 1, rid, suffix))

    for rid, ids in enumerate(workload(groups, per_group, prefix, seed, question)):
        if len(inflight) == window:
            finish(rng.randrange(window))
        d = policy.route(ids, output_tokens=output)
        hit, reports = caches[d.worker].admit(ids[0] // 1000 - 1, ids[:prefix],
                                              question + output)
        policy.evicted(d.worker, reports)
        hits += hit
        prompt_tokens += len(ids)
        inflight.append((d, rid, ids))
    tokens = [policy.stats[w].routed_tokens for w in names]
    return hits / prompt_tokens, max(tokens) / (sum(tokens) / workers)


def main_pressure(a: argparse.Namespace) -> None:
    print(f"| groups x per group, prefix, window | KV tokens per worker (x{a.workers}) | "
          "working set | single hit | cache_aware hit | vs single | vs round-robin | "
          "round_robin hit | cache_aware imbalance median (worst) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in PRESSURE_SHAPES:
        groups, _, prefix, _ = shape
        for cap in a.capacities:
            res = {p: [run_pressure(p, shape, cap, s, a.workers, a.question, a.output)
                       for s in range(a.seeds)] for p in ("single", "cache_aware", "round_robin")}
            med = {p: statistics.median(r[0] for r in v) for p, v in res.items()}
            imb = [r[1] for r in res["cache_aware"]]
            print(f"| {shape[0]}x{shape[1]}, {shape[2]}, {shape[3]} | {cap} | "
                  f"{groups * prefix} | {med['single']:.3f} | {med['cache_aware']:.3f} | "
                  f"{med['cache_aware'] / med['single']:.2f}x | "
                  f"{med['cache_aware'] / med['round_robin']:.2f}x | {med['round_robin']:.3f} | "
                  f"{statistics.median(imb):.2f} ({max(imb):.2f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pressure", action="store_true",
                    help="model the KV pools; compare served hit rates per policy")
    ap.add_argument("--capacities", type=int, nargs="+", default=[1024, 1536, 2048],
                    help="--pressure: KV tokens per worker (one worker alone gets x workers)")
    ap.add_argument("--question", type=int, default=32, help="--pressure: question tokens")
    ap.add_argument("--output", type=int, default=16, help="--pressure: output tokens")
    a = ap.parse_args()
    if a.pressure:
        main_pressure(a)
        return
    print("| groups x per group, prefix, window | factor | hits/optimum median | worst | "
          "imbalance median | worst |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        for f in a.factors:
            res = [run(f, shape, s, a.workers) for s in range(a.seeds)]
            hits, imb = [r[0] for r in res], [r[1] for r in res]
            print(f"| {shape[0]}x{shape[1]}, {shape[2]}, {shape[3]} | {f:g} | "
                  f"{statistics.median(hits):.3f} | {min(hits):.3f} | "
                  f"{statistics.median(imb):.2f} | {max(imb):.2f} |")


if __name__ == "__main__":
    main()
