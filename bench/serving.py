"""Drive any OpenAI-compatible server with the generated workloads; SGLang bench_serving metrics.

    radixrt serve --port 30000 &
    python bench/serving.py --base-url http://127.0.0.1:30000 --preset full --workloads gsp
    python bench/serving.py --base-url http://127.0.0.1:8000 --endpoint chat --prompt-format text \
        --model HuggingFaceTB/SmolLM2-135M-Instruct          # e.g. `transformers serve`

Requests stream (`stream: true`, `stream_options.include_usage`), greedy (`temperature: 0`),
`max_tokens` from the workload and `ignore_eos: true` (radixrt, SGLang, vLLM and llama.cpp's server
honour it; `--no-ignore-eos` leaves it out). Prompts go to `/v1/completions` as token ids
(`--prompt-format ids`, the default) or as text decoded from the ids (`text`), or to
`/v1/chat/completions` as one user message holding that text (`--endpoint chat`, for servers
without a completions endpoint).

Sessions start at their arrival (all at once, or `--request-rate` Poisson), at most
`--max-concurrency` requests in flight; a chain's next turn is sent when the previous one
finished, with the generated text appended (re-tokenized client-side with the model's tokenizer in
ids mode). Per request: send time, the time of every streamed chunk (each non-empty chunk counts
as one for ITL, as in bench_serving), and `usage` (prompt, completion and
`prompt_tokens_details.cached_tokens`). Metrics: `bench.metrics.compute_metrics`. Results: one
JSON line per workload in `--out`, records included.
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
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Callable  # noqa: E402
from typing import Any  # noqa: E402

import orjson  # noqa: E402

from bench.common import (  # noqa: E402
    RequestRecord,
    Workload,
    load_workloads,
    progress_bar,
    write_result,
)
from bench.metrics import compute_metrics, run_optimal_hit_rate  # noqa: E402


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """JSON objects of an SSE stream's `data:` lines, up to `[DONE]`."""
    async for line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield orjson.loads(data)


def apply_event(rec: RequestRecord, ev: dict[str, Any], t: float, chat: bool) -> str:
    """Fold one streamed event into the record; returns the text it carried."""
    if "error" in ev and not ev.get("choices"):
        err = ev["error"]
        rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return ""
    text = ""
    for ch in ev.get("choices") or []:
        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        if piece:
            text += piece
    if text:
        rec.add_chunk(t, 1)
    usage = ev.get("usage")
    if usage:
        rec.prompt_len = int(usage.get("prompt_tokens") or rec.prompt_len)
        if usage.get("completion_tokens") is not None:
            rec.output_len = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    return text


def add_sampling_args(ap: Any) -> None:
    """`--temperature` / `--top-p`: sample instead of greedy decoding (every HTTP-driven
    system of a comparison gets the same fields)."""
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top_p of every request")


def sampling_fields(a: Any) -> dict[str, Any]:
    """The request fields `add_sampling_args` asked for (empty: greedy, the default)."""
    out: dict[str, Any] = {}
    if a.temperature > 0:
        out["temperature"] = a.temperature
    if a.top_p < 1.0:
        out["top_p"] = a.top_p
    return out


class Client:
    def __init__(self, base_url: str, model: str = "default", endpoint: str = "completions",
                 prompt_format: str = "ids", api_key: str | None = None, ignore_eos: bool = True,
                 tokenizer: Any = None, timeout_s: float = 600.0,
                 sampling: dict[str, Any] | None = None):
        """`sampling`: request fields sent with every request instead of greedy
        (`{"temperature": 0.7, "top_p": 0.9}`, `sampling_fields`)."""
        self.url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat"
                                           else "/v1/completions")
        self.chat = endpoint == "chat"
        self.model = model
        self.prompt_format = "text" if self.chat else prompt_format
        self.ignore_eos = ignore_eos
        self.tok = tokenizer
        self.sampling = dict(sampling or {})
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.http: Any = None  # an aiohttp session, opened inside the running loop

    def session(self) -> Any:
        """aiohttp, as SGLang's bench_serving: it shares the server's cores here, and httpx
        spent about twice its CPU per streamed chunk (stop 60), most of it in the stream. One
        connection per request (no keep-alive, as bench_serving's session per request):
        llama-server closes idle connections, and aiohttp would send the next request into one
        it had closed ("Can not write request body")."""
        if self.http is None:
            import aiohttp

            self.http = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=1024, force_close=True),
                read_bufsize=2**16)
        return self.http

    def body(self, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                             "stream": True, "stream_options": {"include_usage": True},
                             **self.sampling}
        if self.chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if self.ignore_eos:
            b["ignore_eos"] = True
        return b

    async def request(self, prompt: list[int] | str, max_tokens: int, rec: RequestRecord,
                      now: Callable[[], float]) -> str:
        text = ""
        req = self.body(prompt, max_tokens)
        async with self.session().post(self.url, json=req) as r:
            if r.status != 200:
                body = (await r.read()).decode(errors="replace")
                if r.status in (400, 422) and "ignore_eos" in body and "ignore_eos" in req:
                    # a strict server (e.g. `transformers serve`): go on without it, say so
                    if self.ignore_eos:
                        self.ignore_eos = False
                        print("server rejects ignore_eos: requests may stop at EOS",
                              file=sys.stderr, flush=True)
                    rec.arrival = now()
                    return await self.request(prompt, max_tokens, rec, now)
                rec.error = f"HTTP {r.status}: {body[:300]}"
                rec.end = now()
                return ""
            async for ev in sse_events(line.decode() async for line in r.content):
                text += apply_event(rec, ev, now(), self.chat)
        rec.end = now()
        if not rec.chunks and not rec.error:
            rec.error = "no output"
        return text

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()
            self.http = None


async def drive_server(client: Client, workload: Workload, max_concurrency: int | None = None,
                       progress: bool = False) -> list[RequestRecord]:
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    bar = progress_bar(workload.num_requests, workload.name, progress)

    async def session(s: Any) -> None:
        await asyncio.sleep(max(0.0, s.arrival - now()))
        ids: list[int] = []
        text = ""
        out_ids: list[int] = []
        out_text = ""
        for k, turn in enumerate(s.turns):
            ids = (ids + out_ids if k else []) + turn.append
            if client.prompt_format == "ids":
                prompt: list[int] | str = ids
            else:
                text = (text + out_text if k else "") + client.tok.decode(turn.append)
                prompt = text
            if sem is not None:
                await sem.acquire()
            rec = RequestRecord(s.id, k, len(ids), turn.max_tokens, now())
            try:
                out_text = await client.request(prompt, turn.max_tokens, rec, now)
            except Exception as e:
                rec.error = f"{type(e).__name__}: {e}"
                rec.end = now()
            finally:
                if sem is not None:
                    sem.release()
            out_ids = (list(client.tok.encode(out_text, add_special_tokens=False))
                       if client.tok is not None else [])
            rec.output_ids = out_ids
            records.append(rec)
            bar.update(1)
            if not rec.ok:
                return

    await asyncio.gather(*(session(s) for s in workload.sessions))
    bar.close()
    records.sort(key=lambda r: (r.session, r.turn))
    return records


def wait_healthy(base_url: str, timeout_s: float = 300.0, proc: subprocess.Popen | None = None,
                 ) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s} s")


def launch_radixrt(port: int, threads: int, extra: list[str] | None = None,
                   log: Any = subprocess.DEVNULL) -> subprocess.Popen:
    """`radixrt serve` on 127.0.0.1:port in its own process group (stop with `stop_server`)."""
    cmd = [sys.executable, "-m", "radixrt", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--num-threads", str(threads), "--log-level", "warning", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(client: Client, workloads: list[Workload], system: str, out: str | None,
        max_concurrency: int | None, progress: bool, flush_url: str | None = None,
        **extra: Any) -> list[dict[str, Any]]:
    import httpx

    results = []
    for w in workloads:
        if flush_url:
            try:
                httpx.post(flush_url, timeout=30)
            except httpx.HTTPError:
                pass
        records = asyncio.run(_drive_and_close(client, w, max_concurrency, progress))
        m = compute_metrics(records)
        opt = run_optimal_hit_rate(w, records) if client.tok is not None else None
        res = {"workload": w.name, "system": system, "metrics": m, "optimal_hit_rate": opt}
        if out:
            write_result(out, w.name, system, records, metrics=m, optimal_hit_rate=opt,
                         **extra)
        results.append({**res, "records": records})
        hr = m.get("hit_rate")
        if m.get("completed"):
            print(f"{w.name:11s} {m['completed']:3d} req {m['duration_s']:7.2f} s  req/s "
                  f"{m['request_throughput']:.2f}  in {m['input_tok_per_s']:.1f}  out "
                  f"{m['output_tok_per_s']:.1f}  total {m['total_tok_per_s']:.1f} tok/s  TTFT "
                  f"mean/p50/p99 {m['ttft_s']['mean']:.3f}/{m['ttft_s']['p50']:.3f}/"
                  f"{m['ttft_s']['p99']:.3f} s  ITL p50 {m['itl_s']['p50'] * 1e3:.1f} ms  TPOT "
                  f"p50 {m['tpot_s']['p50'] * 1e3:.1f} ms  E2E p50 {m['e2e_s']['p50']:.3f} s  "
                  f"hit {None if hr is None else round(hr, 3)} (optimal "
                  f"{None if opt is None else round(opt, 3)})", flush=True)
        else:
            errs = {r.error for r in records if r.error}
            print(f"{w.name}: no request completed; errors: {sorted(errs)[:3]}", flush=True)
    return results


async def _drive_and_close(client: Client, w: Workload, mc: int | None, progress: bool):
    # a fresh session per event loop (asyncio.run closes the loop each time)
    try:
        return await drive_server(client, w, mc, progress)
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default="default", help="the `model` field of requests")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--no-ignore-eos", action="store_true")
    add_sampling_args(ap)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--workloads", nargs="*", default=None)
    ap.add_argument("--workload-file", default=None, help="instead of --preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-rate", type=float, default=None,
                    help="Poisson session arrivals per second (default: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--system", default="server", help="label in the results")
    ap.add_argument("--flush-cache", action="store_true",
                    help="POST /flush_cache before each workload (radixrt)")
    ap.add_argument("--launch-radixrt", action="store_true",
                    help="start `radixrt serve` on --base-url's port for the run")
    ap.add_argument("--threads", type=int, default=2, help="with --launch-radixrt")
    ap.add_argument("--server-args", default="",
                    help="extra `radixrt serve` flags with --launch-radixrt, e.g. "
                         "'--disable-radix-cache'")
    ap.add_argument("--out", default=None, help="JSON lines (appended)")
    ap.add_argument("--server-log", default=None,
                    help="with --launch-radixrt: append the server's output here")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()

    from bench.datasets import default_tokenizer, make_preset

    tok = default_tokenizer()
    if a.workload_file:
        ws = load_workloads(a.workload_file)
        if a.workloads:
            ws = [w for w in ws if w.name in a.workloads]
        if a.request_rate:
            ws = [w.with_arrivals(a.request_rate) for w in ws]
    else:
        ws = make_preset(a.preset, a.seed, a.workloads, tok, a.request_rate)
    proc = None
    if a.launch_radixrt:
        port = int(a.base_url.rsplit(":", 1)[1].split("/")[0])
        log = open(a.server_log, "ab") if a.server_log else subprocess.DEVNULL
        proc = launch_radixrt(port, a.threads, a.server_args.split(), log)
        if a.out:  # what the server resolved (dtype, quantization, ...), beside the records
            import httpx

            info = httpx.get(a.base_url.rstrip("/") + "/get_server_info", timeout=30)
            info.raise_for_status()
            Path(a.out).with_suffix(".server_info.json").write_text(info.text)
    try:
        client = Client(a.base_url, a.model, a.endpoint, a.prompt_format, a.api_key,
                        not a.no_ignore_eos, tok, sampling=sampling_fields(a))
        run(client, ws, a.system, a.out, a.max_concurrency, not a.no_progress,
            a.base_url.rstrip("/") + "/flush_cache" if a.flush_cache else None)
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()
