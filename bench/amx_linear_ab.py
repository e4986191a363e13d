"""The AMX linear (`torch.ops.radixrt.amx_linear`, AMX-BF16 CPUs) of this checkout against the
same file at another git revision, interleaved in one process (the old `amx_linear.cpp` built
under the op namespace `radixrt_baseline`, same flags), and the fused `amx_linear_silu` against
`amx_linear` then `silu_mul`.

    python bench/amx_linear_ab.py --rev HEAD --rows 64 512 1024

Each of SmolLM2's four layer matmuls (qkv [960, 576], o [576, 576], gate_up [3072, 576], down
[576, 1536]) over random bf16 weights in turn, the same activations: 30 of them, or as many as
make 1 GiB (bench/attention_kernel.py FROM_MEMORY_BYTES: 30 of one shape, 20-106 MB, stay in a
large LLC, as on the AMX Xeon of stop 70), so that they come from memory, as in a step; gate_up also as the MLP's first half (`+silu`): the old build's linear then
`silu_mul`, and this checkout's fused op. Prints medians per call (µs) and old / new ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from radixrt.attention import cpu_kernels  # noqa: E402
from radixrt.model import prepack  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def _loop(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
          weights: list[torch.Tensor]) -> Callable[[], None]:
    """Every weight in turn, each output dropped before the next call (as a model's are: kept,
    30 outputs of fresh pages would be timed)."""

    def run() -> None:
        for w in weights:
            fn(x, w)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="git revision of amx_linear.cpp to compare")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (cpu_kernels.load_cpu_kernels() and prepack.amx_available()):
        sys.exit("amx_linear_ab: this CPU or build has no usable AMX-BF16 linear")
    from bench.attention_kernel import FROM_MEMORY_BYTES, interleaved, load_baseline

    load_baseline(args.rev, "amx_linear.cpp")
    torch.set_num_threads(args.threads)
    new, old = torch.ops.radixrt.amx_linear, torch.ops.radixrt_baseline.amx_linear
    silu = torch.ops.radixrt.silu_mul
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        line = [f"rows {rows:5d}"]
        for name, (n, k) in SHAPES.items():
            copies = max(LAYERS, -(-FROM_MEMORY_BYTES // (n * k * 2)))
            weights = [prepack.amx_pack((torch.randn(n, k, generator=g) * 0.05).bfloat16())
                       for _ in range(copies)]
            x = torch.randn(rows, k, generator=g).bfloat16()
            if not torch.equal(new(x, weights[0], None), old(x, weights[0], None)):
                sys.exit(f"amx_linear_ab: {name} at {rows} rows differs from {args.rev}")
            fns = {"old": _loop(lambda a, w: old(a, w, None), x, weights),
                   "new": _loop(lambda a, w: new(a, w, None), x, weights)}
            if name == "gate_up":
                fns["old+silu"] = _loop(lambda a, w: silu(old(a, w, None)), x, weights)
                fns["fused"] = _loop(lambda a, w: torch.ops.radixrt.amx_linear_silu(a, w, None),
                                     x, weights)
            med = interleaved(fns, args.reps)
            us = {f: med[f] / copies * 1e6 for f in fns}
            line.append(f"{name} {us['old']:.0f}->{us['new']:.0f} ({us['old'] / us['new']:.2f}x)")
            if name == "gate_up":
                line.append(f"gate_up+silu {us['old+silu']:.0f}->{us['fused']:.0f} "
                            f"({us['old+silu'] / us['fused']:.2f}x)")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
