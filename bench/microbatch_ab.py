"""Decode steps in one pass against two micro-batches (`decode_microbatch_rows`), alternating
step by step in one process on one `ModelRunner` (default SmolLM2).

    python bench/microbatch_ab.py --batch-sizes 8 10 12 14 16 [--kv-cache-dtype int8]

Each round starts `bs` requests over `--ctx` random cached tokens (bench/decode_steps.py) and
alternates the two paths every step (in ABBA order), so both see the same context lengths; the
two give bitwise the same logits (tests/test_decode_layers.py). Prints the medians per batch
size and the median of one-pass / split ratios of adjacent steps (> 1: the split is faster),
which cancels slow drifts of the machine. Used to choose `decode_microbatch_rows`' default.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

NEVER = 1 << 30  # decode_microbatch_rows no batch reaches: one pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 10, 12, 14, 16])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16, help="steps per path per round")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as the server's (auto, int8)")
    a = ap.parse_args()
    torch.set_num_threads(2)  # micro-batches need exactly 2 threads
    from bench.decode_steps import RandomKVDecoder
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    bs_max, ctx_max = max(a.batch_sizes), a.ctx + 2 * a.steps + 8
    runner = ModelRunner(ServerArgs(max_running_requests=bs_max,
                                    max_total_tokens=bs_max * ctx_max + 64,
                                    max_context_len=ctx_max, log_level="warning", num_threads=2,
                                    kv_cache_dtype=a.kv_cache_dtype))
    model = runner.model
    print(f"decode path: {model.decode_path()}; KV {a.kv_cache_dtype}; ctx {a.ctx}", flush=True)
    for bs in a.batch_sizes:
        times: dict[str, list[float]] = {"one": [], "split": []}
        pairs: list[float] = []
        for _ in range(a.rounds):
            d = RandomKVDecoder(runner, bs, a.ctx)
            for path in times:  # warm-up
                model.decode_microbatch_rows = NEVER if path == "one" else 2
                d.step()
            for i in range(a.steps):
                step = {}
                for path in (("one", "split") if i % 2 else ("split", "one")):
                    model.decode_microbatch_rows = NEVER if path == "one" else 2
                    step[path] = d.step()
                    times[path].append(step[path])
                pairs.append(step["one"] / step["split"])
        one, split = (statistics.median(times[p]) * 1e3 for p in ("one", "split"))
        print(f"batch {bs:3d}: one pass {one:6.2f} ms  split {split:6.2f} ms  "
              f"one/split paired {statistics.median(pairs):.3f}x", flush=True)


if __name__ == "__main__":
    main()
