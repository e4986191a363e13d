"""Decode steps with the model and KV pool on huge pages (the default) against the allocator's
default pages (`disable_huge_pages`): two `ModelRunner`s (default SmolLM2) in one process, their
bare decode steps over `input-len` random cached tokens per request alternating in blocks.

    python bench/huge_pages.py --batch-size 1 8 64 --input-len 512 --rounds 6

Reported: median step ms of each and small/huge (> 1: huge pages faster), plus the MiB of this
process on huge pages. Speed is never asserted in tests; this script is where it is measured.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per block (2 untimed first)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()

    import torch

    from bench.decode_steps import RandomKVDecoder
    from radixrt.config import ServerArgs
    from radixrt.mem.huge_pages import huge_page_info
    from radixrt.model.runner import ModelRunner

    torch.set_num_threads(a.threads)
    ctx, max_bs = a.input_len, max(a.batch_size)

    def runner(disable: bool) -> ModelRunner:
        return ModelRunner(ServerArgs(
            model_path=a.model, max_running_requests=max_bs, num_threads=a.threads,
            max_total_tokens=max_bs * (ctx + 16) + 64, max_context_len=ctx + 16,
            log_level="warning", disable_huge_pages=disable))

    runners = {"huge": runner(False), "small": runner(True)}
    print(f"huge pages: {huge_page_info()}", flush=True)
    rows = []
    for bs in a.batch_size:
        decs = {k: RandomKVDecoder(r, bs, ctx) for k, r in runners.items()}
        times: dict[str, list[float]] = {k: [] for k in decs}
        for _ in range(a.rounds):
            for k, d in decs.items():
                for _ in range(2):
                    d.step()
                times[k] += [d.step() for _ in range(a.steps)]
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"batch_size": bs, "input_len": ctx, "huge_ms": med["huge"],
               "small_ms": med["small"], "small_over_huge": med["small"] / med["huge"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| batch | huge pages ms | small pages ms | small / huge |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['huge_ms']:.2f} | {r['small_ms']:.2f} | "
              f"{r['small_over_huge']:.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "huge_pages": huge_page_info()},
                                          indent=1))


if __name__ == "__main__":
    main()
