"""radixrt offline benchmarks: Engine throughput on the workloads, and one-batch timings.

    python bench/offline.py throughput --preset tiny [--workloads gsp] [--threads 2]
    python bench/offline.py one-batch --batch-size 1 4 --input-len 512 --output-len 16
    python bench/offline.py run-workload --system radixrt --workload-file W.json --out R.jsonl

`throughput` / `run-workload` drive `radixrt.Engine` in this process through
`Engine.generate_stream(input_ids=...)` (greedy, EOS ignored so every system generates the same
number of tokens), every session's first turn sent at its arrival time and each later turn as
soon as the previous one finished, so TTFT / ITL are measured as a client sees them (the same
SGLang definitions as `serving.py`). After each workload the engine's counters give the
scheduler's per-step time split (`stats()["step_time_s"]`: schedule / build / forward / sample /
process) for that workload alone.

`one-batch` is SGLang's `bench_one_batch` idea: a `ModelRunner` driven directly with the pools
(no scheduler, no processes): one prefill of `batch x input_len` tokens, then `output_len` decode
steps, timed per step; prefill tok/s and decode ms/step per batch size.
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
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import (  # noqa: E402
    RequestRecord,
    Workload,
    iter_workloads,
    progress_bar,
    warmup_prompt,
    write_result,
)
from bench.metrics import compute_metrics  # noqa: E402

RADIXRT_SYSTEMS = {
    "radixrt": {},
    "radixrt-no-radix": {"disable_radix_cache": True},
    "radixrt-fcfs": {"schedule_policy": "fcfs"},
}
STEP_PARTS = ("schedule", "build", "forward", "sample", "process")


# -- Engine driver ------------------------------------------------------------------------------------
async def drive_engine(engine: Any, workload: Workload, max_concurrency: int | None = None,
                       budget_s: float | None = None, progress: bool = False,
                       ) -> tuple[list[RequestRecord], str]:
    """Run a workload through `engine.generate_stream`; one record per request."""
    from radixrt import SamplingParams

    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    skipped = 0
    bar = progress_bar(workload.num_requests, workload.name, progress)

    async def request(prompt: list[int], max_tokens: int, rec: RequestRecord) -> None:
        sp = SamplingParams(max_new_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for ch in engine.generate_stream(input_ids=prompt, sampling_params=sp):
            t = now()
            if ch.token_ids:
                rec.add_chunk(t, len(ch.token_ids))
                rec.output_ids.extend(ch.token_ids)
            if ch.error:
                rec.error = ch.error
            if ch.finish_reason is not None:
                rec.cached_tokens = ch.cached_tokens
                rec.end = t

    async def session(s: Any) -> None:
        nonlocal skipped
        await asyncio.sleep(max(0.0, s.arrival - now()))
        prompt: list[int] = []
        out: list[int] = []
        for k, turn in enumerate(s.turns):
            if budget_s is not None and now() > budget_s:
                skipped += len(s.turns) - k
                return
            prompt = (prompt + out if k else []) + turn.append
            if sem is not None:
                await sem.acquire()
            rec = RequestRecord(s.id, k, len(prompt), turn.max_tokens, now())
            try:
                await request(prompt, turn.max_tokens, rec)
            except Exception as e:  # recorded; the run goes on
                rec.error = f"{type(e).__name__}: {e}"
                rec.end = now()
            finally:
                if sem is not None:
                    sem.release()
            records.append(rec)
            bar.update(1)
            if not rec.ok:
                skipped += len(s.turns) - k - 1
                return
            out = rec.output_ids

    await asyncio.gather(*(session(s) for s in workload.sessions))
    bar.close()
    records.sort(key=lambda r: (r.session, r.turn))
    note = (f"stopped after the {budget_s:.0f} s budget: {len(records)} of "
            f"{workload.num_requests} requests served" if skipped and budget_s else "")
    return records, note


def engine_args(system: str, threads: int, model_path: str | None = None,
                **overrides: Any) -> dict[str, Any]:
    if system not in RADIXRT_SYSTEMS:
        raise ValueError(f"unknown radixrt system {system!r}")
    return {"num_threads": threads, "log_level": "warning", "model_path": model_path,
            **RADIXRT_SYSTEMS[system], **overrides}


def step_delta(before: dict[str, Any], after: dict[str, Any],
               key: str = "step_time_s") -> dict[str, float]:
    b, a = before.get(key, {}), after.get(key, {})
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}


def run_engine_workloads(system: str, workloads: Sequence[Workload], threads: int,
                         out: str | None = None, budget_s: float | None = None,
                         max_concurrency: int | None = None, progress: bool = False,
                         model_path: str | None = None) -> list[dict[str, Any]]:
    """One Engine for all workloads (cache flushed between them); one result dict each."""
    from radixrt import Engine, SamplingParams

    results = []
    t_load = time.perf_counter()
    with Engine(**engine_args(system, threads, model_path)) as engine:
        load_s = time.perf_counter() - t_load
        engine.generate(input_ids=warmup_prompt(),
                        sampling_params=SamplingParams(max_new_tokens=8, temperature=0))
        for w in workloads:
            engine.wait_idle()
            engine.flush_cache()
            before = engine.stats()
            records, note = asyncio.run(drive_engine(engine, w, max_concurrency, budget_s,
                                                     progress))
            engine.wait_idle()
            after = engine.stats()
            extra = {
                "note": note,
                "threads": threads,
                "engine_threads": engine.info.get("num_threads"),
                "load_s": load_s,
                "step_time_s": step_delta(before, after),
                "decode_totals": step_delta(before, after, "decode_totals"),
                "forward_steps": after["forward_steps_total"] - before["forward_steps_total"],
                "engine_hit_rate": ((after["cached_tokens_total"] - before["cached_tokens_total"])
                                    / max(1, after["prompt_tokens_total"]
                                          - before["prompt_tokens_total"])),
                "retractions": after["retractions_total"] - before["retractions_total"],
                "evicted_tokens": after["evicted_tokens_total"] - before["evicted_tokens_total"],
            }
            if out:
                write_result(out, w.name, system, records, **extra)
            results.append({"workload": w.name, "system": system, "records": records, **extra})
    return results


# -- one batch ----------------------------------------------------------------------------------------
def model_flops_per_token(cfg: Any, context: float) -> float:
    """Forward FLOPs per token (2 per multiply-add): every linear layer except the LM head (a
    prefill computes logits for one row per request), plus attention over `context` keys
    (QK^T and PV)."""
    from bench.roofline import attention_flops, matmul_flops_per_token

    return matmul_flops_per_token(cfg, with_lm_head=False) + attention_flops(cfg, 1) * context


def weight_bytes_per_step(model: Any, rows: int) -> int:
    """Matmul weight bytes one forward step with `rows` rows per matmul reads (the
    representation each `LinearWeight` runs at that row count)."""
    return sum(w.bytes_read(rows) for w in model.linear_weights())


def one_batch(batch_sizes: Sequence[int], input_len: int, output_len: int, threads: int,
              runs: int = 3, model_path: str | None = None, dtype: str = "auto",
              with_ceiling: bool = False, prefill_max_tokens: int = 8192,
              compile_decode: bool = False, quantization: str = "auto",
              quant_max_rows: int | None = None, quant_kernel: str = "auto",
              huge_pages: bool = True, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Per batch size: one prefill of `batch x input_len` tokens (timed when it is at most
    `prefill_max_tokens` tokens; larger batches get random K/V written straight into the pool,
    which costs a decode step the same), then `output_len` decode steps, each timed from
    building its `ForwardBatch` to the sampled ids on the host. With `with_ceiling`, the
    machine's ceilings (read bandwidth, matmul peak in the model's dtype), measured again right
    before each batch size's runs, and each row's roofline against its own ceilings, each never
    below the first reading (`roofline.best_ceilings`) (bench/roofline.py); a quantized model's decode weight bytes are what its `LinearWeight`s
    read at that row count. Each row also records where the first two threads ran before and
    after its runs (`roofline.thread_placement`)."""
    import torch

    from bench import roofline
    from radixrt.config import ServerArgs
    from radixrt.core.forward_batch import ForwardBatch, ForwardMode
    from radixrt.model.runner import ModelRunner
    from radixrt.sampling.sampler import row_argmax

    torch.set_num_threads(threads)
    max_bs = max(batch_sizes)
    ctx = input_len + output_len + 8
    args = ServerArgs(model_path=model_path, num_threads=threads, max_running_requests=max_bs,
                      max_total_tokens=max_bs * ctx + 64, max_context_len=ctx,
                      attention_backend="torch", log_level="warning", dtype=dtype,
                      compile_decode=compile_decode, quantization=quantization,
                      quant_max_rows=quant_max_rows, quant_kernel=quant_kernel,
                      disable_huge_pages=not huge_pages, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(args)
    cfg = runner.model_config
    rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool
    # bytes per K/V element as stored (an int8 pool's scales included)
    kv_elem = kp.bytes_per_token() / (2 * cfg.num_layers * cfg.kv_size)
    w_bytes = roofline.weight_bytes(runner.model)
    # Everything but the matmul weights, to which each step adds what the (possibly quantized)
    # weights read at its row count. (w_bytes minus the matmul weights' own sizes went wrong
    # where a tied embedding shares the LM head's dense copy: that copy was taken off twice.)
    other_bytes = roofline.weight_bytes(runner.model, skip_linear=True)
    first_ceil = roofline.measure_ceilings(threads, runner.dtype) if with_ceiling else None
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for i, bs in enumerate(batch_sizes):
        ceil = first_ceil
        if with_ceiling and i > 0:  # the machine's state may have changed since (see README)
            ceil = roofline.best_ceilings(first_ceil, roofline.measure_ceilings(threads,
                                                                               runner.dtype))
        placement = [roofline.thread_placement()]
        timed_prefill = bs * input_len <= prefill_max_tokens
        prefill_s: list[float] = []
        decode_s: list[float] = []
        for run in range(runs + 1):  # run 0 warms up
            rp.clear()
            kp.clear()
            rows = [rp.alloc() for _ in range(bs)]
            ids = torch.randint(100, cfg.vocab_size, (bs * input_len,), generator=g).tolist()
            t = time.perf_counter()
            slots = kp.alloc(bs * input_len)
            rp.write(rows, [0] * bs, [input_len] * bs, slots)
            if timed_prefill:
                fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * bs,
                                        [input_len] * bs, rp.req_to_token, runner.device)
                logits, picked = runner.forward_greedy(fb)  # as the scheduler's greedy steps
                nxt = (picked if picked is not None else row_argmax(logits)).tolist()
                prefill_s.append(time.perf_counter() - t)
            else:
                for layer in range(cfg.num_layers):
                    shape = (slots.numel(), *kp.k_buffer[layer].shape[1:])
                    kp.set_kv(layer, slots, torch.randn(shape, generator=g),
                              torch.randn(shape, generator=g))
                nxt = ids[:bs]
            steps = []
            seq = input_len
            for _ in range(output_len):
                t = time.perf_counter()
                rp.write(rows, [seq] * bs, [1] * bs, kp.alloc(bs))
                fb = ForwardBatch.build(ForwardMode.DECODE, nxt, rows, [seq] * bs, [1] * bs,
                                        rp.req_to_token, runner.device)
                logits, picked = runner.forward_greedy(fb)  # as the scheduler's greedy steps
                nxt = (picked if picked is not None else row_argmax(logits)).tolist()
                steps.append(time.perf_counter() - t)
                seq += 1
            if run:
                decode_s.extend(steps)
            elif prefill_s:
                prefill_s.pop()  # the warm-up run's prefill
        placement.append(roofline.thread_placement())
        p = statistics.median(prefill_s) if prefill_s else float("nan")
        d = statistics.median(decode_s) if decode_s else float("nan")
        row: dict[str, Any] = {
            "batch_size": bs, "input_len": input_len, "output_len": output_len,
            "prefill_ms": p * 1e3, "prefill_tok_per_s": bs * input_len / p,
            "decode_ms_per_step": d * 1e3, "decode_tok_per_s": bs / d,
            "decode_weight_mb_per_step": weight_bytes_per_step(runner.model, bs) / 1e6,
            "thread_placement": placement,
        }
        if ceil is not None:
            row["ceilings"] = ceil.as_dict()
            # the median step attends over about input_len + output_len / 2 keys
            mid = input_len + (output_len + 1) // 2
            step_w = other_bytes + weight_bytes_per_step(runner.model, bs)
            dec = roofline.decode_cost(cfg, [mid] * bs, step_w, kv_elem)
            row["decode_roofline"] = roofline.roofline_fields(dec, ceil, d)
            if prefill_s:
                pre_w = other_bytes + weight_bytes_per_step(runner.model, bs * input_len)
                pre = roofline.prefill_cost(cfg, bs, input_len, pre_w, kv_elem)
                row["prefill_roofline"] = roofline.roofline_fields(pre, ceil, p, memory=False)
        rows_out.append(row)
    res: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": runner.describe_quantization(),
        "quant_probe": runner.quant_probe.as_info() if runner.quant_probe else None,
        "compile_decode": compile_decode,
        "kv_cache_dtype": str(kp.kv_dtype).removeprefix("torch."),
        "weight_bytes": w_bytes,
        "kv_bytes_per_token": roofline.kv_bytes(cfg, 1, kv_elem),
        "flops_per_token_prefill": model_flops_per_token(cfg, input_len / 2),
        "params_no_embedding": sum(p.numel() for n, p in runner.model.named_parameters()
                                   if "embed" not in n and "lm_head" not in n),
        "rows": rows_out,
    }
    if first_ceil is not None:  # the first measurement (each row has its own)
        res["ceilings"] = first_ceil.as_dict()
        res["mem_gbps"] = first_ceil.mem_gbps
        res["matmul_gflops"] = first_ceil.matmul_gflops
        res["matmul_n"] = first_ceil.matmul_n
        res["ideal_prefill_tok_per_s"] = (first_ceil.matmul_gflops * 1e9
                                          / res["flops_per_token_prefill"])
        fr = [r["prefill_roofline"]["fraction"] for r in rows_out if "prefill_roofline" in r]
        if fr:
            res["prefill_fraction_of_ideal"] = max(fr)
    return res


def print_one_batch(res: dict[str, Any]) -> None:
    """One line per batch size: prefill and decode timings, and the roofline when measured."""
    c = res.get("ceilings")
    if c:
        print(f"ceilings at {c['threads']} threads: read {c['mem_gbps']:.1f} GB/s, "
              f"{c['dtype']} matmul {c['matmul_n']}^3 {c['matmul_gflops']:.1f} GFLOP/s; weights "
              f"{res['weight_bytes'] / 2**20:.1f} MiB, K/V {res['kv_bytes_per_token'] / 1024:.1f}"
              f" KiB/token")
    for r in res["rows"]:
        line = (f"batch {r['batch_size']:3d} input {r['input_len']}: prefill "
                f"{r['prefill_tok_per_s']:7.0f} tok/s")
        pr = r.get("prefill_roofline")
        if pr:
            line += f" ({pr['fraction']:.0%} of the matmul ceiling)"
        line += f"  decode {r['decode_ms_per_step']:7.1f} ms/step"
        dr = r.get("decode_roofline")
        if dr:
            line += (f" (bound {dr['bound_ms']:.1f} ms, {dr['bound_by']}: "
                     f"{dr['bytes'] / 2**20:.0f} MiB, {dr['flops'] / 1e9:.2f} GFLOP; "
                     f"{dr['fraction']:.0%} of the roofline)")
        rc = r.get("ceilings")
        if rc:
            line += f"  [read {rc['mem_gbps']:.1f} GB/s, {rc['matmul_gflops']:.0f} GFLOP/s]"
        where = [p["placement"] for p in r.get("thread_placement", [])]
        if where and "unknown" not in where:
            line += f"  [threads on {' -> '.join(dict.fromkeys(where))}]"
        print(line, file=sys.stderr)


# -- CLI ----------------------------------------------------------------------------------------------
def _print_metrics(name: str, system: str, m: dict[str, Any], steps: dict[str, float]) -> None:
    if not m.get("completed"):
        print(f"{name}: no request completed")
        return
    hr = m["hit_rate"]
    print(f"{name:11s} {system:17s} {m['completed']:3d} req {m['duration_s']:7.2f} s  "
          f"total {m['total_tok_per_s']:8.1f} tok/s  out {m['output_tok_per_s']:6.1f} tok/s  "
          f"TTFT p50 {m['ttft_s']['p50']:.3f} s p99 {m['ttft_s']['p99']:.3f} s  "
          f"ITL p50 {m['itl_s']['p50'] * 1e3:.1f} ms  hit {hr if hr is None else round(hr, 3)}")
    if steps:
        total = sum(steps.values()) or 1.0
        print("    step time: " + "  ".join(f"{k} {v:.2f} s ({v / total:.0%})"
                                            for k, v in steps.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tp = sub.add_parser("throughput", help="Engine on generated workloads")
    tp.add_argument("--preset", default="tiny")
    tp.add_argument("--workloads", nargs="*", default=None)
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--request-rate", type=float, default=None)
    tp.add_argument("--system", default="radixrt", choices=tuple(RADIXRT_SYSTEMS))
    tp.add_argument("--threads", type=int, default=2)
    tp.add_argument("--max-concurrency", type=int, default=None)
    tp.add_argument("--out", default=None, help="append JSON lines (records + metrics) here")
    rw = sub.add_parser("run-workload", help="(compare.py) a workload file through the Engine")
    rw.add_argument("--system", required=True, choices=tuple(RADIXRT_SYSTEMS))
    rw.add_argument("--workload-file", required=True)
    rw.add_argument("--out", required=True)
    rw.add_argument("--threads", type=int, default=2)
    rw.add_argument("--budget-s", type=float, default=None)
    rw.add_argument("--model", default=None)
    rw.add_argument("--progress", action="store_true")
    ob = sub.add_parser("one-batch", help="ModelRunner prefill/decode timings")
    ob.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    ob.add_argument("--input-len", type=int, default=512)
    ob.add_argument("--output-len", type=int, default=16)
    ob.add_argument("--runs", type=int, default=3)
    ob.add_argument("--threads", type=int, default=2)
    ob.add_argument("--model", default=None)
    ob.add_argument("--dtype", default="auto", help="the runner's dtype (ServerArgs.dtype)")
    ob.add_argument("--quantization", default="auto", help="ServerArgs.quantization")
    ob.add_argument("--quant-max-rows", type=int, default=None,
                    help="ServerArgs.quant_max_rows")
    ob.add_argument("--quant-kernel", default="auto", help="ServerArgs.quant_kernel")
    ob.add_argument("--kv-cache-dtype", default="auto", help="ServerArgs.kv_cache_dtype")
    ob.add_argument("--thread-wait", default="brief", choices=("brief", "passive", "spin"),
                    help="ServerArgs.thread_wait: how this process's OpenMP threads wait (an "
                         "OMP_WAIT_POLICY / GOMP_SPINCOUNT already in the environment wins)")
    ob.add_argument("--disable-huge-pages", action="store_true",
                    help="ServerArgs.disable_huge_pages")
    ob.add_argument("--compile-decode", action="store_true",
                    help="ServerArgs.compile_decode (torch.compile the decode step)")
    ob.add_argument("--prefill-max-tokens", type=int, default=8192,
                    help="time the prefill of batches up to this many tokens; larger ones get "
                         "random K/V for their decode steps")
    ob.add_argument("--with-ceiling", action="store_true",
                    help="also measure the machine's ceilings (read bandwidth, matmul peak in "
                         "the model's dtype) and each step's roofline")
    ob.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args()

    if a.cmd == "one-batch":
        from radixrt.core.cpu_policy import omp_env

        for k, v in omp_env(a.threads, a.thread_wait).items():  # before torch loads OpenMP
            if v is not None:
                os.environ.setdefault(k, v)
        res = one_batch(a.batch_size, a.input_len, a.output_len, a.threads, a.runs, a.model,
                        a.dtype, a.with_ceiling, a.prefill_max_tokens, a.compile_decode,
                        a.quantization, a.quant_max_rows, a.quant_kernel,
                        huge_pages=not a.disable_huge_pages,
                        kv_cache_dtype=a.kv_cache_dtype)
        print_one_batch(res)
        text = json.dumps(res, indent=1)
        print(text)
        if a.out:
            Path(a.out).write_text(text)
        return
    if a.cmd == "run-workload":
        ws = iter_workloads(a.workload_file)
        run_engine_workloads(a.system, ws, a.threads, a.out, a.budget_s, None, a.progress,
                             a.model)
        return
    from bench.datasets import make_preset

    ws = make_preset(a.preset, a.seed, a.workloads, request_rate=a.request_rate)
    for res in run_engine_workloads(a.system, ws, a.threads, None, None, a.max_concurrency,
                                    True):
        m = compute_metrics(res["records"])
        _print_metrics(res["workload"], a.system, m, res["step_time_s"])
        if a.out:
            write_result(a.out, res["workload"], a.system, res["records"],
                         metrics=m, step_time_s=res["step_time_s"])


if __name__ == "__main__":
    main()
