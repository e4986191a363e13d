"""What int8 weights per output channel (W8), with or without int8 activations (A8), would cost
in accuracy, before anyone writes an AMX-INT8 matmul for them.

    python bench/w8a8_accuracy.py [--prompts 12] [--new-tokens 32] [--out OUT]

On the AMX Xeon (stops 70-72) a 64-row decode step runs its layers' matmuls on bf16 dense
copies through AMX tiles, and their weight stream sets the step's time: TDPBUSD on int8 codes
streams at the bf16 copies' byte rate, so an int8 copy would read half the bytes. AMX multiplies
int8 by int8 only, with one int32 sum per tile: per-output-channel weight scales apply after the
sum for free, an activation scale per row too, but a scale per group of 32 inputs (what the
`vnni` kernel uses) means storing and rescaling a C tile per group (stop 71: 1.15-1.7x slower).

This script simulates each choice exactly in fp32 on the fp32-dequantized model (every dense
matmul on the Python path: the fused and packed paths are off), against the same model
unquantized, teacher-forced over chat prompts and their reference greedy continuations:
- W8: each weight rounded to int8 with one symmetric scale per output channel;
- A8 per row: each activation row rounded to int8 with one symmetric scale over its K inputs;
- A8 per group: one scale per 32 inputs (the `vnni` kernel's activations);
each on the layers' matmuls alone (the LM head left in fp32) or on the head too, beside the
serving default (GGUF Q4_1 / Q8_0 on the `vnni` kernel, fp32 activations, int8 per group).
KL(ref || mode) mean and max, max |delta logit|, top-1 agreement. Accuracy only; nothing is
timed.
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
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

from bench.accuracy import QUESTIONS, SYSTEM, extend_logits, summarize_logits  # noqa: E402
from bench.common import cpu_name, markdown_table  # noqa: E402
from radixrt.mem.kv_quant import dequantize_rows, quantize_rows  # noqa: E402
from radixrt.model import linear  # noqa: E402

GROUP = 32


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 codes with one symmetric scale per row (absmax / 127), dequantized:
    the int8 KV cache's rounding (`radixrt.mem.kv_quant`)."""
    return dequantize_rows(*quantize_rows(x), x.dtype)


def int8_groups(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """As `int8_rows`, one scale per `group` consecutive inputs of each row."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    return int8_rows(g).reshape(x.shape)


@contextmanager
def fake_quant(weights: bool, acts: Callable[[torch.Tensor], torch.Tensor] | None,
               head: torch.Tensor | None) -> Iterator[None]:
    """`linear.dense_linear` (what every DenseWeight call reaches on the Python path) with its
    weight rounded per output channel (`weights`) and its input by `acts`; `head`, the LM head's
    weight, left alone when given (so the tied embedding table is never touched either)."""
    plain = linear.dense_linear
    cache: dict[int, torch.Tensor] = {}
    calls = [0]

    def quantized(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  invariant: bool = False) -> torch.Tensor:
        calls[0] += 1
        if head is not None and w is head:
            return plain(x, w, b, invariant)
        if weights:
            if id(w) not in cache:
                cache[id(w)] = int8_rows(w)
            w = cache[id(w)]
        if acts is not None:
            x = acts(x)
        return plain(x, w, b, invariant)

    with mock.patch.object(linear, "dense_linear", quantized):
        yield
    assert calls[0], "no matmul reached linear.dense_linear: the patch simulated nothing"


def make_runner(quantization: str, tokens: int, rows: int) -> Any:
    from radixrt.config import ServerArgs
    from radixrt.model.quant_matmul import resolve_quant_kernel
    from radixrt.model.runner import ModelRunner

    kernel = "vnni" if quantization != "none" else resolve_quant_kernel("auto")
    return ModelRunner(ServerArgs(
        dtype="float32", quantization=quantization, quant_kernel=kernel,
        disable_quant_dense_copy=quantization != "none", kv_cache_dtype="float32",
        max_total_tokens=tokens, max_running_requests=rows, attention_backend="torch",
        disable_fused_extend=True, disable_fused_decode=True, disable_prepacked_weights=True,
        disable_fused_cpu_ops=True, disable_crossover_tuning=True, log_level="warning"))


def greedy(runner: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(extend_logits(runner, ids + out).argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    prompts = [list(tok.encode(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False))
        for q in QUESTIONS[: a.prompts]]
    tokens = max(len(p) for p in prompts) + a.new_tokens + 64
    ref_runner = make_runner("none", tokens, 1)
    seqs = [p + greedy(ref_runner, p, a.new_tokens) for p in prompts]
    ref = [extend_logits(ref_runner, s, all_positions=True) for s in seqs]
    head = ref_runner.model.lm_head.weight
    variants: list[tuple[str, bool, Callable[[torch.Tensor], torch.Tensor] | None, bool]] = [
        ("W8 per channel, layers", True, None, False),
        ("W8 per channel, layers + LM head", True, None, True),
        ("A8 per row, layers", False, int8_rows, False),
        ("W8 + A8 per row, layers", True, int8_rows, False),
        ("W8 + A8 per row, layers + LM head", True, int8_rows, True),
        ("W8 + A8 per group of 32, layers", True, int8_groups, False),
        ("W8 + A8 per group of 32, layers + LM head", True, int8_groups, True),
    ]
    rows: list[dict[str, Any]] = []
    for name, w8, acts, with_head in variants:
        with fake_quant(w8, acts, None if with_head else head):
            got = [extend_logits(ref_runner, s, all_positions=True) for s in seqs]
        rows.append({"mode": name, **summarize_logits(ref, got)})
        print(json.dumps(rows[-1]), flush=True)
    default = make_runner("gguf", tokens, 1)
    got = [extend_logits(default, s, all_positions=True) for s in seqs]
    rows.append({"mode": "serving default (GGUF Q4_1 / Q8_0 head, vnni kernel, fp32 act)",
                 **summarize_logits(ref, got)})
    print(json.dumps(rows[-1]), flush=True)
    meta = {"cpu": cpu_name(), "torch": torch.__version__, "prompts": len(seqs),
            "new_tokens": a.new_tokens, "positions": sum(len(s) for s in seqs)}
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        table = markdown_table(
            ["mode", "KL mean", "KL max", "max |Δlogit|", "top-1 agree"],
            [[r["mode"], f"{r['kl_mean']:.1e}", f"{r['kl_max']:.1e}",
              f"{r['logit_max_abs']:.2f}", f"{100 * r['top1_agreement']:.1f}%"] for r in rows])
        Path(a.out + ".md").write_text(
            f"# W8 / A8 accuracy against the fp32-dequantized model\n\n"
            f"{meta['cpu']}, torch {meta['torch']}; {meta['prompts']} chat prompts + "
            f"{meta['new_tokens']} reference greedy tokens = {meta['positions']} positions, "
            f"teacher-forced (`bench/w8a8_accuracy.py`).\n\n{table}\n")
        print(f"wrote {a.out}.json / .md")


if __name__ == "__main__":
    main()
