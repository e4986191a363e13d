"""Accuracy of each weight/activation mode against the fp32 dequantized reference.

    python bench/accuracy.py [--model X.gguf] [--prompts 12] [--new-tokens 32] \\
        [--out bench/results/DATE-quant]

For the model (default: the shipped SmolLM2 GGUF) and chat prompts built with its template:

1. Hugging Face transformers fp32 (loading the same GGUF) generates `--new-tokens` greedy tokens
   per prompt; that text is the evaluation sequence (prompt + continuation).
2. Logits: every position of every sequence, computed by radixrt in fp32 unquantized (the
   reference) and in each mode, teacher-forced with *every matmul on the mode's kernel* (no
   dense copy): max |logit diff|, KL(ref || mode) mean and max, top-1 agreement.
3. Greedy: each mode generates from the prompts through the serving path (prefill on the dense
   copy, decode on the quantized kernels; `quant_max_rows` 16), compared with HF's tokens: the
   share of prompts with identical tokens and the mean length of the common prefix.

Writes OUT.json and OUT.md (with the CPU and torch version).
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
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import common_prefix, cpu_name, markdown_table  # noqa: E402

# (name, dtype, quantization, quant_kernel, kv_cache_dtype); "auto" here means the untimed
# default, radixrt's qgemv where its library builds (`resolve_quant_kernel`), so the rows mean
# the same on every CPU (the server's `auto` times vnni against it where both exist).
MODES: tuple[tuple[str, str, str, str, str], ...] = (
    ("fp32", "float32", "none", "auto", "auto"),
    ("bf16", "bfloat16", "none", "auto", "auto"),
    ("gguf (Q4_1 4-bit + Q8_0 head 8-bit), bf16 act", "bfloat16", "gguf", "auto", "auto"),
    ("int8 (8-bit groups), bf16 act", "bfloat16", "int8", "auto", "auto"),
    ("int4 (4-bit groups, 8-bit head), bf16 act", "bfloat16", "int4", "auto", "auto"),
    ("gguf, fp32 act", "float32", "gguf", "auto", "float32"),
    ("gguf, vnni kernel (int8 act per group of 32)", "bfloat16", "gguf", "vnni", "auto"),
    ("gguf, vnni kernel, int8 KV cache", "bfloat16", "gguf", "vnni", "int8"),
    ("bf16, int8 KV cache", "bfloat16", "none", "auto", "int8"),
    ("gguf, vnni kernel, fp32 act", "float32", "gguf", "vnni", "float32"),
    ("fp32, float16 KV cache", "float32", "none", "auto", "float16"),
    ("gguf, vnni kernel, fp32 act, float16 KV cache", "float32", "gguf", "vnni", "float16"),
    ("gguf, vnni-hilo kernel (two int8 terms), fp32 act", "float32", "gguf", "vnni-hilo",
     "float32"),
    ("gguf, vnni-hilo kernel, fp32 act, float16 KV cache", "float32", "gguf", "vnni-hilo",
     "float16"),
)

SYSTEM = "You are a concise, helpful assistant."
QUESTIONS = (
    "What is the capital of France?",
    "Explain what a radix tree is in two sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What is 17 times 23?",
    "Why is the sky blue?",
    "Suggest a name for a bakery that sells bread and coffee.",
    "What is the difference between a virus and a bacterium?",
    "List the planets of the solar system in order.",
    "How does a bicycle stay upright?",
    "Write a short thank-you note to a colleague.",
    "What is photosynthesis?",
)


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
                        if f in have]
    except OSError:
        pass
    return []


class _Runner:
    """One model over its own pools: extend (all positions' logits) and batched greedy."""

    def __init__(self, model_path: str, dtype: str, quantization: str, dense_copy: bool,
                 max_tokens: int, max_reqs: int, quant_kernel: str = "auto",
                 kv_cache_dtype: str = "auto"):
        from radixrt.config import ServerArgs
        from radixrt.model.quant_matmul import resolve_quant_kernel
        from radixrt.model.runner import ModelRunner

        if quant_kernel == "auto" and quantization != "none":
            quant_kernel = resolve_quant_kernel("auto")
        args = ServerArgs(model_path=model_path, dtype=dtype, quantization=quantization,
                          quant_max_rows=16, disable_quant_dense_copy=not dense_copy,
                          quant_kernel=quant_kernel, kv_cache_dtype=kv_cache_dtype,
                          max_total_tokens=max_tokens, max_running_requests=max_reqs,
                          attention_backend="torch", log_level="warning")
        self.runner = ModelRunner(args)

    def _step(self, mode: Any, ids: list[int], rows: list[int], prefix: list[int],
              ext: list[int]) -> torch.Tensor:
        from radixrt.core.forward_batch import ForwardBatch

        r = self.runner
        loc = r.token_to_kv_pool.alloc(sum(ext))
        r.req_to_token_pool.write(rows, prefix, ext, loc)
        fb = ForwardBatch.build(mode, ids, rows, prefix, ext, r.req_to_token_pool.req_to_token,
                                r.device)
        return r.forward(fb)

    def reset(self) -> None:
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool.clear()

    def all_logits(self, ids: list[int]) -> torch.Tensor:
        return extend_logits(self.runner, ids, all_positions=True)

    def greedy(self, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
        from radixrt.core.forward_batch import ForwardMode

        self.reset()
        rows = [self.runner.req_to_token_pool.alloc() for _ in prompts]
        lens = [len(p) for p in prompts]
        nxt = self._step(ForwardMode.EXTEND, [t for p in prompts for t in p], rows,
                         [0] * len(rows), lens).argmax(-1).tolist()
        out = [[t] for t in nxt]
        for _ in range(n - 1):
            nxt = self._step(ForwardMode.DECODE, nxt, rows, lens, [1] * len(rows)
                             ).argmax(-1).tolist()
            lens = [x + 1 for x in lens]
            for o, t in zip(out, nxt, strict=True):
                o.append(t)
        return out


def hf_greedy(model_path: str, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    p = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                 dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    return outs


def extend_logits(runner: Any, ids: list[int], all_positions: bool = False) -> torch.Tensor:
    """Logits (fp32) after one extend of `ids` on a `ModelRunner` whose pools it clears first:
    the last position's `[vocab]`, or every position's `[len(ids), vocab]` (teacher forcing)."""
    from radixrt.core.forward_batch import ForwardBatch, ForwardMode

    rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool
    rp.clear()
    kp.clear()
    row = rp.alloc()
    rp.write([row], [0], [len(ids)], kp.alloc(len(ids)))
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [row], [0], [len(ids)], rp.req_to_token,
                            runner.device)
    if all_positions:
        fb.logits_indices = torch.arange(fb.num_tokens)
    out = runner.forward(fb)  # float32, under inference mode
    return out if all_positions else out[-1]


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return {"max_abs": float((got - ref).abs().max()), "kl_sum": float(kl.sum()),
            "kl_max": float(kl.max()), "top1_same": int((got.argmax(-1) == ref.argmax(-1)).sum()),
            "positions": int(ref.shape[0])}


def summarize_logits(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor]
                     ) -> dict[str, float]:
    """`compare_logits` over pairs of `[positions, vocab]` logits, pooled: KL(ref || got) mean
    and max, max |Δ logit|, top-1 agreement, over every position."""
    acc = {"max_abs": 0.0, "kl_sum": 0.0, "kl_max": 0.0, "top1_same": 0, "positions": 0}
    for r, g in zip(ref, got, strict=True):
        c = compare_logits(r, g)
        acc = {k: max(acc[k], c[k]) if k in ("max_abs", "kl_max") else acc[k] + c[k]
               for k in acc}
    return {"logit_max_abs": acc["max_abs"], "kl_mean": acc["kl_sum"] / acc["positions"],
            "kl_max": acc["kl_max"], "top1_agreement": acc["top1_same"] / acc["positions"],
            "positions": acc["positions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--modes", nargs="+", type=int, default=None,
                    help="indices into MODES to run (the fp32 reference, 0, always runs)")
    a = ap.parse_args()
    modes = [m for i, m in enumerate(MODES) if i == 0 or a.modes is None or i in a.modes]
    torch.set_num_threads(a.threads)
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    path = a.model or default_model_path()
    tok = load_tokenizer(path)
    texts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS[: a.prompts]]  # as the Engine's chat path does
    prompts = [list(tok.encode(t, add_special_tokens=False)) for t in texts]
    t0 = time.perf_counter()
    hf = hf_greedy(path, prompts, a.new_tokens)
    print(f"HF fp32 greedy: {time.perf_counter() - t0:.0f} s", flush=True)
    seqs = [p + h for p, h in zip(prompts, hf, strict=True)]
    max_tokens = sum(len(s) for s in seqs) + 64
    ref: list[torch.Tensor] = []
    results: list[dict[str, Any]] = []
    for name, dtype, quant, kernel, kv in modes:
        t0 = time.perf_counter()
        kern = _Runner(path, dtype, quant, False, max_tokens, len(prompts), kernel, kv)
        logits = [kern.all_logits(s) for s in seqs]
        del kern
        if name == MODES[0][0]:
            ref = logits
        serve = _Runner(path, dtype, quant, True, max_tokens, len(prompts), kernel, kv)
        ours = serve.greedy(prompts, a.new_tokens)
        del serve
        same = sum(o == h for o, h in zip(ours, hf, strict=True))
        prefix = sum(common_prefix(o, h) for o, h in zip(ours, hf, strict=True)) / len(hf)
        row: dict[str, Any] = {"mode": name, "dtype": dtype, "quantization": quant,
                               "quant_kernel": kernel, "kv_cache_dtype": kv,
                               "greedy_identical": same, "greedy_prompts": len(hf),
                               "greedy_mean_common_prefix": prefix}
        if logits is not ref:
            row.update(summarize_logits(ref, logits))
        results.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    meta = {"model": Path(path).name, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "prompts": len(prompts), "new_tokens": a.new_tokens,
            "positions": sum(len(s) for s in seqs)}
    if a.out:
        Path(a.out + ".json").write_text(json.dumps({"meta": meta, "accuracy": results},
                                                    indent=1))
        Path(a.out + ".md").write_text(markdown(meta, results))
        print(f"wrote {a.out}.json / .md")


def markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"# Accuracy per mode: {meta['model']}", "",
             f"CPU {meta['cpu']} ({', '.join(meta['cpu_flags'])}), torch {meta['torch']}, "
             f"{meta['threads']} threads. {meta['prompts']} chat prompts + HF fp32's "
             f"{meta['new_tokens']} greedy tokens each = {meta['positions']} positions.", ""]
    table = []
    for r in rows:
        if "kl_mean" in r:
            cells = [f"{r['logit_max_abs']:.3f}", f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}",
                     f"{r['top1_agreement']:.1%}"]
        else:
            cells = ["reference", "—", "—", "—"]
        table.append([r["mode"], *cells, f"{r['greedy_identical']}/{r['greedy_prompts']}",
                      f"{r['greedy_mean_common_prefix']:.1f}"])
    return "\n".join(lines) + "\n" + markdown_table(
        ["mode", "max |Δlogit|", "KL mean", "KL max", "top-1 agree", "greedy = HF fp32",
         "mean common prefix"], table)


if __name__ == "__main__":
    main()
