"""Paged decode's one-thread thresholds (`radixrt::attention_parallel_work`) on whole decode
steps: settings alternating step by step in one process on one `ModelRunner` (default SmolLM2).

    python bench/attention_parallel.py --settings 16384:16384 512:4096 0:2048 \
        [--paths team regions] [--kv-cache-dtype int8]

A setting is `team:regions`, the (query, key) pairs of an attention phase below which it runs
on one thread in a decode team / with a parallel region per op (work_queue.h); the first setting
is the baseline. Each shape is `rows` requests over `ctx` cached tokens of which the first
`shared` are the same slots for every row (a radix-cache hit: the step's plan makes them one
shared-prefix group, whose rows then have `ctx - shared` keys of their own). Every step runs
every setting on the path in turn (the order rotating, the logits are bitwise the same), so all
see the same context lengths. Prints per shape and path the median step of each setting and the
median ratio of its step to the baseline's adjacent step (< 1: faster than the baseline).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

# name -> (rows, ctx, shared)
SHAPES: dict[str, tuple[int, int, int]] = {
    "b1-ctx100": (1, 100, 0),
    "b1-ctx600": (1, 600, 0),
    "b2-shared250of300": (2, 300, 250),
    "b4-shared200of300": (4, 300, 200),
    "b8-shared400of600": (8, 600, 400),
    "b8-shared1500of1560": (8, 1560, 1500),
    "b8-ctx600": (8, 600, 0),
    "b32-shared400of600": (32, 600, 400),
}


def parse_setting(text: str) -> tuple[int, int]:
    team, regions = text.split(":")
    return int(team), int(regions)


class SharedPrefixDecoder:
    """Decode steps of `rows` requests whose first `shared` cached slots are the same (random
    K/V); `step()` runs one forward pass per callback in `variants` on the same batch (each
    rewrites the step's K/V identically) and returns their times."""

    def __init__(self, runner: object, rows: int, ctx: int, shared: int):
        r = runner
        rp, kp = r.req_to_token_pool, r.token_to_kv_pool  # type: ignore[attr-defined]
        rp.clear()
        kp.clear()
        self.runner, self.rows, self.seq = runner, rows, ctx
        self.reqs = [rp.alloc() for _ in range(rows)]
        common = kp.alloc(shared)
        own = kp.alloc(rows * (ctx - shared))
        slots = torch.cat([torch.cat([common, part]) for part in own.split(ctx - shared)])
        rp.write(self.reqs, [0] * rows, [ctx] * rows, slots)
        g = torch.Generator().manual_seed(0)
        used = torch.cat([common, own])
        for layer in range(len(kp.k_buffer)):  # set_kv: an int8 pool gets codes and scales
            shape = (used.numel(), *kp.k_buffer[layer].shape[1:])
            kp.set_kv(layer, used, torch.randn(shape, generator=g),
                      torch.randn(shape, generator=g))
        self.nxt = list(range(100, 100 + rows))

    def step(self, variants: list) -> list[float]:
        from radixrt.core.forward_batch import ForwardBatch, ForwardMode
        from radixrt.sampling.sampler import row_argmax

        r, n = self.runner, self.rows
        rp, kp = r.req_to_token_pool, r.token_to_kv_pool  # type: ignore[attr-defined]
        rp.write(self.reqs, [self.seq] * n, [1] * n, kp.alloc(n))
        fb = ForwardBatch.build(ForwardMode.DECODE, self.nxt, self.reqs, [self.seq] * n,
                                [1] * n, rp.req_to_token, r.device)  # type: ignore[attr-defined]
        times, logits = [], None
        for set_variant in variants:
            set_variant()
            t = time.perf_counter()
            logits = r.forward(fb)  # type: ignore[attr-defined]
            times.append(time.perf_counter() - t)
        self.nxt = row_argmax(logits).tolist()
        self.seq += 1
        return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", type=parse_setting,
                    default=[(16384, 16384), (512, 4096)], help="team:regions, baseline first")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--paths", nargs="+", choices=("team", "regions"), default=["team", "regions"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", help="write the results as JSON")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    shapes = {name: SHAPES[name] for name in a.shapes}
    max_rows = max(rows for rows, _, _ in shapes.values())
    max_ctx = max(ctx for _, ctx, _ in shapes.values()) + a.steps + 8
    tokens = max(shared + rows * (ctx - shared + a.steps + 8)
                 for rows, ctx, shared in shapes.values())
    runner = ModelRunner(ServerArgs(max_running_requests=max_rows, max_total_tokens=tokens + 64,
                                    max_context_len=max_ctx, log_level="warning",
                                    num_threads=a.threads, kv_cache_dtype=a.kv_cache_dtype))
    model, op = runner.model, torch.ops.radixrt.attention_parallel_work
    default = op()
    print(f"dtype {runner.dtype}, KV {runner.token_to_kv_pool.kv_dtype}, {a.threads} threads; "
          f"built-in thresholds team {default[0]}, regions {default[1]}", flush=True)
    results = []
    for name, (rows, ctx, shared) in shapes.items():
        for path in a.paths:
            def variant(setting: tuple[int, int], path: str = path) -> object:
                def set_variant() -> None:
                    model.decode_team = path == "team"
                    op(*setting)
                return set_variant

            variants = [variant(s) for s in a.settings]
            d = SharedPrefixDecoder(runner, rows, ctx, shared)
            times: list[list[float]] = [[] for _ in a.settings]
            ratios: list[list[float]] = [[] for _ in a.settings]
            for i in range(a.steps + 3):
                k = i % len(variants)  # rotate the order
                order = list(range(k, len(variants))) + list(range(k))
                got = d.step([variants[j] for j in order])
                by = dict(zip(order, got, strict=True))
                if i < 3:
                    continue
                for j in range(len(variants)):
                    times[j].append(by[j])
                    ratios[j].append(by[j] / by[0])
            row = {"shape": name, "rows": rows, "ctx": ctx, "shared": shared, "path": path,
                   "settings": [f"{t}:{r}" for t, r in a.settings],
                   "median_ms": [statistics.median(t) * 1e3 for t in times],
                   "ratio_to_first": [statistics.median(r) for r in ratios]}
            results.append(row)
            print(f"{name:22s} {path:8s} " + "  ".join(
                f"{s} {m:6.2f} ms ({q:.3f}x)" for s, m, q in
                zip(row["settings"], row["median_ms"], row["ratio_to_first"], strict=True)),
                flush=True)
    op(*default)
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": [list(s) for s in a.settings],
                                           "threads": a.threads, "kv": a.kv_cache_dtype,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
