"""N-gram speculative decoding on and off, end to end: greedy requests through two Engines.

    python bench/speculative.py --concurrency 1 2 4 8 --rounds 3

Two Engines (default SmolLM2, the serving defaults), one with `speculative_algorithm="ngram"`,
side by side (one runs at a time, the other idles). Three kinds of chat request, greedy (or
sampled at `--temperature`, request i seeded with i), each up to `--max-tokens`:
- edit: rewrite a given piece of code or text with a small change (the answer copies most of
  the prompt: what coding agents and editors send);
- extract: a record as JSON with named fields taken from a given text (an agent's tool
  arguments copied from its context);
- chat: open questions whose answers copy nothing (drafts rarely match: what speculation costs
  where it cannot help).
For each concurrency N, two fresh Engines with `max_running_requests=N`, each given all
of a kind's requests at once (`--per-slot` x max(N, 2), the messages in turn), so N run at a
time and a finished one's place is taken at once, as in a server at N concurrent clients (a batch that
waited for its slowest member would hide what faster requests gain). Each round each Engine
runs the same requests (the order of the Engines alternating). Per Engine: wall time, output
tokens, forward steps, drafted and accepted tokens (`stats()` deltas), and how many outputs
equal the other Engine's. Ratio: on over off output tokens per second (> 1: speculation is
faster; outputs may differ where the quantized default rounds differently in larger steps),
median over rounds.
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
import time  # noqa: E402

CODE = [
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n",
    "class Counter:\n    def __init__(self):\n        self.n = 0\n\n    def add(self, k):\n"
    "        self.n += k\n        return self.n\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n"
    "        print(i, 'odd')\n",
    "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
]
TEXTS = [
    "Maria Lopez moved to Valencia in 2019. She works as a nurse at the city hospital and "
    "speaks Spanish and English.",
    "The order 4471 was placed by Tom Becker on March 3 for two blue chairs and one oak "
    "table, shipped to Hamburg.",
    "Kenji Sato, 34, is a software engineer in Osaka who enjoys hiking and plays the guitar "
    "in a local band.",
    "Flight LH 452 from Frankfurt to Chicago leaves at 10:25 from gate B44 and arrives at "
    "12:50 local time.",
]
QUESTIONS = [
    "Why is the sky blue?",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Write a short poem about the sea.",
]
KINDS = {
    "edit": [f"Rewrite this code with every variable name in uppercase. Reply with the code "
             f"only.\n\n{c}" for c in CODE],
    "extract": [f"Copy the facts of this text into a JSON object with the keys \"who\", "
                f"\"where\" and \"details\", using the exact words of the text.\n\n{t}"
                for t in TEXTS],
    "chat": QUESTIONS,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-slot", type=int, default=6,
                    help="requests per running slot: N x this (at least 2 x this)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (request i seeded with i) instead of "
                         "greedy")
    ap.add_argument("--speculative-max-rows", type=int, default=None,
                    help="the `on` Engine's --speculative-max-rows (default: the config's)")
    ap.add_argument("--out", default=None, help="write every row as JSON lines here")
    a = ap.parse_args()

    from radixrt import Engine, SamplingParams

    on_args = ({} if a.speculative_max_rows is None
               else {"speculative_max_rows": a.speculative_max_rows})

    rows: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    lines = []
    for conc in a.concurrency:
        engines = {}
        try:
            for name, algo in (("on", "ngram"), ("off", "none")):
                engines[name] = Engine(num_threads=a.threads, speculative_algorithm=algo,
                                       max_running_requests=conc,
                                       **(on_args if algo == "ngram" else {}))
            for r in range(a.rounds):
                for kind in a.kinds:
                    msgs = KINDS[kind]
                    batch = [msgs[i % len(msgs)] for i in range(a.per_slot * max(conc, 2))]
                    texts: dict[str, list[str]] = {}
                    order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
                    for name in order:
                        eng = engines[name]
                        prompts = [eng.tokenizer.apply_chat_template(
                            [{"role": "user", "content": m}], tokenize=False,
                            add_generation_prompt=True) for m in batch]
                        sps = [SamplingParams(max_new_tokens=a.max_tokens,
                                              temperature=a.temperature,
                                              seed=i if a.temperature > 0 else None)
                               for i in range(len(prompts))]
                        s0 = eng.stats()
                        t0 = time.perf_counter()
                        outs = eng.generate(prompts, sps, use_tqdm=False)
                        secs = time.perf_counter() - t0
                        s1 = eng.stats()
                        texts[name] = [o.text for o in outs]
                        d = {k: s1.get(k, 0) - s0.get(k, 0) for k in
                             ("forward_steps_total", "spec_draft_tokens_total",
                              "spec_accepted_tokens_total")}
                        tokens = sum(o.completion_tokens for o in outs)
                        row = {"round": r, "kind": kind, "concurrency": conc, "engine": name,
                               "seconds": secs, "tokens": tokens, "tok_per_s": tokens / secs,
                               "steps": d["forward_steps_total"],
                               "drafted": d["spec_draft_tokens_total"],
                               "accepted": d["spec_accepted_tokens_total"]}
                        rows.setdefault((kind, conc, name), []).append(row)
                    same = sum(x == y for x, y in zip(texts["on"], texts["off"], strict=True))
                    for name in order:
                        row = rows[(kind, conc, name)][-1]
                        row["same_outputs"] = same
                        row["requests"] = len(texts[name])
                        print(json.dumps(row), flush=True)
                        lines.append(row)
        finally:
            for eng in engines.values():
                eng.shutdown()
    if a.out:
        Path(a.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print("\nmedians over rounds")
    print("| kind | concurrency | off tok/s | on tok/s | on/off tok/s | steps off / on | "
          "accepted / drafted | same outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in a.kinds:
        for conc in a.concurrency:
            on, off = rows[(kind, conc, "on")], rows[(kind, conc, "off")]
            ratio = statistics.median(x["tok_per_s"] / y["tok_per_s"]
                                      for x, y in zip(on, off, strict=True))
            med = statistics.median
            print(f"| {kind} | {conc} | {med(x['tok_per_s'] for x in off):.0f} | "
                  f"{med(x['tok_per_s'] for x in on):.0f} | {ratio:.2f}x | "
                  f"{med(x['steps'] for x in off):.0f} / {med(x['steps'] for x in on):.0f} | "
                  f"{sum(x['accepted'] for x in on)} / {sum(x['drafted'] for x in on)} | "
                  f"{min(x['same_outputs'] for x in on)} of {on[0]['requests']} |")


if __name__ == "__main__":
    main()
