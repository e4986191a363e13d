"""Quantized decode matmuls: torch's int4 kernel vs radixrt's qgemv vs dense bf16, per layer
shape of SmolLM2-135M and for all of one decode step's matmuls, interleaved in one process.

    python bench/qgemv_speed.py --rows 1 2 4 8 16 32 64 --reps 7 --out bench/results/DATE-qgemv

Each "pass" runs every matmul of one decode step of the model shape (30 layers of
qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536] as 4-bit (Q4_1) and the
tied LM head [49152, 576] as 8-bit (Q8_0)), each layer with its own weights, so the weights
come from memory as in a real step (~83 MB quantized, 270 MB dense bf16), not from cache.
The three kernels alternate pass by pass; the report gives per rows and kernel the median ms
of a pass (and per weight kind) plus the GB/s of weight bytes read. Weights are random (only
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

import torch  # noqa: E402

from radixrt.attention.cpu_kernels import load_cpu_kernels  # noqa: E402
from radixrt.model.quant import quantize_int4, quantize_int8  # noqa: E402
from radixrt.model.quant_matmul import (  # noqa: E402
    QuantMatmul,
    TiledQuantMatmul,
    TorchInt4Matmul,
)

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
KERNELS = ("torch_int4", "radixrt", "dense_bf16")


def _weights(layers: int) -> list[tuple[str, dict[str, object]]]:
    """[(kind, {kernel: callable weight})] for one decode step (random values)."""
    g = torch.Generator().manual_seed(0)
    out: list[tuple[str, dict[str, object]]] = []
    plan = [(kind, shape, 4) for _ in range(layers) for kind, shape in SHAPES.items()]
    plan.append(("lm_head", HEAD, 8))
    for kind, (n, k), bits in plan:
        w = torch.randn(n, k, generator=g) * 0.02
        groups = quantize_int4(w) if bits == 4 else quantize_int8(w)
        dense = groups.dequantize(None).to(torch.bfloat16)
        out.append((kind, {"torch_int4": TorchInt4Matmul.from_groups(groups),
                           "radixrt": TiledQuantMatmul.from_groups(groups),
                           "dense_bf16": dense}))
    return out


def _call(w: object, x: torch.Tensor) -> torch.Tensor:
    if isinstance(w, QuantMatmul):
        return w(x)
    return torch.nn.functional.linear(x, w)  # type: ignore[arg-type]


def _nbytes(w: object) -> int:
    return w.nbytes() if isinstance(w, QuantMatmul) else w.numel() * w.element_size()  # type: ignore[union-attr]


def run(rows_list: list[int], reps: int, layers: int) -> dict[str, object]:
    weights = _weights(layers)
    kinds = sorted({k for k, _ in weights})
    xs = {(r, k): torch.randn(r, k).to(torch.bfloat16) for r in rows_list for k in (576, 1536)}
    results: dict[str, object] = {}
    for rows in rows_list:
        times: dict[str, dict[str, list[float]]] = {kern: {kd: [] for kd in kinds}
                                                    for kern in KERNELS}
        totals: dict[str, list[float]] = {kern: [] for kern in KERNELS}
        for rep in range(reps + 1):  # first round: warm-up
            for kern in KERNELS:
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
        for kern in KERNELS:
            nbytes = sum(_nbytes(ws[kern]) for _, ws in weights)
            med = statistics.median(totals[kern])
            row[kern] = {"step_ms_median": med, "step_ms_all": totals[kern],
                         "weight_mb": nbytes / 1e6, "gb_per_s": nbytes / med / 1e6,
                         "per_kind_ms_median": {kd: statistics.median(times[kern][kd])
                                                for kd in kinds}}
        t_old = row["torch_int4"]["step_ms_median"]  # type: ignore[index]
        t_new = row["radixrt"]["step_ms_median"]  # type: ignore[index]
        t_dense = row["dense_bf16"]["step_ms_median"]  # type: ignore[index]
        row["speedup_vs_torch_int4"] = t_old / t_new
        row["speedup_vs_dense_bf16"] = t_dense / t_new
        results[str(rows)] = row
        print(f"rows {rows:3d}: step ms torch_int4 {t_old:7.2f}  radixrt {t_new:7.2f}  "
              f"dense_bf16 {t_dense:7.2f}  (x{t_old / t_new:.2f} vs torch int4, "
              f"x{t_dense / t_new:.2f} vs dense; radixrt "
              f"{row['radixrt']['gb_per_s']:.1f} GB/s)", flush=True)  # type: ignore[index]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=5, help="timed passes per kernel and rows")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="directory for qgemv_speed.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if not load_cpu_kernels():
        raise SystemExit("radixrt's CPU kernels are unavailable (python -m "
                         "radixrt.attention.cpu_kernels build shows why)")
    with torch.inference_mode():
        res = run(a.rows, a.reps, a.layers)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "qgemv_isa": torch.ops.radixrt.qgemv_isa(), "reps": a.reps, "layers": a.layers}
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "qgemv_speed.json").write_text(json.dumps({"meta": meta, "rows": res},
                                                            indent=1))


if __name__ == "__main__":
    main()
