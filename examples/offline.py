"""Offline example: chat requests sharing a system prompt, run through the radix cache.

Run with `make serve` (until the HTTP server lands) or `.venv/bin/python examples/offline.py`.
"""

from __future__ import annotations

import time

from radixrt import Engine, SamplingParams

SYSTEM = (
    "You are a concise assistant for a bicycle repair shop. Answer in one or two sentences. "
    "The shop is open Monday to Saturday, 9am to 6pm. A basic tune-up costs 60 dollars, a flat "
    "tire repair costs 15 dollars, and brake adjustment costs 25 dollars."
)
QUESTIONS = [
    "How much is a tune-up?",
    "Are you open on Sunday?",
    "My brakes squeak. What should I do?",
    "How much does it cost to fix a flat tire?",
]


def main() -> None:
    params = SamplingParams(max_new_tokens=48, temperature=0)
    with Engine() as engine:
        conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                         for q in QUESTIONS]
        t0 = time.perf_counter()
        outs = engine.chat(conversations, params)
        dt = time.perf_counter() - t0
        for q, out in zip(QUESTIONS, outs, strict=True):
            print(f"Q: {q}\nA: {out.text.strip()}\n   [{out.finish_reason}; prompt "
                  f"{out.prompt_tokens}, cached {out.cached_tokens}, generated "
                  f"{out.completion_tokens}]\n")
        s = engine.stats()
        print(f"{len(outs)} requests in {dt:.2f}s; cache hit rate {s['cache_hit_rate']:.2%}")


if __name__ == "__main__":
    main()
