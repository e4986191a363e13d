"""Quantized matmuls: torch's int4 kernel vs radixrt's qgemv vs radixrt's int8-activation vnni
kernel (AVX512-VNNI CPUs) vs dense bf16, per layer shape of SmolLM2-135M and for all of one
decode step's matmuls, interleaved in one process.

    python bench/qgemv_speed.py --rows 1 2 4 8 16 32 64 --reps 7 --out bench/results/DATE-qgemv
    python bench/qgemv_speed.py --rows 1 8 64 512 --kernels radixrt vnni dense_bf16 \
        --out bench/results/DATE-qgemm-vnni

Each "pass" runs every matmul of one decode step of the model shape (30 layers of
qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536] as 4-bit (Q4_1) and the
tied LM head [49152, 576] as 8-bit (Q8_0)), each layer with its own weights, so the weights
come from memory as in a real step (~83 MB quantized, 270 MB dense bf16), not from cache.
The kernels alternate pass by pass; the report gives per rows and kernel the median ms
of a pass (and per weight kind) plus the GB/s of weight bytes read and GFLOP/s (2 * rows * params
per pass). Weights are random (only
timing matters here; accuracy: tests/test_quant.py, bench/accuracy.py).
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
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixrt.attention.cpu_kernels import load_cpu_kernels  # noqa: E402
from radixrt.model.quant import quantize_int4, quantize_int8  # noqa: E402
from radixrt.model.quant_matmul import (  # noqa: E402
    QuantMatmul,
    TiledQuantMatmul,
    TorchInt4Matmul,
    VnniQuantMatmul,
    vnni_kernel_available,
)

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
KERNELS = ("torch_int4", "radixrt", "vnni", "dense_bf16")


def _weights(layers: int, kernels: tuple[str, ...]) -> list[tuple[str, dict[str, object]]]:
    """[(kind, {kernel: callable weight})] for one decode step (random values)."""
    g = torch.Generator().manual_seed(0)
    out: list[tuple[str, dict[str, object]]] = []
    plan = [(kind, shape, 4) for _ in range(layers) for kind, shape in SHAPES.items()]
    plan.append(("lm_head", HEAD, 8))
    for kind, (n, k), bits in plan:
        w = torch.randn(n, k, generator=g) * 0.02
        groups = quantize_int4(w) if bits == 4 else quantize_int8(w)
        make = {"torch_int4": TorchInt4Matmul.from_groups,
                "radixrt": TiledQuantMatmul.from_groups, "vnni": VnniQuantMatmul.from_groups,
                "dense_bf16": lambda gr: gr.dequantize(None).to(torch.bfloat16)}
        out.append((kind, {k: make[k](groups) for k in kernels}))
    return out


def _call(w: object, x: torch.Tensor) -> torch.Tensor:
    if isinstance(w, QuantMatmul):
        return w(x)
    return torch.nn.functional.linear(x, w)  # type: ignore[arg-type]


def _nbytes(w: object) -> int:
    return w.nbytes() if isinstance(w, QuantMatmul) else w.numel() * w.element_size()  # type: ignore[union-attr]


def run(rows_list: list[int], reps: int, layers: int,
        kernels: tuple[str, ...] = KERNELS) -> dict[str, object]:
    weights = _weights(layers, kernels)
    kinds = sorted({k for k, _ in weights})
    first = [ws[kernels[0]] for _, ws in weights]
    params = sum(w.in_features * w.out_features if isinstance(w, QuantMatmul)
                 else w.numel() for w in first)  # type: ignore[union-attr]
    xs = {(r, k): torch.randn(r, k).to(torch.bfloat16) for r in rows_list for k in (576, 1536)}
    results: dict[str, object] = {}
    for rows in rows_list:
        times: dict[str, dict[str, list[float]]] = {kern: {kd: [] for kd in kinds}
                                                    for kern in kernels}
        totals: dict[str, list[float]] = {kern: [] for kern in kernels}
        for rep in range(reps + 1):  # first round: warm-up
            for kern in kernels:
                per = dict.fromkeys(kinds, 0.0)
                t_all = time.perf_counter()
                for kind, ws in weights:
                    w = ws[kern]
                    x = xs[(rows, 1536 if kind == "down" else 576)]
                    t0 = time.perf_counter()
                    _call(w, x)
                    per[kind] += time.perf_counter() - t0
                t_all = time.perf_counter() - t_all
                if rep:
                    totals[kern].append(t_all * 1e3)
                    for kd in kinds:
                        times[kern][kd].append(per[kd] * 1e3)
        row: dict[str, object] = {}
        for kern in kernels:
            nbytes = sum(_nbytes(ws[kern]) for _, ws in weights)
            med = statistics.median(totals[kern])
            row[kern] = {"step_ms_median": med, "step_ms_all": totals[kern],
                         "weight_mb": nbytes / 1e6, "gb_per_s": nbytes / med / 1e6,
                         "gflop_per_s": 2 * rows * params / med / 1e6,
                         "per_kind_ms_median": {kd: statistics.median(times[kern][kd])
                                                for kd in kinds}}
        med = {k: row[k]["step_ms_median"] for k in kernels}  # type: ignore[index]
        for a, b in (("torch_int4", "radixrt"), ("dense_bf16", "radixrt"), ("radixrt", "vnni"),
                     ("dense_bf16", "vnni")):
            if a in med and b in med:
                row[f"speedup_{b}_vs_{a}"] = med[a] / med[b]
        results[str(rows)] = row
        stats: dict[str, Any] = {k: row[k] for k in kernels}
        cells = "  ".join(f"{k} {med[k]:7.2f} ms ({stats[k]['gflop_per_s']:.0f} GFLOP/s, "
                          f"{stats[k]['gb_per_s']:.1f} GB/s)" for k in kernels)
        print(f"rows {rows:3d}: {cells}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=5, help="timed passes per kernel and rows")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=None,
                    help="kernels to time (default: all available here)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="directory for qgemv_speed.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not load_cpu_kernels():
        raise SystemExit("radixrt's CPU kernels are unavailable (python -m "
                         "radixrt.attention.cpu_kernels build shows why)")
    kernels = tuple(a.kernels or [k for k in KERNELS if k != "vnni" or vnni_kernel_available()])
    if "vnni" in kernels and not vnni_kernel_available():
        raise SystemExit("the vnni kernel is not built here (no AVX512-VNNI)")
    with torch.inference_mode():
        res = run(a.rows, a.reps, a.layers, kernels)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "qgemv_isa": torch.ops.radixrt.qgemv_isa(), "reps": a.reps, "layers": a.layers,
            "kernels": list(kernels)}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "qgemv_speed.json").write_text(json.dumps({"meta": meta, "rows": res},
                                                            indent=1))


if __name__ == "__main__":
    main()
