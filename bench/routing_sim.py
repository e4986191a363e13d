"""Routing policies on simulated closed-loop workloads, no model: how many prompt tokens the
cache-aware policy predicts as hits (vs the one-replica optimum) and how evenly it spreads the
routed tokens, per `--routing-balance-factor`.

    python bench/routing_sim.py                       # factors 1 2 4 8, the benchmark shapes

Each shape is groups x prompts per group sharing a system prompt of `prefix` tokens (+ 8
distinct tokens), shuffled; a client keeps `window` requests in flight and, before each new
arrival, one random in-flight request finishes. Worker speed is not modelled: this measures
the decisions, `bench/routing.py` the served result. Over `--seeds` seeds: median and worst
predicted hits / optimum, median and worst imbalance (max / mean routed tokens).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402

from radixrt.routing.policy import CacheAwarePolicy  # noqa: E402

SHAPES = [(8, 8, 512, 16), (4, 4, 192, 8), (16, 4, 256, 16), (32, 2, 256, 16), (1, 64, 512, 16),
          (8, 8, 512, 4)]


def workload(groups: int, per_group: int, prefix: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        system = [1000 * (g + 1) + rng.randrange(1000) for _ in range(prefix)]
        out += [system + [rng.randrange(100_000) for _ in range(8)] for _ in range(per_group)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
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
