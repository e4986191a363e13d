"""Routing across replicas: one replica given every core vs `radixrt serve --dp 2` and two
servers behind `radixrt router`, each with every routing policy, on interleaved shared-prefix
groups (more groups than workers).

    python bench/routing.py                                   # default systems, small gsp
    python bench/routing.py --groups 8 --per-group 8 --system-len 512 --max-concurrency 16
    python bench/routing.py --systems single dp-cache_aware dp-round_robin --md out.md
    python bench/routing.py --rounds 3 ...                    # systems interleaved, medians
    python bench/routing.py --total-kv-tokens 3072 --groups 8 --per-group 8 --system-len 256
                                                              # memory pressure (see below)

Per system: a fresh server (or servers + router) with `--threads` cores in all (split between
the replicas, each pinned to its own cores when there are enough), a warm-up request, then the
`gsp` workload from `bench/datasets.py` through `bench/serving.py`'s streaming client. Reported:
total token throughput, TTFT p50 / p99, achieved hit rate (usage.cached_tokens), hit rate
relative to the single replica's (`single` must be in the run) and to the workload's optimum,
and load imbalance = max / mean prompt tokens routed per worker (from the front end's routing
counters: `/debug/stats` `routing` for --dp, `/workers` for the router).

Memory: without `--total-kv-tokens` every server sizes its KV pool from free memory as usual
(`--max-total-tokens` is per replica, so `--dp 2` then has twice the single replica's pool).
`--total-kv-tokens T` makes the budget equal: the single replica gets `--max-total-tokens T`,
each of the 2 replicas (dp or router workers) T/2, and the cache-aware trees are bounded at
T/2 (`--routing-max-tree-tokens`). With a working set (groups x system-len) between T/2 and T,
this is the regime the router is for: round-robin makes every replica hold every group's
prefix, cache-aware partitions the groups so the pools add up.

Arrival order: the `gsp` prompts come in the dataset's seeded shuffle (not group by group in
turn, where 2-way round-robin would send each group of an even count to one replica and look
cache-aware by accident); the report states how many groups round-robin reaches both replicas
with in this order.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench.common import cpu_name, markdown_table, warmup_prompt  # noqa: E402
from bench.datasets import default_tokenizer, make_workload  # noqa: E402
from bench.metrics import compute_metrics, run_optimal_hit_rate  # noqa: E402
from bench.serving import Client, drive_server, stop_server, wait_healthy  # noqa: E402

SYSTEMS = ("single", "dp-cache_aware", "dp-round_robin", "dp-least_load",
           "router-cache_aware", "router-round_robin", "router-least_load")
DEFAULT_SYSTEMS = ("single", "dp-cache_aware", "dp-round_robin", "dp-least_load",
                   "router-cache_aware", "router-round_robin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen(cmd: list[str], cpus: list[int] | None, log: Any) -> subprocess.Popen:
    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True,
                            preexec_fn=pin)


def serve_cmd(port: int, threads: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "radixrt", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--num-threads", str(threads), "--log-level", "warning", *extra]


REPLICAS = 2  # of `dp-*` and `router-*` systems


def memory_args(kind: str, total_kv_tokens: int | None) -> list[str]:
    """Per-server KV flags giving every system the same total budget: all of it to `single`,
    1/REPLICAS to each replica (and the cache-aware trees bounded alike)."""
    if total_kv_tokens is None:
        return []
    share = total_kv_tokens if kind == "single" else total_kv_tokens // REPLICAS
    out = ["--max-total-tokens", str(share)]
    if kind == "dp":
        out += ["--routing-max-tree-tokens", str(share)]
    return out


def round_robin_spread(workload: Any, system_len: int) -> tuple[int, int]:
    """(groups that 2-way round-robin in arrival order sends to both replicas, groups)."""
    seen: dict[tuple[int, ...], set[int]] = {}
    for i, s in enumerate(workload.sessions):
        seen.setdefault(tuple(s.turns[0].append[:system_len]), set()).add(i % REPLICAS)
    return sum(len(v) > 1 for v in seen.values()), len(seen)


class Deployment:
    """The processes of one system; `url` is where clients go, `routed_tokens()` per worker."""

    def __init__(self, system: str, threads: int, server_args: list[str], log: Any,
                 total_kv_tokens: int | None = None):
        self.procs: list[subprocess.Popen] = []
        kind, _, policy = system.partition("-")
        cores = sorted(os.sched_getaffinity(0))
        self.kind = kind
        server_args = [*server_args, *memory_args(kind, total_kv_tokens)]
        try:
            if kind == "single":
                port = free_port()
                self.procs.append(popen(serve_cmd(port, threads, server_args), None, log))
                self.url = f"http://127.0.0.1:{port}"
            elif kind == "dp":
                port = free_port()
                self.procs.append(popen(serve_cmd(port, threads, [
                    *server_args, "--dp", str(REPLICAS), "--routing-policy", policy]), None, log))
                self.url = f"http://127.0.0.1:{port}"
            elif kind == "router":
                half = max(1, threads // 2)
                shares = ([cores[: len(cores) // 2], cores[len(cores) // 2:]]
                          if len(cores) >= 2 else [None, None])
                workers = []
                for share in shares:
                    port = free_port()
                    self.procs.append(popen(serve_cmd(port, half, server_args), share, log))
                    workers.append(f"http://127.0.0.1:{port}")
                for w, p in zip(workers, self.procs, strict=True):
                    wait_healthy(w, proc=p)
                port = free_port()
                self.procs.append(popen([
                    sys.executable, "-m", "radixrt", "router", "--port", str(port),
                    "--log-level", "warning", "--routing-policy", policy,
                    *(["--routing-max-tree-tokens", str(total_kv_tokens // REPLICAS)]
                      if total_kv_tokens else []),
                    "--worker-url", *workers], None, log))
                self.url = f"http://127.0.0.1:{port}"
            else:
                raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
            wait_healthy(self.url, proc=self.procs[-1])
        except BaseException:
            self.stop()
            raise

    def routed_tokens(self) -> list[int]:
        if self.kind == "single":
            return [0]
        if self.kind == "dp":
            stats = httpx.get(self.url + "/debug/stats", timeout=30).json()
            return [r["routed_tokens"] for r in stats["routing"]]
        workers = httpx.get(self.url + "/workers", timeout=30).json()["workers"]
        return [w["routed_tokens"] for w in workers]

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_server(p)


def run_system(system: str, workload: Any, tok: Any, args: argparse.Namespace,
               log: Any) -> dict[str, Any]:
    dep = Deployment(system, args.threads, args.server_args.split(), log, args.total_kv_tokens)
    try:
        warm = warmup_prompt()
        httpx.post(dep.url + "/v1/completions", json={"model": "default", "prompt": warm,
                                                      "max_tokens": 2}, timeout=300)
        before = dep.routed_tokens()

        async def drive() -> list[Any]:
            client = Client(dep.url, tokenizer=tok)
            try:
                return await drive_server(client, workload, args.max_concurrency)
            finally:
                await client.close()

        records = asyncio.run(drive())
        after = dep.routed_tokens()
    finally:
        dep.stop()
    m = compute_metrics(records)
    routed = [a - b for a, b in zip(after, before, strict=True)]
    imbalance = (max(routed) / (sum(routed) / len(routed))) if sum(routed) else 1.0
    return {"system": system, "metrics": m, "routed_tokens": routed,
            "imbalance": imbalance if dep.kind != "single" else 1.0,
            "optimal_hit_rate": run_optimal_hit_rate(workload, records)}


def median_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system (first-seen order), the round with the median total throughput, with every
    round's throughput in `rounds_tok_s` (rounds interleave the systems, so each sees the
    machine's load drift alike)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["system"], []).append(r)
    out = []
    for runs in by.values():
        ok = sorted((r for r in runs if r["metrics"].get("completed")),
                    key=lambda r: r["metrics"]["total_tok_per_s"])
        pick = dict(ok[(len(ok) - 1) // 2] if ok else runs[0])
        pick["rounds_tok_s"] = [round(r["metrics"].get("total_tok_per_s", 0)) for r in runs]
        out.append(pick)
    return out


def report(results: list[dict[str, Any]], args: argparse.Namespace, desc: str) -> str:
    results = median_runs(results)
    single = next((r for r in results if r["system"] == "single"), None)
    rr = {r["system"].split("-")[0]: r for r in results if r["system"].endswith("round_robin")}
    lines = [
        f"# Routing across replicas ({datetime.date.today()})", "",
        f"- CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores visible, `--threads "
        f"{args.threads}` in all per system (split between replicas)",
        f"- workload: gsp {desc}, max concurrency {args.max_concurrency}; arrival order: the "
        f"dataset's seeded shuffle (2-way round-robin reaches both replicas with "
        f"{args.rr_spread[0]} of {args.rr_spread[1]} groups)",
        "- KV budget: " + (f"{args.total_kv_tokens} tokens in all (`single` "
                           f"--max-total-tokens {args.total_kv_tokens}, each of the "
                           f"{REPLICAS} replicas {args.total_kv_tokens // REPLICAS}); working "
                           f"set {args.groups * args.system_len} prefix tokens"
                           if args.total_kv_tokens else
                           "each server's own default (`--max-total-tokens` per replica)"),
        f"- command: `python bench/routing.py {' '.join(sys.argv[1:])}`",
        f"- load average when the report was written: {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs (other jobs on the machine inflate absolute figures; compare "
        "ratios within the run)",
        f"- rounds: {args.rounds} (systems interleaved; each row is the system's median-"
        "throughput round, `tok/s per round` lists all)", "",
    ]
    headers = ["system", "total tok/s", "vs single", "TTFT p50 s", "TTFT p99 s", "hit rate",
               "vs single's hit", "vs round-robin's hit", "/ optimal",
               "imbalance (max/mean routed tokens)", "tok/s per round"]
    rows: list[list[object]] = []
    for r in results:
        m = r["metrics"]
        if not m.get("completed"):
            rows.append([r["system"], "failed", *[""] * (len(headers) - 2)])
            continue
        hit = m["hit_rate"] or 0.0
        base = rr.get(r["system"].split("-")[0])

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}x" if a is not None and b else "-"

        rows.append([
            r["system"], f"{m['total_tok_per_s']:.0f}",
            ratio(m["total_tok_per_s"], single and single["metrics"].get("total_tok_per_s")),
            f"{m['ttft_s']['p50']:.3f}", f"{m['ttft_s']['p99']:.3f}", f"{hit:.3f}",
            ratio(hit, single and single["metrics"].get("hit_rate")),
            ratio(hit, base and base["metrics"].get("hit_rate")),
            ratio(hit, r["optimal_hit_rate"]), f"{r['imbalance']:.2f}",
            " ".join(map(str, r["rounds_tok_s"]))])
    return "\n".join(lines) + "\n" + markdown_table(headers, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--server-args", default="--dtype float32",
                    help="extra `radixrt serve` flags for every worker")
    ap.add_argument("--total-kv-tokens", type=int, default=None,
                    help="KV budget per system: --max-total-tokens T for single, T/2 for each "
                         "replica (default: every server sizes its own pool)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems in turn this many times; report each one's median")
    ap.add_argument("--md", default=None, help="write the report here (default: stdout only)")
    ap.add_argument("--json", default=None, help="write the metrics here")
    ap.add_argument("--log", default=os.devnull, help="servers' output")
    a = ap.parse_args()
    tok = default_tokenizer()
    w = make_workload("gsp", a.seed, tok, groups=a.groups, prompts_per_group=a.per_group,
                      system_len=a.system_len, question_len=a.question_len,
                      output_len=a.output_len)
    a.rr_spread = round_robin_spread(w, a.system_len)
    results = []
    with open(a.log, "a") as log:
        for rnd, system in ((i, s) for i in range(a.rounds) for s in a.systems):
            print(f"-- {system} (round {rnd + 1}/{a.rounds})", flush=True)
            r = run_system(system, w, tok, a, log)
            m = r["metrics"]
            print(f"   {m.get('total_tok_per_s', 0):.0f} tok/s  hit {m.get('hit_rate')}  "
                  f"TTFT p50 {m.get('ttft_s', {}).get('p50')}  imbalance {r['imbalance']:.2f} "
                  f"routed {r['routed_tokens']}", flush=True)
            results.append(r)
            # Written after every system, so a long run interrupted keeps what it measured.
            if a.md:
                Path(a.md).write_text(report(results, a, w.description))
            if a.json:
                Path(a.json).write_text(json.dumps(results, indent=1))
    print(report(results, a, w.description))


if __name__ == "__main__":
    main()
