"""Pick a grammar library by measurement: llguidance vs xgrammar on the served tokenizer.

For each library: tokenizer set-up time, compile time per JSON schema (cold, distinct schemas),
and the time to build the token masks of one decode step for a batch of B constrained requests
(each request walks a valid instance of its schema, token by token, at a different offset).

    PYTHONPATH=. python bench/grammar_backends.py [--batches 1 8 64] [--tokenizer PATH]

xgrammar is optional (it pulls triton); install it elsewhere with
`pip install --no-deps --target /tmp/xg xgrammar` and add that directory to PYTHONPATH.
Output: a markdown table on stdout. Run on a shared machine: take medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.common import markdown_table

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer",
                                                                  "minimum": 1}},
                "required": ["sku", "qty"]}},
            "total": {"type": "number"},
            "gift": {"type": "boolean"},
        },
        "required": ["id", "status", "items", "total", "gift"],
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["city", "unit"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "authors": {"type": "array", "items": {"type": "object", "properties": {
                "first": {"type": "string"}, "last": {"type": "string"},
                "email": {"type": ["string", "null"]}}, "required": ["first", "last"]}},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "meta": {"type": "object", "properties": {"pages": {"type": "integer"},
                                                      "year": {"type": "integer"}}},
        },
        "required": ["title", "authors"],
    },
}

INSTANCES: dict[str, Any] = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "order": {"id": "ABC-1234", "status": "shipped",
              "items": [{"sku": "widget-7", "qty": 3}, {"sku": "gear", "qty": 12}],
              "total": 129.5, "gift": False},
    "tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius",
                                                        "days": 3}},
    "nested": {"title": "Notes on the Analytical Engine",
               "authors": [{"first": "Ada", "last": "Lovelace", "email": None}],
               "tags": ["history", "computing"], "meta": {"pages": 65, "year": 1843}},
}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class LLG:
    name = "llguidance"

    def __init__(self, hf_tok: Any, vocab: int):
        import llguidance
        import llguidance.hf
        import torch

        self.llg, self.torch = llguidance, torch
        self.vocab = vocab
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        g = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        return g

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tok, compiled)

    def bitmask(self, batch: int) -> Any:
        return self.torch.zeros(batch, (self.vocab + 31) // 32, dtype=self.torch.int32)

    def fill(self, matchers: list[Any], mask: Any) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), mask.shape[1] * 4,
            mask.shape[0])

    def fill_serial(self, matchers: list[Any], mask: Any) -> None:
        for i, m in enumerate(matchers):
            v = mask[i]
            m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, m: Any, tok: int) -> None:
        assert m.consume_token(tok), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, hf_tok: Any, vocab: int):
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        self.vocab = vocab
        info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> Any:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers: list[Any], mask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def fill_serial(self, matchers: list[Any], mask: Any) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def accept(self, m: Any, tok: int) -> None:
        assert m.accept_token(tok)


def bench_backend(cls: type, hf_tok: Any, vocab: int, batches: list[int],
                  steps: int) -> dict[str, Any]:
    setup_s, be = timed(lambda: cls(hf_tok, vocab))
    compile_s: dict[str, float] = {}
    compiled: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        compile_s[name], compiled[name] = timed(lambda s=schema: be.compile(s))
    walks = {n: hf_tok.encode(json.dumps(INSTANCES[n], separators=(",", ":")),
                              add_special_tokens=False) for n in SCHEMAS}
    names = list(SCHEMAS)
    fill_ms: dict[tuple[int, str], float] = {}
    for batch in batches:
        for how in ("parallel", "serial"):
            mask = be.bitmask(batch)
            times = []
            rows: list[tuple[Any, str, int]] = []  # (matcher, schema name, position)
            for i in range(batch):
                n = names[i % len(names)]
                m = be.matcher(compiled[n])
                start = (i * 3) % max(1, len(walks[n]) - 1)
                for t in walks[n][:start]:
                    be.accept(m, t)
                rows.append((m, n, start))
            fill = be.fill if how == "parallel" else be.fill_serial
            for _ in range(steps):
                ms = [r[0] for r in rows]
                t0 = time.perf_counter()
                fill(ms, mask)
                times.append(time.perf_counter() - t0)
                nxt = []
                for m, n, pos in rows:
                    if pos >= len(walks[n]):  # walk done: start this row over
                        m, pos = be.matcher(compiled[n]), 0
                    be.accept(m, walks[n][pos])
                    nxt.append((m, n, pos + 1))
                rows = nxt
            fill_ms[(batch, how)] = statistics.median(times) * 1e3
    return {"setup_s": setup_s, "compile_s": compile_s, "fill_ms": fill_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokenizer", default=None, help="HF dir or .gguf (default: SmolLM2)")
    args = ap.parse_args()
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    path = args.tokenizer or default_model_path()
    hf_tok = load_tokenizer(path)
    vocab = len(hf_tok)
    print(f"tokenizer {path}, vocab {vocab}; {platform.processor() or platform.machine()}")
    results = {}
    for cls in (LLG, XGR):
        try:
            results[cls.name] = bench_backend(cls, hf_tok, vocab, args.batches, args.steps)
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    masks = [(b, h) for b in args.batches for h in ("parallel", "serial")]
    print("\n" + markdown_table(
        ["library", "tokenizer set-up s", *(f"compile {n} ms" for n in SCHEMAS),
         *(f"mask B={b} {h} ms" for b, h in masks)],
        ([name, f"{r['setup_s']:.2f}", *(f"{r['compile_s'][n] * 1e3:.1f}" for n in SCHEMAS),
          *(f"{r['fill_ms'][m]:.3f}" for m in masks)] for name, r in results.items())), end="")


if __name__ == "__main__":
    main()
