"""Decode steps and one prefill, radixrt's qgemv (+ dense bf16 copy above 16 rows, today's
default) vs the vnni kernel for every call (no dense copy), on SmolLM2 GGUF, interleaved step by
step in one process (two ModelRunners), medians and ratios.

    python bench/vnni_steps.py --batch-sizes 1 8 64 --ctx 512 --steps 8 --prefill 512 [--profile]

Decode: `bs` requests over `ctx` random cached tokens (bench/decode_steps.py). Prefill: one
request of `--prefill` new tokens (empty cache). `--profile` adds torch.profiler's top ops
(self CPU time) per configuration for the decode steps.
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

from bench.decode_steps import RandomKVDecoder  # noqa: E402

CONFIGS = {
    "radixrt+dense": {"quant_kernel": "radixrt", "quant_max_rows": 16},
    "vnni": {"quant_kernel": "vnni", "disable_quant_dense_copy": True},
}


def _runner(extra: dict[str, object], max_bs: int, ctx: int, prefill: int) -> object:
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    return ModelRunner(ServerArgs(
        quantization="gguf", dtype="bfloat16", max_running_requests=max_bs,
        max_total_tokens=max_bs * (ctx + 80) + prefill + 64,
        max_context_len=max(ctx + 80, prefill + 8), log_level="warning",
        num_threads=torch.get_num_threads(), **extra))  # type: ignore[arg-type]


def _prefill_step(runner: object, n: int) -> float:
    from radixrt.core.forward_batch import ForwardBatch, ForwardMode

    rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool  # type: ignore[attr-defined]
    rp.clear()
    kp.clear()
    row = rp.alloc()
    rp.write([row], [0], [n], kp.alloc(n))
    fb = ForwardBatch.build(ForwardMode.EXTEND, [(7 * i) % 40000 + 10 for i in range(n)], [row],
                            [0], [n], rp.req_to_token, runner.device)  # type: ignore[attr-defined]
    t = time.perf_counter()
    runner.forward(fb)  # type: ignore[attr-defined]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=512, help="0: no prefill timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write this JSON file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    runners = {name: _runner(extra, max(a.batch_sizes), a.ctx, a.prefill)
               for name, extra in CONFIGS.items()}
    for name, r in runners.items():
        print(name, r.quant.describe(), flush=True)  # type: ignore[attr-defined]
    out: dict[str, object] = {"threads": a.threads, "ctx": a.ctx, "configs": CONFIGS}
    with torch.inference_mode():
        for bs in a.batch_sizes:
            decs = {n: RandomKVDecoder(r, bs, a.ctx) for n, r in runners.items()}
            for d in decs.values():
                for _ in range(2):
                    d.step()
            ts: dict[str, list[float]] = {n: [] for n in decs}
            for _ in range(a.steps):
                for n, d in decs.items():
                    ts[n].append(d.step() * 1e3)
            med = {n: statistics.median(v) for n, v in ts.items()}
            out[f"decode_bs{bs}"] = {"ms_median": med, "ms_all": ts}
            ratio = med["radixrt+dense"] / med["vnni"]
            print(f"decode bs={bs} ctx={a.ctx}: " + "  ".join(f"{n} {m:.1f} ms" for n, m in
                  med.items()) + f"  (radixrt+dense / vnni = {ratio:.2f}x)", flush=True)
            if a.profile:
                from torch.profiler import ProfilerActivity, profile

                for n, d in decs.items():
                    with profile(activities=[ProfilerActivity.CPU]) as p:
                        for _ in range(3):
                            d.step()
                    print(n, p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        if a.prefill:
            ts = {n: [] for n in runners}
            for r in runners.values():
                _prefill_step(r, a.prefill)
            for _ in range(3):
                for n, r in runners.items():
                    ts[n].append(_prefill_step(r, a.prefill) * 1e3)
            med = {n: statistics.median(v) for n, v in ts.items()}
            out[f"prefill_{a.prefill}"] = {"ms_median": med, "ms_all": ts}
            print(f"prefill {a.prefill} tokens: " + "  ".join(f"{n} {m:.0f} ms" for n, m in
                  med.items()) + f"  (ratio {med['radixrt+dense'] / med['vnni']:.2f}x)", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
