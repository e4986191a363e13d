"""The sampled rows' filter and draw: radixrt's CPU op `sample_rows` against the torch path.

    python bench/sampler_speed.py [--rows 1 4 8 16 64] [--repeats 20] [--out bench/results/X]

Real logits: the default model's (fp32) at every position of a few chat prompts with their
greedy answers (a few hundred peaked and flat rows). For each setting (temperature 0.7 alone,
with top_p 0.9, top_k 50, min_p 0.05, and llama.cpp's default chain top_k 40 + top_p 0.95 +
min_p 0.05) and row count, both paths draw with the same uniforms, alternated, best of
`--repeats`; the report gives each one's ms per call, the ratio, and the share of draws where
the two picked the same token (they differ only where float rounding moves a cut or a CDF
boundary). Writes OUT.json and OUT.md.
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
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import cpu_name, markdown_table  # noqa: E402

SETTINGS: tuple[tuple[str, dict[str, float]], ...] = (
    ("temperature 0.7", {}),
    ("+ top_p 0.9", {"top_p": 0.9}),
    ("+ top_k 50", {"top_k": 50}),
    ("+ min_p 0.05", {"min_p": 0.05}),
    ("+ top_k 40, top_p 0.95, min_p 0.05", {"top_k": 40, "top_p": 0.95, "min_p": 0.05}),
)


def real_logits(prompts: int, new_tokens: int) -> torch.Tensor:
    from bench.accuracy import QUESTIONS, SYSTEM, _Runner
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    texts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS[:prompts]]
    chats = [list(tok.encode(t, add_special_tokens=False)) for t in texts]
    runner = _Runner(path, "float32", "none", True, 8192, 16)
    answers = runner.greedy(chats, new_tokens)
    rows = [runner.all_logits(c + a).float() for c, a in zip(chats, answers, strict=True)]
    return torch.cat(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from radixrt.attention.cpu_kernels import load_cpu_kernels, unavailable_reason
    from radixrt.sampling.sampler import filter_logits, pick_by_uniform, sample_filtered

    if not load_cpu_kernels():
        raise SystemExit(f"radixrt's CPU kernels are not available: {unavailable_reason()}")
    logits = real_logits(a.prompts, a.new_tokens)
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []
    for name, s in SETTINGS:
        for n in a.rows:
            idx = torch.randint(0, logits.shape[0], (n,), generator=gen)
            x = logits.index_select(0, idx).contiguous()
            t = torch.full((n,), 0.7)
            k = torch.full((n,), int(s["top_k"])) if "top_k" in s else None
            p = torch.full((n,), s["top_p"]) if "top_p" in s else None
            m = torch.full((n,), s["min_p"]) if "min_p" in s else None
            best = {"op": float("inf"), "torch": float("inf")}
            same = total = 0
            for _ in range(a.repeats):
                u = torch.rand(n, dtype=torch.float64, generator=gen)
                t0 = time.perf_counter()
                got = sample_filtered(x, t, k, p, m, u)
                t1 = time.perf_counter()
                ref = pick_by_uniform(filter_logits(x, t, k, p, m), u)
                t2 = time.perf_counter()
                best["op"] = min(best["op"], t1 - t0)
                best["torch"] = min(best["torch"], t2 - t1)
                same += int((got == ref).sum())
                total += n
            row = {"setting": name, "rows": n, "op_ms": best["op"] * 1e3,
                   "torch_ms": best["torch"] * 1e3, "speedup": best["torch"] / best["op"],
                   "same_pick": same / total}
            results.append(row)
            print(json.dumps(row), flush=True)
    meta = {"cpu": cpu_name(), "torch": torch.__version__, "threads": a.threads,
            "logit_rows": int(logits.shape[0]), "repeats": a.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    md = "\n".join([
        "# Sampled rows: `radixrt::sample_rows` against the torch path", "",
        f"{meta['date']}, {meta['cpu']}, torch {meta['torch']}, {a.threads} threads; "
        f"{meta['logit_rows']} rows of real SmolLM2 logits (fp32), best of {a.repeats}.", "",
        markdown_table(["setting", "rows", "op ms", "torch ms", "speed-up", "same pick"],
                       [[r["setting"], r["rows"], f"{r['op_ms']:.3f}", f"{r['torch_ms']:.3f}",
                         f"{r['speedup']:.1f}×", f"{r['same_pick']:.4f}"] for r in results]),
        ""])
    print(md)
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
        Path(a.out + ".md").write_text(md)


if __name__ == "__main__":
    main()
