"""A decode row's own keys on AMX tiles (csrc/amx_decode.h) against the vdpbf16ps scan, in one
process, switched by `torch.ops.radixrt.paged_decode_amx_rows`.

    python bench/amx_rows_ab.py steps --batch-sizes 1 8 32 64 --ctx 544 --steps 10 --rounds 6
    python bench/amx_rows_ab.py op --batch-sizes 8 64 --ctx 544 2048

`steps`: whole decode steps of the default model as the server runs them (`ModelRunner`, its
one-call decode path, bs requests over `--ctx` random cached tokens: bench/decode_steps.py),
each round timing `--steps` steps with the scan and as many on the tiles, in ABBA order across
rounds (the context grows by one token a step, so both see the same lengths). Prints each side's
per-round medians and scan / tiles of their medians.

`op`: the op alone on SmolLM2's attention shape (9 query heads, 3 KV heads, head dim 64, bf16
pool), 30 layers from memory (bench/attention_kernel.py FROM_MEMORY_BYTES) and one layer 30
times (`hot`: K/V from the caches where they fit), the two paths interleaved.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402


def _toggle() -> object:
    toggle = torch.ops.radixrt.paged_decode_amx_rows
    previous = toggle(True)
    if not toggle(previous):
        raise SystemExit("no AMX tiles in this process (CPU, build, hypervisor or kernel)")
    return toggle


def steps(a: argparse.Namespace) -> None:
    from bench.decode_steps import RandomKVDecoder, bare_runner

    runner = bare_runner(a, a.ctx + 2 * a.rounds * a.steps + 64)
    toggle = _toggle()
    print(f"dtype {runner.dtype}, KV {runner.token_to_kv_pool.kv_dtype}; {a.threads} threads; "
          f"ctx {a.ctx}; decode path: {runner.model.decode_path()}")
    for bs in a.batch_sizes:
        d = RandomKVDecoder(runner, bs, a.ctx).warmed()
        ms: dict[bool, list[float]] = {False: [], True: []}
        for rnd in range(a.rounds):
            for tiles in ((False, True) if rnd % 2 == 0 else (True, False)):
                toggle(tiles)
                ms[tiles].append(statistics.median(d.step() for _ in range(a.steps)) * 1e3)
        toggle(True)
        ratio = statistics.median(ms[False]) / statistics.median(ms[True])
        print(f"batch {bs:3d}: scan {' '.join(f'{x:.2f}' for x in ms[False])} ms; tiles "
              f"{' '.join(f'{x:.2f}' for x in ms[True])} ms; scan / tiles {ratio:.3f}x",
              flush=True)


def op(a: argparse.Namespace) -> None:
    from bench.attention_kernel import (
        FROM_MEMORY_BYTES,
        HEAD_DIM,
        LAYERS,
        _kv_bytes_per_layer,
        _op_case,
        interleaved,
    )

    toggle = _toggle()
    rows = []
    for bs in a.batch_sizes:
        for ctx in a.ctx_list:
            per_layer = _kv_bytes_per_layer("bfloat16", bs, ctx, 0)
            for hot in (False, True):
                layers = 1 if hot else min(LAYERS, max(2, math.ceil(FROM_MEMORY_BYTES
                                                                   / per_layer)))
                kv, plan, q = _op_case("bfloat16", bs, ctx, 0, layers)

                def run(tiles: bool, kv=kv, plan=plan, q=q, layers=layers) -> None:
                    toggle(tiles)
                    for i in range(LAYERS):
                        plan.run(q, kv.k_buffer[i % layers], kv.v_buffer[i % layers],
                                 HEAD_DIM**-0.5)

                med = interleaved({"scan": lambda: run(False), "tiles": lambda: run(True)},
                                  a.reps)
                toggle(True)
                rows.append((bs, ctx, "hot" if hot else f"{layers} layers", med["scan"] * 1e3,
                             med["tiles"] * 1e3, med["scan"] / med["tiles"],
                             per_layer * LAYERS / med["tiles"] / 1e9))
                del kv
    print("| batch | ctx | K/V | scan ms | tiles ms | scan / tiles | tiles GB/s |")
    print("|---|---|---|---|---|---|---|")
    for bs, ctx, where, s, t, r, gbs in rows:
        print(f"| {bs} | {ctx} | {where} | {s:.2f} | {t:.2f} | {r:.2f}x | {gbs:.1f} |")


def main() -> None:
    from bench.decode_steps import add_step_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("steps", "op"))
    add_step_args(ap, [1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ctx-list", type=int, nargs="+", default=None,
                    help="op: contexts (default: --ctx)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from radixrt.attention import cpu_kernels

    if not cpu_kernels.load_cpu_kernels():
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    a.ctx_list = a.ctx_list or [a.ctx]
    steps(a) if a.what == "steps" else op(a)


if __name__ == "__main__":
    main()
