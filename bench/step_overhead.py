"""Step-overhead experiments (bench/results/2026-11-23-step-overhead.md), interleaved A/B.

    python bench/step_overhead.py threads --batch-size 1 8 --rounds 3
        bare decode step (offline.py one-batch, random K/V) under OpenMP environments:
        default spin, GOMP_SPINCOUNT 10k / 100k, passive, 1 thread
    python bench/step_overhead.py serve --rounds 2
        `radixrt serve` on a small gsp at concurrency 8: thread_wait passive + helper_nice 10
        against spin + 0 (the behaviour before)
    python bench/step_overhead.py compile --dtype float32 --batch-size 1 8 64
        eager vs compile_decode, CPU time of a bare decode step at 1 thread
    python bench/step_overhead.py profile --dtype bfloat16 --batch-size 8
        torch.profiler table of a bare decode step at 1 thread

Each variant of `threads` / `serve` runs in its own process (OpenMP reads its environment once,
at load), variants in turn, `--rounds` times; medians are printed at the end.
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
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench.decode_steps import RandomKVDecoder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARIANTS: dict[str, dict[str, str]] = {
    "spin (OpenMP default)": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread, passive": {"OMP_WAIT_POLICY": "PASSIVE", "THREADS": "1"},
}
SERVE_VARIANTS = {"passive + helper_nice 10": "",
                  "spin + helper_nice 0 (before)": "--thread-wait spin --helper-nice 0"}


def _env(overrides: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update({k: v for k, v in overrides.items() if v and k != "THREADS"})
    env["PYTHONPATH"] = str(ROOT)
    return env


def threads(a: argparse.Namespace) -> None:
    res: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for name, ov in THREAD_VARIANTS.items():
            wait = "passive" if ov.get("OMP_WAIT_POLICY") == "PASSIVE" else "spin"
            cmd = [sys.executable, str(ROOT / "bench" / "offline.py"), "one-batch",
                   "--batch-size", *map(str, a.batch_size), "--input-len", str(a.input_len),
                   "--output-len", "12", "--runs", "1", "--prefill-max-tokens", "0",
                   "--dtype", a.dtype, "--thread-wait", wait,
                   "--threads", ov.get("THREADS", str(a.threads))]
            out = subprocess.run(cmd, env=_env(ov), capture_output=True, text=True)
            try:
                rows = json.loads(out.stdout)["rows"]
            except (json.JSONDecodeError, KeyError):
                print(f"{name}: failed\n{out.stderr[-2000:]}")
                continue
            for row in rows:
                res.setdefault((name, row["batch_size"]), []).append(row["decode_ms_per_step"])
            print(f"round {r} {name:24s} " + "  ".join(
                f"batch {row['batch_size']}: {row['decode_ms_per_step']:.1f} ms" for row in rows)
                + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    for (name, bs), v in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"batch {bs:3d} {name:24s} median {statistics.median(v):8.1f} ms  "
              f"{[round(x, 1) for x in v]}")


def serve(a: argparse.Namespace) -> None:
    from bench.common import read_results, save_workloads
    from bench.datasets import default_tokenizer, make_workload
    from bench.metrics import compute_metrics

    w = make_workload("gsp", 0, default_tokenizer(), groups=2, prompts_per_group=8,
                      system_len=256, question_len=32, output_len=32)
    tmp = Path(tempfile.mkdtemp(prefix="radixrt-step-"))
    wf = tmp / "gsp.json"
    save_workloads(wf, [w])
    res: dict[str, list[dict[str, Any]]] = {}
    for r in range(a.rounds):
        for name, flags in SERVE_VARIANTS.items():
            out = tmp / f"{r}-{len(res.get(name, []))}-{abs(hash(name))}.jsonl"
            cmd = [sys.executable, str(ROOT / "bench" / "serving.py"), "--launch-radixrt",
                   "--base-url", f"http://127.0.0.1:{a.port}", "--threads", str(a.threads),
                   "--workload-file", str(wf), "--out", str(out), "--max-concurrency", "8",
                   "--flush-cache", "--no-progress", "--server-args", flags]
            t = time.perf_counter()
            try:
                subprocess.run(cmd, env=_env({}), capture_output=True, text=True,
                               timeout=a.timeout_s)
            except subprocess.TimeoutExpired:
                print(f"round {r} {name}: timed out after {a.timeout_s} s", flush=True)
                continue
            recs = read_results(out)
            if not recs:
                print(f"round {r} {name}: no result", flush=True)
                continue
            m = compute_metrics(recs[0]["records"])
            res.setdefault(name, []).append(m)
            print(f"round {r} {name:30s} total {m['total_tok_per_s']:7.1f} tok/s  ITL p50 "
                  f"{m['itl_s']['p50'] * 1e3:7.1f} ms  TTFT p50 {m['ttft_s']['p50']:.2f} s  "
                  f"wall {time.perf_counter() - t:.0f} s  (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    for name, ms in res.items():
        print(f"{name:30s} median total {statistics.median(m['total_tok_per_s'] for m in ms):.1f}"
              f" tok/s, ITL p50 {statistics.median(m['itl_s']['p50'] for m in ms) * 1e3:.1f} ms")


def _bare_runner(dtype: str, max_bs: int, ctx: int, compile_decode: bool = False) -> Any:
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    return ModelRunner(ServerArgs(
        max_running_requests=max_bs, max_total_tokens=max_bs * (ctx + 64) + 64,
        max_context_len=ctx + 64, attention_backend="torch", log_level="warning", dtype=dtype,
        num_threads=1, compile_decode=compile_decode))


def compile_ab(a: argparse.Namespace) -> None:
    import torch

    from radixrt.model.compiled_layers import CompiledDense

    torch.set_num_threads(1)
    runner = _bare_runner(a.dtype, max(a.batch_size), a.input_len)
    compiled = CompiledDense(runner.model.layers)
    t, c = time.perf_counter(), time.process_time()
    with compiled.active():
        RandomKVDecoder(runner, a.batch_size[0], a.input_len).step()
    print(f"first compiled step: wall {time.perf_counter() - t:.1f} s, this process's CPU "
          f"{time.process_time() - c:.1f} s (inductor compiles in worker processes too)")
    res: dict[tuple[int, bool], list[float]] = {}
    for _ in range(a.rounds):
        for bs in a.batch_size:
            for on in (False, True):
                dec = RandomKVDecoder(runner, bs, a.input_len)
                for i in range(7):
                    c = time.thread_time()
                    if on:
                        with compiled.active():
                            dec.step()
                    else:
                        dec.step()
                    if i:  # the first step of each block warms up (and recompiles if needed)
                        res.setdefault((bs, on), []).append(time.thread_time() - c)
    for bs in a.batch_size:
        e, k = (statistics.median(res[(bs, on)]) * 1e3 for on in (False, True))
        print(f"{a.dtype} batch {bs}: eager {e:.1f} ms CPU, compiled {k:.1f} ms ({k / e:.2f}x)")


def profile(a: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    torch.set_num_threads(1)
    bs = a.batch_size[0]
    dec = RandomKVDecoder(_bare_runner(a.dtype, bs, a.input_len), bs, a.input_len)
    dec.step()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(3):
            dec.step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("threads", "serve", "compile", "profile"):
        p = sub.add_parser(name)
        p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
        p.add_argument("--input-len", type=int, default=512)
        p.add_argument("--dtype", default="float32")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--port", type=int, default=30457)
        p.add_argument("--timeout-s", type=float, default=900.0)
    a = ap.parse_args()
    if a.cmd in ("compile", "profile"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
    {"threads": threads, "serve": serve, "compile": compile_ab, "profile": profile}[a.cmd](a)


if __name__ == "__main__":
    main()
