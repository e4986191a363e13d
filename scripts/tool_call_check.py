"""How a real model does at tool calling through `radixrt serve` (default: SmolLM2-135M, whose
template takes no tools, so the fallback block): for a few questions, `tool_choice` auto /
required / named, greedy, all requests at once. Reports per mode how many answers carried a
call, how many calls had arguments valid against the tool's schema, and the latency.

    python scripts/tool_call_check.py [--model PATH] [--max-tokens 128]
    python scripts/tool_call_check.py --parser-speed   # the streaming parser's cost, no server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench/
from bench.function_tools import CONVERT_CURRENCY, UNIT, function_tool, schemas  # noqa: E402

TOOLS = [
    function_tool("get_weather", "Current weather in a city",
                  {"city": {"type": "string", "description": "city name"}, "unit": UNIT}),
    CONVERT_CURRENCY,
]
SCHEMAS = schemas(TOOLS)
QUESTIONS = [
    "What's the weather like in Paris right now, in celsius?",
    "How warm is it in Tokyo? Use fahrenheit.",
    "Convert 250 US dollars to euros.",
    "How many yen is 40 pounds?",
    "Is it raining in London?",
    "I need 1000 CHF in USD, how much is that?",
]
MODES = {"auto": "auto", "required": "required",
         "named": {"type": "function", "function": {"name": "get_weather"}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valid(name: str, arguments: str) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return True


async def run(url: str, max_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)

    async def one(mode: str, q: str) -> tuple[str, float, list[tuple[str, str]], str]:
        t = time.perf_counter()
        r = await client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": q}], tools=TOOLS,
            tool_choice=MODES[mode], parallel_tool_calls=False, max_tokens=max_tokens,
            temperature=0)
        ch = r.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        return mode, time.perf_counter() - t, calls, ch.message.content or ""

    results = await asyncio.gather(*(one(m, q) for m in MODES for q in QUESTIONS))
    for mode in MODES:
        rows = [r for r in results if r[0] == mode]
        with_call = sum(1 for r in rows if r[2])
        ok = sum(1 for r in rows for c in r[2] if valid(*c))
        lat = sorted(r[1] for r in rows)
        print(f"{mode:9s} answers with a call {with_call}/{len(rows)}, schema-valid calls "
              f"{ok}/{sum(len(r[2]) for r in rows)}, latency median {lat[len(lat) // 2]:.1f} s")
        for r in rows[:2]:
            print(f"    e.g. calls={r[2]} content={r[3][:80]!r}")


def parser_speed(reps: int = 7, loops: int = 200) -> None:
    """µs per 4-character delta of a two-call hermes text through `ToolCallStream` (median of
    `reps` runs)."""
    import statistics

    from radixrt.server.tool_parsers import HermesParser
    from radixrt.server.tools import ToolCallStream

    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris", "unit": "c", "days": [1, 2, 3], "note": "a \\"quoted\\" word"}}\n'
            '</tool_call>') * 2
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(loops):
            ts = ToolCallStream(HermesParser())
            for p in pieces:
                ts.feed(p)
            ts.finish()
        runs.append((time.perf_counter() - t) / (loops * len(pieces)) * 1e6)
    print(f"{len(text)} characters in {len(pieces)} deltas: median {statistics.median(runs):.1f}"
          f" us per delta (min {min(runs):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parser-speed", action="store_true")
    a = ap.parse_args()
    if a.parser_speed:
        parser_speed()
        return
    port = free_port()
    cmd = [sys.executable, "-m", "radixrt", "serve", "--port", str(port), "--log-level",
           "warning"] + (["--model", a.model] if a.model else [])
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        asyncio.run(run(url, a.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
