"""The vnni kernel (`torch.ops.radixrt.qgemm_vnni`) of this checkout against the same file at
another git revision, interleaved in one process: the old `qgemm_vnni.cpp` is built on its own
under another op namespace (`bench/attention_kernel.py` `load_baseline`, same compiler flags).

    python bench/vnni_ab.py --rev ae7d27c~1 --rows 1 8 64 --mode pass
    python bench/vnni_ab.py --rev ae7d27c~1 --rows 8 64 --mode shapes
    python bench/vnni_ab.py --rev da3ea05 --rows 1 8 64 --mode pass --silu

`pass`: every matmul of one SmolLM2 decode step, each layer its own random weights (30 x qkv
[960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536] 4-bit with offsets, as GGUF
Q4_1; the LM head [49152, 576] 8-bit, as Q8_0: symmetric where the kernel takes that layout),
~98 MB read from memory per pass as in a real step; `--silu`: each down projection takes the
gate_up output [M, 3072] as the one-call decode step does: the old build through
`silu_mul` then its op, the new one through `qgemm_vnni_silu` where it has it (SiLU-mul fused into
the activation quantization). `shapes`: each shape alone, its weights hot in cache. The machine is shared: a rep is kept only if this process had both cores (its CPU
time >= 1.85 x wall at 2 threads), and each row count starts once the CPUs have been idle for
3 s. Prints medians and old / new ratios.
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
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402

from radixrt.attention import cpu_kernels  # noqa: E402

SHAPES = {"qkv": (960, 576, 4, 30), "o": (576, 576, 4, 30), "gate_up": (3072, 576, 4, 30),
          "down": (576, 1536, 4, 30), "lm_head": (49152, 576, 8, 1)}
Op = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def build_rev(rev: str) -> Op:
    """qgemm_vnni.cpp at `rev`, built by attention_kernel's `load_baseline` (same flags, op
    namespace radixrt_baseline)."""
    from bench.attention_kernel import load_baseline

    load_baseline(rev, "qgemm_vnni.cpp")
    return torch.ops.radixrt_baseline.qgemm_vnni


def random_packed(n: int, k: int, bits: int, symmetric: bool, seed: int) -> torch.Tensor:
    """A vnni layout of random codes and fp16 scales (with offsets unless `symmetric`)."""
    g = torch.Generator().manual_seed(seed)
    cb, per = 64 * bits, (1 if symmetric else 2)
    packed = torch.randint(0, 256, (n // 16, k // 32, cb + 32 * per), dtype=torch.uint8,
                           generator=g)
    sc = (torch.rand(n // 16, k // 32, 16 * per, generator=g) * 0.02 + 0.001).half()
    packed[..., cb:] = sc.view(torch.uint8)
    return packed


def takes_symmetric(op: Op) -> bool:
    try:
        op(torch.zeros(1, 32), random_packed(16, 32, 8, True, 0), 8)
        return True
    except RuntimeError:
        return False


def wait_idle(seconds: int = 3) -> None:
    """Until the CPUs have been >= 90% idle for `seconds` consecutive seconds."""
    def sample() -> tuple[int, int]:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(v) - v[3] - v[4], v[3] + v[4]

    quiet = 0
    while quiet < seconds:
        b0, i0 = sample()
        time.sleep(1)
        b1, i1 = sample()
        busy, idle = b1 - b0, i1 - i0
        quiet = quiet + 1 if busy * 10 <= busy + idle else 0


def timed(f: Callable[[], object], calls: int) -> tuple[float, float]:
    """(seconds per call, process CPU time / wall)."""
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        f()
    wall = time.perf_counter() - t0
    return wall / calls, (time.process_time() - c0) / wall


def interleave(fns: dict[str, Callable[[], object]], calls: int, reps: int,
               min_util: float) -> dict[str, float]:
    res: dict[str, list[float]] = {t: [] for t in fns}
    for f in fns.values():
        f()
    tries = 0
    while min(len(v) for v in res.values()) < reps and tries < 8 * reps:
        tries += 1
        for t, f in fns.items():
            dt, util = timed(f, calls)
            if util >= min_util:
                res[t].append(dt)
    return {t: statistics.median(v) if v else float("nan") for t, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="git revision of the old kernel")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--mode", choices=["pass", "shapes"], default="pass")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--silu", action="store_true",
                    help="pass mode: down projections on silu_mul(gate_up) (or the fused op)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    assert cpu_kernels.load_cpu_kernels(), cpu_kernels.unavailable_reason()
    ops: dict[str, Op] = {"old": build_rev(a.rev), "new": torch.ops.radixrt.qgemm_vnni}
    sym = {t: takes_symmetric(op) for t, op in ops.items()}
    min_util = 0.925 * a.threads
    vnni = "avx512_vnni" in cpu_kernels.cpu_flags()
    print(f"old = {a.rev}, new = working tree; symmetric LM head: {sym}; avx512_vnni: {vnni}; "
          f"{a.threads} threads", flush=True)
    if a.mode == "pass":
        layers = [(random_packed(n, k, bits, False, 7 * li + n), bits, k)
                  for li in range(30) for n, k, bits, _ in list(SHAPES.values())[:4]]
        head = {s: random_packed(49152, 576, 8, s, 5) for s in (False, True)}
        mb = sum(p.numel() for p, _, _ in layers) / 1e6
        print(f"weights per pass: {mb + head[True].numel() / 1e6:.1f} MB (symmetric head)")
        for m in a.rows:
            xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
            gu = torch.randn(m, 2 * 1536).bfloat16()

            def down(t: str, p: torch.Tensor, bits: int, gu: torch.Tensor = gu) -> None:
                if t == "new" and hasattr(torch.ops.radixrt, "qgemm_vnni_silu"):
                    torch.ops.radixrt.qgemm_vnni_silu(gu, p, bits)
                else:
                    ops[t](torch.ops.radixrt.silu_mul(gu), p, bits)

            def one(t: str, xs: dict[int, torch.Tensor] = xs) -> None:
                for p, bits, k in layers:
                    if a.silu and k == 1536:
                        down(t, p, bits)
                    else:
                        ops[t](xs[k], p, bits)
                ops[t](xs[576], head[sym[t]], 8)

            wait_idle()
            med = interleave({t: (lambda t=t: one(t)) for t in ops}, 1, a.reps, min_util)
            flops = 2 * m * sum(p.shape[0] * 16 * k for p, _, k in layers) + 2 * m * 49152 * 576
            print(f"rows {m:4d}: " + "  ".join(
                f"{t} {med[t] * 1e3:7.2f} ms ({flops / med[t] / 1e9:4.0f} GFLOP/s)" for t in ops)
                + f"  old/new {med['old'] / med['new']:.2f}x", flush=True)
    else:
        tot = {(t, m): 0.0 for t in ops for m in a.rows}
        for name, (n, k, bits, count) in SHAPES.items():
            w = {s: random_packed(n, k, bits, s, n) for s in (False, True)}
            for m in a.rows:
                x = torch.randn(m, k).bfloat16()
                calls = max(3, min(300, int(3e8 / (m * n * k))))
                wait_idle()
                fns = {t: (lambda t=t, x=x, p=w[sym[t] and bits == 8], b=bits: ops[t](x, p, b))
                       for t in ops}
                med = interleave(fns, calls, a.reps, min_util)
                print(f"{name:8s} rows {m:4d}: " + "  ".join(
                    f"{t} {med[t] * 1e6:8.1f} us ({2 * m * n * k / med[t] / 1e9:4.0f} GFLOP/s)"
                    for t in ops) + f"  old/new {med['old'] / med['new']:.2f}x", flush=True)
                for t in ops:
                    tot[(t, m)] += med[t] * count
        for m in a.rows:
            print(f"one step's matmuls (hot, sum of shapes) rows {m:4d}: " + "  ".join(
                f"{t} {tot[(t, m)] * 1e3:.2f} ms" for t in ops)
                + f"  old/new {tot[('old', m)] / tot[('new', m)]:.2f}x")


if __name__ == "__main__":
    main()
