"""A shared-prefix agent workload through `radixrt serve`, with tools on and off.

Every request carries the same long agent preamble (a system prompt and, when tools are on, the
same tool list), then its own task; all requests of a round are sent at once (concurrency
`--concurrency`), greedy. Three modes, interleaved over `--rounds` rounds on one server, the
cache flushed before each run so each starts cold:

- `required`: `tools` + `tool_choice: "required"` (the grammar constrains every token; the
  request ends when the call is complete)
- `none`: the same `tools` (so the same prompt) with `tool_choice: "none"`: no grammar
- `off`: no `tools` at all (a shorter prompt: the template renders no tool block)

Reported per mode: completion tokens per second, requests per second, the radix hit rate
(`usage.prompt_tokens_details.cached_tokens` / prompt tokens), and for `required` whether every
call's arguments validate against the tool's schema.

    python bench/tools_agent.py [--requests 16] [--concurrency 8] [--max-tokens 48] [--rounds 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import markdown_table  # noqa: E402
from bench.function_tools import CONVERT_CURRENCY, UNIT, function_tool, schemas  # noqa: E402
from bench.serving import launch_radixrt, stop_server  # noqa: E402

PREAMBLE = (
    "You are an operations agent for a travel company. You plan trips, check the weather at "
    "each destination, convert prices between currencies and book what the customer approves. "
    "Always call exactly one tool per step, with arguments that match its schema. Policies: "
    + " ".join(f"Rule {i}: confirm dates, budgets and traveller names before booking item {i}."
               for i in range(1, 25))
)
NAME = {"type": "string", "maxLength": 24}
TOOLS = [
    function_tool("get_weather", "Current weather in a city", {"city": NAME, "unit": UNIT}),
    CONVERT_CURRENCY,
    function_tool("book_hotel", "Book a hotel room",
                  {"city": NAME, "nights": {"type": "integer"}, "guest": NAME}),
]
SCHEMAS = schemas(TOOLS)
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul"]
MODES = ("required", "none", "off")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task(i: int) -> str:
    city = CITIES[i % len(CITIES)]
    return (f"Customer {i} wants {2 + i % 5} nights in {city} next month with a budget of "
            f"{300 + 37 * i} dollars. What is the next step?")


async def run_mode(client: Any, mode: str, n: int, conc: int, max_tokens: int
                   ) -> dict[str, Any]:
    import jsonschema

    sem = asyncio.Semaphore(conc)
    out: list[tuple[int, int, int, list[tuple[str, str]]]] = []

    async def one(i: int) -> None:
        kw: dict[str, Any] = {}
        if mode != "off":
            kw = {"tools": TOOLS, "tool_choice": mode, "parallel_tool_calls": False}
        async with sem:
            r = await client.chat.completions.create(
                model="default", temperature=0, max_tokens=max_tokens,
                messages=[{"role": "system", "content": PREAMBLE},
                          {"role": "user", "content": task(i)}], **kw)
        u = r.usage
        cached = (u.prompt_tokens_details.cached_tokens or 0) if u.prompt_tokens_details else 0
        calls = [(c.function.name, c.function.arguments)
                 for c in r.choices[0].message.tool_calls or []]
        out.append((u.prompt_tokens, cached, u.completion_tokens, calls))

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t
    valid = 0
    calls = [c for *_, cs in out for c in cs]
    for name, args in calls:
        try:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
            valid += 1
        except (ValueError, KeyError, jsonschema.ValidationError):
            pass
    prompt = sum(o[0] for o in out)
    return {"mode": mode, "wall_s": wall, "requests": n,
            "completion_tokens": sum(o[2] for o in out),
            "out_tok_per_s": sum(o[2] for o in out) / wall, "req_per_s": n / wall,
            "hit_rate": sum(o[1] for o in out) / max(1, prompt),
            "prompt_tokens_mean": prompt / n, "calls": len(calls), "valid_calls": valid}


async def main_async(url: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=1800)
    rows = []
    async with httpx.AsyncClient(timeout=60) as h:
        await run_mode(client, "none", 2, 2, 4)  # warm-up
        for rnd in range(a.rounds):
            for mode in MODES:
                await h.post(f"{url}/flush_cache")
                r = await run_mode(client, mode, a.requests, a.concurrency, a.max_tokens)
                r["round"] = rnd
                rows.append(r)
                print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the JSON rows and medians here")
    a = ap.parse_args()
    port = free_port()
    proc = launch_radixrt(port, a.threads)
    try:
        rows = asyncio.run(main_async(f"http://127.0.0.1:{port}", a))
    finally:
        stop_server(proc)
    summary, table = {}, []
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("out_tok_per_s", "req_per_s", "hit_rate", "prompt_tokens_mean")}
        summary[mode] = med
        calls = sum(r["calls"] for r in rs)
        valid = sum(r["valid_calls"] for r in rs)
        table.append([mode, f"{med['out_tok_per_s']:.1f}", f"{med['req_per_s']:.2f}",
                      f"{med['hit_rate']:.2f}", f"{med['prompt_tokens_mean']:.0f}",
                      f"{valid}/{calls if mode == 'required' else '-'}"])
    print(markdown_table(["mode", "out tok/s", "req/s", "hit rate", "prompt tokens",
                          "valid calls"], table), end="")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
