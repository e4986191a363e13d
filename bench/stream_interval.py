"""What `--stream-interval` and held non-streamed outputs save, on live `radixrt serve`s.

    python bench/stream_interval.py --intervals 1 4 --concurrency 8 --rounds 3
    python bench/stream_interval.py --intervals 1 --non-stream --concurrency 8

One server per interval (default SmolLM2, each started once, side by side; only one is driven at
a time, the others sit idle), driven in turn for `--rounds` rounds, the order rotating, after a
warm-up round that caches every prompt on every server (so no variant gets a colder cache than
another): every round sends the same `--requests` completions (a shared `--prefix-tokens` head, a short unique
tail, greedy, `max_tokens` each with ignore_eos), at most `--concurrency` in flight.

Streamed (default): each request streams; per server, the output tokens per second over the
round, the SSE chunks per request, and the CPU seconds per 1000 output tokens of the driving
client and of each of the server's processes (scheduler, detokenizer, HTTP).
`--non-stream`: every server gets each request twice per round, in turn, as two variants: held
(not streamed, no stop string: outs every 32 tokens) and per-token (not streamed, with a stop
string that never matches: per interval, as before held outputs). The same figures per variant.

Ratios: for each server (or variant) after the first, its tok/s over the first's in the same
round, median over rounds (> 1: faster than the first).
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
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench.serving import launch_radixrt, sse_events, stop_server  # noqa: E402

NEVER = "\x00\x01never\x01\x00"  # a stop string no output contains


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server's process tree, by role (scheduler / detokenizer / http)."""
    import psutil

    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = ("scheduler" if "scheduler" in cmd else "detokenizer" if "detok" in cmd
                else "http" if p.pid == pid else "other")
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


async def drive(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                stream: bool, stop: list[str] | None) -> tuple[int, int, float]:
    """(output tokens, SSE chunks, seconds) for one round against one server."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    tokens = chunks = 0

    async def one(ids: list[int], http: httpx.AsyncClient) -> None:
        nonlocal tokens, chunks
        body: dict[str, Any] = {"model": "default", "prompt": ids, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": stream}
        if stop:
            body["stop"] = stop
        async with sem:
            if not stream:
                r = await http.post(url + "/v1/completions", json=body)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]
                return
            body["stream_options"] = {"include_usage": True}
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for ev in sse_events(r.aiter_lines()):
                    if ev.get("choices"):
                        chunks += 1
                    if ev.get("usage"):
                        tokens += ev["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as http:
        await asyncio.gather(*(one(p, http) for p in prompts))
    return tokens, chunks, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--non-stream", action="store_true")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=30400)
    ap.add_argument("--server-args", default="", help="extra `radixrt serve` flags for all")
    ap.add_argument("--out", help="JSON lines: one per round and server/variant")
    a = ap.parse_args()

    import resource

    rng = random.Random(0)
    head = [rng.randrange(100, 40000) for _ in range(a.prefix_tokens)]
    prompts = [[*head, *(rng.randrange(100, 40000) for _ in range(16))]
               for _ in range(a.requests)]
    servers = {}
    try:
        for k, n in enumerate(a.intervals):
            port = a.port + k
            servers[n] = (launch_radixrt(port, a.threads, ["--stream-interval", str(n),
                                                            *a.server_args.split()]),
                          f"http://127.0.0.1:{port}")
        for _, url in servers.values():  # warm: every prompt cached on every server first,
            asyncio.run(drive(url, prompts, 8, a.concurrency, True, None))  # as in later rounds
        variants = [(n, v) for n in a.intervals
                    for v in (("held", "per-token") if a.non_stream else ("stream",))]
        rows: dict[tuple[int, str], list[dict[str, float]]] = {v: [] for v in variants}
        for r in range(a.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for n, v in order:
                proc, url = servers[n]
                cpu0 = process_cpu(proc.pid)
                me0 = resource.getrusage(resource.RUSAGE_SELF)
                toks, chunks, secs = asyncio.run(drive(
                    url, prompts, a.max_tokens, a.concurrency, v == "stream",
                    [NEVER] if v == "per-token" else None))
                me1 = resource.getrusage(resource.RUSAGE_SELF)
                cpu1 = process_cpu(proc.pid)
                per_k = 1000.0 / max(1, toks)
                row = {"round": r, "interval": n, "variant": v, "tok_per_s": toks / secs,
                       "chunks_per_request": chunks / len(prompts),
                       "client_cpu_per_1k": (me1.ru_utime + me1.ru_stime - me0.ru_utime
                                             - me0.ru_stime) * per_k,
                       **{f"{role}_cpu_per_1k": (cpu1.get(role, 0) - cpu0.get(role, 0)) * per_k
                          for role in ("scheduler", "detokenizer", "http")}}
                rows[(n, v)].append(row)
                print(json.dumps({k: round(x, 3) if isinstance(x, float) else x
                                  for k, x in row.items()}), flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    first = variants[0]
    print(f"\nconcurrency {a.concurrency}, {a.requests} requests x {a.max_tokens} tokens, "
          f"{a.rounds} rounds; medians")
    for key in variants:
        rs = rows[key]
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]
               if k not in ("round", "interval", "variant")}
        ratio = ""
        if key != first:
            r = statistics.median(x["tok_per_s"] / y["tok_per_s"]
                                  for x, y in zip(rs, rows[first], strict=True))
            ratio = f"  vs first {r:.3f}x"
        print(f"interval {key[0]:2d} {key[1]:9s} {med['tok_per_s']:7.1f} tok/s  chunks/req "
              f"{med['chunks_per_request']:5.1f}  CPU s per 1k tokens: client "
              f"{med['client_cpu_per_1k']:.3f} http {med['http_cpu_per_1k']:.3f} detok "
              f"{med['detokenizer_cpu_per_1k']:.3f} scheduler {med['scheduler_cpu_per_1k']:.3f}"
              f"{ratio}")


if __name__ == "__main__":
    main()
