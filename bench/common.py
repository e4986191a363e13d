"""What every benchmark driver shares: the workload file, request records, the sequential driver.

Standard library only: the peers (`bench/peers/*.py`) import this module from their own
environment (`.venv-bench`), which has no radixrt.

A workload is a list of *sessions*. A session is a chain of turns; turn k's prompt is

    prompt_k = prompt_{k-1} + output_{k-1} + turns[k].append        (prompt_{-1} = output_{-1} = [])

so independent requests (gsp, few-shot, random) are one-turn sessions, and dependent ones
(multi-turn chat, agent calls) are chains whose next turn can only be sent once the previous one
has finished, with the tokens actually generated. A session's first turn arrives at its `arrival`
(seconds after the start); a later turn arrives when the previous one finishes.

Every driver produces one `RequestRecord` per request, with times in seconds since the start of
the run (`time.perf_counter()` based), and the generated token ids.

The bench scripts' reports share `markdown_table`, `cpu_name` and `common_prefix` from here.
"""

from __future__ import annotations

import heapq
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("radixrt", "radixrt-no-radix", "radixrt-fcfs", "hf-generate",
           "hf-continuous-batching", "llama.cpp", "llama-server", "vllm")


# -- workloads ---------------------------------------------------------------------------------------
@dataclass
class Turn:
    append: list[int]  # tokens added after the previous prompt and its output
    max_tokens: int  # exactly this many tokens are generated (EOS ignored)


@dataclass
class Session:
    id: int
    arrival: float  # seconds after the start when the first turn is sent
    turns: list[Turn]


@dataclass
class Workload:
    name: str
    seed: int
    params: dict[str, Any]
    sessions: list[Session]
    description: str = ""
    # 1 - distinct/total prompt tokens, with every generated token assumed new (see datasets.py)
    optimal_hit_rate_estimate: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        sessions = [Session(s["id"], float(s["arrival"]),
                            [Turn(list(t["append"]), int(t["max_tokens"])) for t in s["turns"]])
                    for s in d["sessions"]]
        return cls(d["name"], int(d["seed"]), dict(d.get("params", {})), sessions,
                   d.get("description", ""), float(d.get("optimal_hit_rate_estimate", 0.0)))

    def with_arrivals(self, request_rate: float | None, seed: int | None = None) -> Workload:
        """A copy whose sessions arrive all at once (`None`/inf) or as a Poisson process."""
        return Workload(self.name, self.seed, {**self.params, "request_rate": request_rate},
                        [Session(s.id, a, s.turns) for s, a in
                         zip(self.sessions, poisson_arrivals(len(self.sessions), request_rate,
                                                             self.seed if seed is None else seed),
                             strict=True)],
                        self.description, self.optimal_hit_rate_estimate)

    def head(self, n_sessions: int) -> Workload:
        """The first `n_sessions` sessions only (for capped runs)."""
        return Workload(self.name, self.seed, {**self.params, "capped_sessions": n_sessions},
                        self.sessions[:n_sessions], self.description,
                        self.optimal_hit_rate_estimate)


def poisson_arrivals(n: int, request_rate: float | None, seed: int) -> list[float]:
    """Arrival offsets: all zero for `request_rate` None/inf/<=0, else exponential gaps."""
    if request_rate is None or request_rate <= 0 or request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 7919)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def save_workloads(path: str | os.PathLike[str], workloads: Sequence[Workload]) -> None:
    Path(path).write_text(json.dumps([w.to_dict() for w in workloads]))


def load_workloads(path: str | os.PathLike[str]) -> list[Workload]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = [data]
    return [Workload.from_dict(d) for d in data]


def session_prompts(session: Session, outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """The prompts of a session's turns as sent, given each turn's generated ids."""
    prompts: list[list[int]] = []
    prev: list[int] = []
    for k, turn in enumerate(session.turns):
        if k > len(outputs):
            break
        prev = (prev + list(outputs[k - 1]) if k else []) + list(turn.append)
        prompts.append(prev)
    return prompts


# -- request records ----------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    session: int
    turn: int
    prompt_len: int
    max_tokens: int
    arrival: float  # when it was sent (s since start)
    end: float = float("nan")  # when the last token arrived
    first_token: float = float("nan")
    # one entry per streamed chunk: (time, number of new tokens in it)
    chunks: list[tuple[float, int]] = field(default_factory=list)
    output_len: int = 0
    cached_tokens: int | None = None  # prompt tokens served from a cache (None: not reported)
    output_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def add_chunk(self, t: float, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        if not self.chunks:
            self.first_token = t
        self.chunks.append((t, n_tokens))
        self.output_len += n_tokens
        self.end = t

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        d = dict(d)
        d["chunks"] = [(float(t), int(n)) for t, n in d.get("chunks", [])]
        for k in ("end", "first_token"):
            d[k] = float("nan") if d.get(k) is None else float(d[k])
        return cls(**d)


def write_result(out: str | os.PathLike[str], workload: str, system: str,
                 records: Sequence[RequestRecord], **extra: Any) -> None:
    """Append one workload's result as a JSON line (a killed run keeps the finished ones)."""
    line = {"workload": workload, "system": system,
            "records": [r.to_dict() for r in records], **extra}
    with open(out, "a") as f:
        f.write(json.dumps(line, allow_nan=True) + "\n")
        f.flush()


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        d["records"] = [RequestRecord.from_dict(r) for r in d.get("records", [])]
        out.append(d)
    return out


# -- drivers ------------------------------------------------------------------------------------------
# generate(prompt_ids, max_tokens, on_tokens) -> (output_ids, cached_tokens or None).
# `on_tokens(n)` is called as tokens appear (the driver stamps the time).
GenerateFn = Callable[[list[int], int, Callable[[int], None]], tuple[list[int], int | None]]


def run_sequential(workload: Workload, generate: GenerateFn, budget_s: float | None = None,
                   progress: Callable[[], None] | None = None) -> tuple[list[RequestRecord], str]:
    """Serve a workload one request at a time, in arrival order (FIFO), like a single-stream
    server. A chain's next turn arrives when its previous turn finished. With `budget_s`, no new
    request starts after that many seconds; the rest are reported in the returned note."""
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    heap: list[tuple[float, int, int]] = [(s.arrival, s.id, 0) for s in workload.sessions]
    heapq.heapify(heap)
    by_id = {s.id: s for s in workload.sessions}
    prev_prompt: dict[int, list[int]] = {}
    prev_out: dict[int, list[int]] = {}
    records: list[RequestRecord] = []
    while heap:
        if budget_s is not None and now() > budget_s:
            break
        arrival, sid, k = heapq.heappop(heap)
        wait = arrival - now()
        if wait > 0:
            time.sleep(wait)
        s = by_id[sid]
        turn = s.turns[k]
        prompt = (prev_prompt[sid] + prev_out[sid] if k else []) + turn.append
        rec = RequestRecord(sid, k, len(prompt), turn.max_tokens, arrival)
        try:
            out, cached = generate(prompt, turn.max_tokens, lambda n, r=rec: r.add_chunk(now(), n))
            rec.output_ids = list(out)
            rec.cached_tokens = cached
            rec.end = now()
        except Exception as e:  # a failed request is recorded, the run goes on
            rec.error = f"{type(e).__name__}: {e}"
            rec.end = now()
        records.append(rec)
        if progress:
            progress()
        if rec.ok and k + 1 < len(s.turns):
            prev_prompt[sid], prev_out[sid] = prompt, rec.output_ids
            heapq.heappush(heap, (rec.end, sid, k + 1))
    note = ""
    if heap:
        note = (f"stopped after the {budget_s:.0f} s budget: {len(records)} of "
                f"{workload.num_requests} requests served")
    return records, note


def run_peer(a: Any, system: str, generate: GenerateFn,
             before_workload: Callable[[], None] | None = None, **extra: Any) -> None:
    """A one-request-at-a-time peer's whole run, `a` being its `peer_argparser` arguments: one
    warm-up request, then every workload of `a.workload_file` through `run_sequential` (after
    `before_workload()`), each appended to `a.out` with `threads` and `extra`."""
    generate(warmup_prompt(), 4, lambda n: None)
    for w in iter_workloads(a.workload_file):
        if before_workload is not None:
            before_workload()
        bar = progress_bar(w.num_requests, f"{system} {w.name}", a.progress)
        records, note = run_sequential(w, generate, a.budget_s, bar.update)
        bar.close()
        write_result(a.out, w.name, system, records, note=note, threads=a.threads, **extra)


def warmup_prompt(n: int = 64, seed: int = 12345) -> list[int]:
    """Token ids unrelated to any workload (the first forward passes allocate and tune)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def peer_argparser(description: str):
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload-file", required=True, help="JSON list of workloads (datasets.py)")
    ap.add_argument("--out", required=True, help="JSON lines, one per workload (appended)")
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="per workload: start no request after this many seconds")
    ap.add_argument("--progress", action="store_true", help="tqdm progress bar if installed")
    return ap


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar when available and enabled, else a no-op with the same `update`/`close`."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:
            pass

    class _Null:
        def update(self, n: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Null()


def iter_workloads(path: str, names: Iterable[str] | None = None) -> list[Workload]:
    ws = load_workloads(path)
    if names:
        keep = set(names)
        ws = [w for w in ws if w.name in keep]
    return ws


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- reports ------------------------------------------------------------------------------------------
def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo; else what `platform` says, else "?"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the header line, the `|---|` rule, one line per row; cells are `str()`
    of the values, with `|` escaped so a cell never splits. Lines end with a newline."""

    def line(cells: Iterable[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |\n"

    out = [line(headers), "|" + "---|" * len(headers) + "\n"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, headers {len(headers)}")
        out.append(line(row))
    return "".join(out)
