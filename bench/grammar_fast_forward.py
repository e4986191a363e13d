"""Grammar fast-forward on and off, end to end: JSON-schema requests through two Engines.

    python bench/grammar_fast_forward.py --concurrency 1 8 --rounds 3

Two Engines (default SmolLM2, the serving defaults), one with `disable_grammar_fast_forward`,
side by side (one runs at a time, the other idles). Each round, for each concurrency, each
Engine generates the same requests in turn (the order alternating): one batch of
`--concurrency` requests sent at once per schema of bench/grammar_backends.py (that schema
first, the next ones after it), greedy, each a chat prompt asking for that object. Per Engine: the wall time of the batches, its output
tokens, its forward steps and the tokens the grammar forced (`stats()` deltas), and whether
every output parses and validates against its schema. Ratio: off time over on time (> 1:
fast-forward is faster), median over rounds.
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

from bench.grammar_backends import SCHEMAS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import jsonschema

    from radixrt import Engine, SamplingParams

    engines = {}
    try:
        for name, off in (("on", False), ("off", True)):
            engines[name] = Engine(num_threads=a.threads, disable_grammar_fast_forward=off)
        names = list(SCHEMAS)
        rows: dict[tuple[int, str], list[dict[str, float]]] = {}
        for r in range(a.rounds):
            for conc in a.concurrency:
                order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
                for name in order:
                    eng = engines[name]
                    s0 = eng.stats()
                    secs = 0.0
                    picks, outs = [], []
                    for k in range(len(names)):  # one batch per schema first in line
                        batch = [names[(k + i) % len(names)] for i in range(conc)]
                        prompts = [eng.tokenizer.apply_chat_template(
                            [{"role": "user", "content": f"Give me one {n} as JSON."}],
                            tokenize=False, add_generation_prompt=True) for n in batch]
                        params = [SamplingParams(max_new_tokens=a.max_tokens, temperature=0,
                                                 json_schema=json.dumps(SCHEMAS[n]))
                                  for n in batch]
                        t0 = time.perf_counter()
                        outs += eng.generate(prompts, params, use_tqdm=False)
                        secs += time.perf_counter() - t0
                        picks += batch
                    s1 = eng.stats()
                    valid = 0
                    for n, o in zip(picks, outs, strict=True):
                        try:
                            jsonschema.validate(json.loads(o.text), SCHEMAS[n])
                            valid += 1
                        except (ValueError, jsonschema.ValidationError):
                            pass
                    row = {"round": r, "concurrency": conc, "engine": name, "seconds": secs,
                           "tokens": sum(o.completion_tokens for o in outs),
                           "steps": s1["forward_steps_total"] - s0["forward_steps_total"],
                           "forced": s1["grammar_forced_tokens_total"]
                           - s0["grammar_forced_tokens_total"],
                           "valid": valid, "requests": len(outs),
                           "decode_step_ms": 1e3 * (s1["decode_totals"]["time_s"]
                                                    - s0["decode_totals"]["time_s"])
                           / max(1, s1["decode_totals"]["steps"] - s0["decode_totals"]["steps"])}
                    rows.setdefault((conc, name), []).append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    print("\nmedians over rounds")
    for conc in a.concurrency:
        on, off = rows[(conc, "on")], rows[(conc, "off")]
        ratio = statistics.median(y["seconds"] / x["seconds"] for x, y in zip(on, off,
                                                                                strict=True))
        for name, rs in (("on", on), ("off", off)):
            print(f"concurrency {conc:3d} fast-forward {name:3s}: "
                  f"{statistics.median(x['seconds'] for x in rs):6.2f} s, "
                  f"{statistics.median(x['tokens'] for x in rs):6.0f} tokens, "
                  f"{statistics.median(x['steps'] for x in rs):5.0f} steps, "
                  f"{statistics.median(x['forced'] for x in rs):5.0f} forced, valid "
                  f"{min(x['valid'] for x in rs)}/{rs[0]['requests']}")
        print(f"concurrency {conc:3d}: off / on time {ratio:.3f}x")


if __name__ == "__main__":
    main()
