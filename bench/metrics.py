"""Serving metrics with SGLang's `bench_serving` definitions, and the optimal prefix-hit rate.

Standard library only (peers and the tests import it without numpy).

From a run's request records (`common.RequestRecord`), over the completed requests:
- duration: from the start of the run (t = 0) to the last token of the last request;
- request throughput = completed / duration; input / output / total token throughput =
  Σ prompt tokens, Σ output tokens, and their sum, over the duration;
- TTFT = first token time - send time; E2E = last token time - send time;
- TPOT (per request with more than one output token) = (E2E - TTFT) / (output tokens - 1);
- ITL: the gaps between consecutive streamed chunks of a request, pooled over all requests; a
  chunk carrying n > 1 tokens counts as n gaps of (gap / n) (SGLang's per-chunk gap when n = 1);
- mean, median (p50) and p99 with numpy's default (linear) percentile interpolation;
- achieved hit rate = Σ cached prompt tokens / Σ prompt tokens (requests reporting it).

Optimal hit rate of a set of prompts: 1 - (nodes of the token trie of all prompts) / (all prompt
tokens): a cache that never evicts computes each distinct prefix exactly once. For chains (a turn
resends the previous prompt and its answer), the answer's tokens already had their KV computed
while decoding (all but the last one, which was sampled but never fed back), so trie nodes that a
request decoded are not counted as prompt tokens to compute: pass them as `decoded`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import RequestRecord, Workload, session_prompts


def percentile(values: Sequence[float], p: float) -> float:
    """numpy.percentile(values, p) (linear interpolation); nan for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"mean": mean(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def distinct_prefix_tokens(prompts: Iterable[Sequence[int]]) -> int:
    """Nodes of the trie over the prompts (one node per distinct (prefix, next token))."""
    root: dict[int, dict] = {}
    nodes = 0
    for p in prompts:
        node = root
        for t in p:
            child = node.get(t)
            if child is None:
                child = {}
                node[t] = child
                nodes += 1
            node = child
    return nodes


def prompt_tokens_to_compute(prompts: Iterable[Sequence[int]],
                             decoded: Iterable[tuple[Sequence[int], int]] = ()) -> int:
    """Trie nodes reached by the prompts, less those some request computed while decoding:
    `decoded` holds (sequence, start) pairs whose tokens from `start` on were decoded."""
    root: dict[int, dict] = {}
    generated: set[int] = set()
    for seq, start in decoded:
        node = root
        for i, t in enumerate(seq):
            node = node.setdefault(t, {})
            if i >= start:
                generated.add(id(node))
    seen: set[int] = set()
    for p in prompts:
        node = root
        for t in p:
            node = node.setdefault(t, {})
            k = id(node)
            if k not in generated:
                seen.add(k)
    return len(seen)


def optimal_hit_rate(prompts: Sequence[Sequence[int]],
                     decoded: Sequence[tuple[Sequence[int], int]] = ()) -> float:
    total = sum(len(p) for p in prompts)
    if total == 0:
        return 0.0
    return 1.0 - prompt_tokens_to_compute(prompts, decoded) / total


def sent_sequences(workload: Workload, records: Sequence[RequestRecord],
                   ) -> tuple[list[list[int]], list[tuple[list[int], int]]]:
    """Every prompt as actually sent in a run (chains extended with the generated ids), and the
    decoded part of each request: (prompt + output[:-1], len(prompt))."""
    outs: dict[int, dict[int, list[int]]] = {}
    for r in records:
        if r.ok:
            outs.setdefault(r.session, {})[r.turn] = r.output_ids
    prompts: list[list[int]] = []
    decoded: list[tuple[list[int], int]] = []
    for s in workload.sessions:
        got = outs.get(s.id, {})
        n = 0
        while n in got:
            n += 1
        # turns 0..n-1 finished (a failed turn n sent a prompt too, but computed nothing useful)
        ps = session_prompts(s, [got[k] for k in range(n)])[:n]
        prompts.extend(ps)
        decoded.extend((p + got[k][:-1], len(p)) for k, p in enumerate(ps))
    return prompts, decoded


def sent_prompts(workload: Workload, records: Sequence[RequestRecord]) -> list[list[int]]:
    return sent_sequences(workload, records)[0]


def run_optimal_hit_rate(workload: Workload, records: Sequence[RequestRecord]) -> float:
    """The optimal hit rate of the prompts a run actually sent."""
    return optimal_hit_rate(*sent_sequences(workload, records))


def compute_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """SGLang bench_serving metrics over the successful requests (times in seconds)."""
    done = [r for r in records if r.ok and r.output_len > 0]
    failed = len(records) - len(done)
    if not done:
        return {"completed": 0, "failed": failed, "duration_s": float("nan")}
    duration = max(r.end for r in done)
    ttft = [r.first_token - r.arrival for r in done]
    e2e = [r.end - r.arrival for r in done]
    tpot = [(r.end - r.first_token) / (r.output_len - 1) for r in done if r.output_len > 1]
    itl: list[float] = []
    for r in done:
        for (t_prev, _), (t, n) in zip(r.chunks, r.chunks[1:], strict=False):
            itl.extend([(t - t_prev) / n] * n)
    n_in = sum(r.prompt_len for r in done)
    n_out = sum(r.output_len for r in done)
    reported = [r for r in done if r.cached_tokens is not None]
    hit = (sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_len for r in reported)
           if reported else None)
    return {
        "completed": len(done),
        "failed": failed,
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(done) / duration,
        "input_tok_per_s": n_in / duration,
        "output_tok_per_s": n_out / duration,
        "total_tok_per_s": (n_in + n_out) / duration,
        "ttft_s": summary(ttft),
        "tpot_s": summary(tpot),
        "itl_s": summary(itl),
        "e2e_s": summary(e2e),
        "concurrency": sum(e2e) / duration,
        "hit_rate": hit,
    }
