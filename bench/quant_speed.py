"""Decode step time and weight bytes per step for each dtype / quantization mode, interleaved.

    python bench/quant_speed.py --rounds 3 --out bench/results/DATE-quant-speed

Runs `bench/offline.py one-batch` (batch 1 / 8 / 64, 64-token prompts, 8 decode steps, 2 timed
runs) once per mode per round, the modes alternating round by round so load from other
processes hits all alike, then reports per mode and batch size the median over rounds of the
decode ms/step (and the best round) and prefill tok/s, with the weight MB one decode step reads. `--collect DIR`
only aggregates the `MODE.rN.json` files an earlier run left in DIR.
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
import subprocess  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import markdown_table  # noqa: E402

# tag -> extra one-batch arguments
MODES: dict[str, list[str]] = {
    "float32-none": ["--dtype", "float32", "--quantization", "none"],
    "bfloat16-none": ["--dtype", "bfloat16", "--quantization", "none"],
    "bfloat16-gguf": ["--dtype", "bfloat16", "--quantization", "gguf"],
    "bfloat16-gguf-rows64": ["--dtype", "bfloat16", "--quantization", "gguf",
                             "--quant-max-rows", "64"],
    "bfloat16-int8-rows64": ["--dtype", "bfloat16", "--quantization", "int8",
                             "--quant-max-rows", "64"],
}
BATCH = ["1", "8", "64"]


def run(rounds: int, work: Path) -> None:
    offline = Path(__file__).resolve().parent / "offline.py"
    for r in range(1, rounds + 1):
        for tag, extra in MODES.items():
            cmd = [sys.executable, str(offline), "one-batch", "--batch-size", *BATCH,
                   "--input-len", "64", "--output-len", "8", "--runs", "2", *extra,
                   "--out", str(work / f"{tag}.r{r}.json")]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            print(f"{tag} round {r} done", flush=True)


def collect(work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tag in MODES:
        runs = [json.loads(f.read_text()) for f in sorted(work.glob(f"{tag}.r*.json"))]
        if not runs:
            continue
        rows = []
        for i, bs in enumerate(int(b) for b in BATCH):
            rows.append({
                "batch_size": bs,
                "decode_ms_per_step": statistics.median(r["rows"][i]["decode_ms_per_step"]
                                                        for r in runs),
                "decode_ms_best": min(r["rows"][i]["decode_ms_per_step"] for r in runs),
                "decode_ms_all": [r["rows"][i]["decode_ms_per_step"] for r in runs],
                "prefill_tok_per_s": statistics.median(r["rows"][i]["prefill_tok_per_s"]
                                                       for r in runs),
                "decode_weight_mb_per_step": runs[0]["rows"][i]["decode_weight_mb_per_step"],
            })
        out[tag] = {"dtype": runs[0]["dtype"], "quantization": runs[0]["quantization"],
                    "quant_probe": [r.get("quant_probe") for r in runs], "rounds": len(runs),
                    "rows": rows}
    return out


def markdown(res: dict[str, Any]) -> str:
    return markdown_table(
        ["mode", "batch", "decode ms/step median", "best", "weight MB/step",
         "prefill tok/s median"],
        ([tag, r["batch_size"], f"{r['decode_ms_per_step']:.1f}", f"{r['decode_ms_best']:.1f}",
          f"{r['decode_weight_mb_per_step']:.0f}", f"{r['prefill_tok_per_s']:.0f}"]
         for tag, m in res.items() for r in m["rows"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=None, help="where the per-run JSON files go")
    ap.add_argument("--collect", default=None, help="only aggregate the runs in this dir")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args()
    if a.collect:
        work = Path(a.collect)
    else:
        work = Path(a.work or "bench/.quant-speed")
        work.mkdir(parents=True, exist_ok=True)
        run(a.rounds, work)
    res = collect(work)
    text = markdown(res)
    print(text)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(res, indent=1))
        Path(a.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
