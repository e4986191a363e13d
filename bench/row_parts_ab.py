"""Paged decode's row parts on and off, whole decode steps interleaved in one process.

    python bench/row_parts_ab.py --batch-sizes 1 2 --ctx 512 2048 4096 --rounds 12

The default model as the server builds it (`bench/decode_steps.py`: `bs` requests over `ctx`
random cached tokens, the decode step as served: one C++ call, a team of threads), its steps
alternating between the built-in row parts (`torch.ops.radixrt.paged_decode_row_parts`: a
batch with fewer than two (row, KV head) items per thread splits its long rows' own keys) and
parts off (max_parts 1), `--steps` steps per setting per round, the order flipping each round.
Prints each setting's median step and the speed of the built-in one against off (> 1: faster).
A batch that the built-in rule leaves whole is an A/A check of the host's noise.
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

import torch  # noqa: E402

from bench.decode_steps import RandomKVDecoder, add_step_args, bare_runner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap, [1, 2])
    ap.set_defaults(steps=10)
    ap.add_argument("--ctx-list", "--ctxs", dest="ctxs", type=int, nargs="+", default=None,
                    help="several contexts (overrides --ctx)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", help="append one JSON line per (batch, ctx) here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ctxs = a.ctxs or [a.ctx]
    runner = bare_runner(a, max(ctxs) + a.steps * (2 * a.rounds + 1) + 64)
    built_in = torch.ops.radixrt.paged_decode_row_parts()
    print(f"{a.threads} threads; row parts built in: min_keys {built_in[0]}, max_parts "
          f"{built_in[1]}, items_per_thread {built_in[2]}", flush=True)
    try:
        for ctx in ctxs:
            for bs in a.batch_sizes:
                d = RandomKVDecoder(runner, bs, ctx).warmed()
                times: dict[str, list[float]] = {"built-in": [], "off": []}
                for r in range(a.rounds):
                    order = ("built-in", "off") if r % 2 == 0 else ("off", "built-in")
                    for name in order:
                        torch.ops.radixrt.paged_decode_row_parts(-1, built_in[1] if
                                                                 name == "built-in" else 1)
                        d.step()  # the first step after a switch is not timed
                        times[name].append(statistics.median(d.step()
                                                             for _ in range(a.steps)))
                on, off = (statistics.median(times[k]) for k in ("built-in", "off"))
                print(f"batch {bs:3d} ctx {ctx:5d}: built-in {on * 1e3:.2f} ms, off "
                      f"{off * 1e3:.2f} ms, built-in {off / on:.3f}x", flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps({"batch": bs, "ctx": ctx, "built_in_ms": on * 1e3,
                                            "off_ms": off * 1e3, "speedup": off / on,
                                            "threads": a.threads}) + "\n")
    finally:
        torch.ops.radixrt.paged_decode_row_parts(*built_in)


if __name__ == "__main__":
    main()
