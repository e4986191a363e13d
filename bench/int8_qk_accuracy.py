"""What int8 Q·Kᵀ in prefill attention would cost in accuracy, before anyone writes the kernel.

    python bench/int8_qk_accuracy.py [--lengths 512 2048 4000] [--starts 0 9000 21000 33000]

On AVX2-only CPUs prefill at long context runs at the fp32 FMA rate, attention 38-64% of a step
(stop 75), and `vpmaddubsw` does int8 products at twice that rate. This script simulates the
int8 scores exactly in fp32 (products of 64 int8 pairs fit fp32's 24-bit mantissa): per token
and head, q and k are rounded to int8 with a symmetric scale, k first smoothed by subtracting
its mean over the keys per channel (adds a per-query constant to the scores, which the softmax
ignores; SageAttention's trick). P·V and decode stay fp32. For prompts cut from this repo's
README and HISTORY (real text, no downloads), the next-token distribution after the prefill is
compared with and without it, on the fp32-dequantized model and on the serving default, beside
what the default's weight quantization already moves (Q4_1 weights, int8 activations, against
fp32-dequantized): KL, max |Δ logit| and whether the top token is the same. Accuracy only;
nothing here is timed.
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
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.accuracy import compare_logits, extend_logits  # noqa: E402
from radixrt.mem.kv_quant import dequantize_rows, quantize_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def int8_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 codes with one symmetric scale per vector (last dim), dequantized: the
    int8 KV cache's format (`radixrt.mem.kv_quant`)."""
    return dequantize_rows(*quantize_rows(x), x.dtype)


@contextmanager
def int8_scores() -> Iterator[None]:
    """SDPA (what the torch attention path calls) with q and the smoothed k as int8."""
    sdpa = F.scaled_dot_product_attention

    def quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                  **kw: Any) -> torch.Tensor:
        k = k - k.mean(dim=-2, keepdim=True)  # per (head, channel) over the keys
        return sdpa(int8_round(q), int8_round(k), v, *args, **kw)

    with mock.patch.object(F, "scaled_dot_product_attention", quantized):
        yield


def make_runner(quantization: str, ctx: int) -> Any:
    """A runner on the torch attention path (SDPA, no C++ extend op, no one-call step), fp32
    K/V, so the patched SDPA is the only difference."""
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    r = ModelRunner(ServerArgs(max_running_requests=1, max_total_tokens=ctx + 64,
                               max_context_len=ctx + 16, attention_backend="torch",
                               log_level="warning", dtype="float32",
                               quantization=quantization, kv_cache_dtype="float32",
                               disable_fused_extend=True))
    r.attn_backend.extend_kernel = False
    return r


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """KL(a || b) of the two next-token distributions, max |Δ logit|, same argmax
    (`bench.accuracy.compare_logits` on one position)."""
    c = compare_logits(a[None], b[None])
    return {"kl": c["kl_sum"], "max_abs": c["max_abs"], "same_top1": bool(c["top1_same"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 4000])
    ap.add_argument("--starts", nargs="+", type=int, default=[0, 9000, 21000, 33000],
                    help="token offsets into README + HISTORY where the prompts start")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON rows")
    a = ap.parse_args()
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    torch.set_num_threads(a.threads)
    tok = load_tokenizer(default_model_path())
    text = (ROOT / "README.md").read_text() + (ROOT / "bench" / "HISTORY.md").read_text()
    ids = tok.encode(text)
    ctx = max(a.lengths)
    ref, default = make_runner("none", ctx), make_runner("auto", ctx)
    rows = []
    for n in a.lengths:
        for start in a.starts:
            p = ids[start:start + n]
            if len(p) < n:
                continue
            base, dq = extend_logits(ref, p), extend_logits(default, p)
            with int8_scores():
                base_i8, dq_i8 = extend_logits(ref, p), extend_logits(default, p)
            row = {"tokens": n, "start": start, "int8_qk_fp32": compare(base, base_i8),
                   "weights_quantized": compare(base, dq), "int8_qk_default": compare(dq, dq_i8)}
            rows.append(row)
            f, w, d = row["int8_qk_fp32"], row["weights_quantized"], row["int8_qk_default"]
            print(f"{n:5d} tokens at {start:6d}: int8 QK on fp32 KL {f['kl']:.1e} "
                  f"max|dl| {f['max_abs']:.3f} top1 {'=' if f['same_top1'] else 'x'} | "
                  f"weights quantized KL {w['kl']:.1e} max|dl| {w['max_abs']:.3f} | "
                  f"int8 QK on the default KL {d['kl']:.1e} top1 "
                  f"{'=' if d['same_top1'] else 'x'}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
