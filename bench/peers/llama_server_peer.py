"""Peer: llama.cpp's own server (`llama-server`), driven over HTTP by bench/serving.py's client.

    python bench/peers/llama_server_peer.py --workload-file W.json --out R.jsonl \
        --model SmolLM2.gguf --threads 2 [--max-concurrency 8] [--binary bench/.bin/llama-server]

Built by `make bench-llama-server` (bench/.bin/llama-server) from the llama.cpp that the
llama-cpp-python sdist vendors. Unlike the other peers it runs with radixrt's interpreter: it
needs no llama.cpp bindings, only the same streaming client (`serving.Client`: `/v1/completions`,
token-id prompts, greedy, `ignore_eos`, `stream_options.include_usage`) that drives
`radixrt serve`, at the same concurrency.

Per workload a fresh server (so no cache survives from one workload to the next, as radixrt's
`--flush-cache`):

    llama-server -m GGUF -np C -t T -tb T -c C*S -cb --cache-prompt --host 127.0.0.1 --port P

C = the workload's concurrency (its sessions, all in flight at once, capped by
`--max-concurrency`), so every request in flight has a slot; S = the per-slot context: the
longest prompt the workload can send plus its max_tokens, with slack for re-tokenized outputs,
rounded up to 256. Without `--kv-unified` llama-server splits `-c` evenly between its slots, hence
C*S. Continuous batching and the prompt cache are its defaults (`-cb`, `--cache-prompt` only
say so); the host-memory prompt cache (`--cache-ram`) keeps its default too. Hit rate: its
`usage.prompt_tokens_details.cached_tokens` (the prompt tokens its slot already held).
After `/health` answers, one short unrelated request warms it up.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import Workload, iter_workloads  # noqa: E402
from bench.peers.server_peer import (  # noqa: E402
    exit_on_sigterm,
    free_port,
    peer_arg_parser,
    warm_up,
    workload_concurrency,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = ROOT / "bench" / ".bin" / "llama-server"
SYSTEM = "llama-server"
CTX_ROUND = 256
# a chain's next prompt carries the previous output re-tokenized client-side, which may come out
# a few tokens longer than max_tokens; this much per turn keeps it inside the slot
RETOKENIZE_SLACK = 8


def find_binary(explicit: str | None = None) -> Path | None:
    """The llama-server to run: --binary, $LLAMA_SERVER_BIN, bench/.bin/llama-server, $PATH."""
    for cand in (explicit, os.environ.get("LLAMA_SERVER_BIN")):
        if cand:
            p = Path(cand)
            return p if p.is_file() and os.access(p, os.X_OK) else None
    if DEFAULT_BINARY.is_file() and os.access(DEFAULT_BINARY, os.X_OK):
        return DEFAULT_BINARY
    found = shutil.which("llama-server")
    return Path(found) if found else None


def unavailable_note(explicit: str | None = None) -> str:
    """'' when a llama-server binary is there, else why not (for the record's note)."""
    if find_binary(explicit) is not None:
        return ""
    where = explicit or os.environ.get("LLAMA_SERVER_BIN") or DEFAULT_BINARY.relative_to(ROOT)
    return f"not installed: {where} missing (run `make bench-llama-server`)"


def slot_context(w: Workload) -> int:
    """Tokens one slot must hold: the longest prompt + output of any turn, with slack, rounded
    up to a multiple of 256."""
    longest = 0
    for s in w.sessions:
        prompt = 0
        for k, t in enumerate(s.turns):
            if k:
                prompt += s.turns[k - 1].max_tokens + RETOKENIZE_SLACK
            prompt += len(t.append)
            longest = max(longest, prompt + t.max_tokens)
    need = longest + RETOKENIZE_SLACK
    return max(CTX_ROUND, -(-need // CTX_ROUND) * CTX_ROUND)


def server_command(binary: str | os.PathLike[str], model: str, parallel: int, threads: int,
                   ctx_per_slot: int, port: int, host: str = "127.0.0.1",
                   extra: Sequence[str] = ()) -> list[str]:
    """`extra`: flags appended after ours (llama-server takes the last value of a repeated
    flag, so they can also override one of ours)."""
    return [str(binary), "-m", str(model), "-np", str(parallel), "-t", str(threads),
            "-tb", str(threads), "-c", str(parallel * ctx_per_slot), "-cb", "--cache-prompt",
            "--host", host, "--port", str(port), *extra]


def version(binary: str | os.PathLike[str]) -> str:
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()
             if ln.strip().startswith(("version", "built with"))]
    return "; ".join(lines) or "?"


def launch(cmd: list[str], base_url: str, log: Any) -> subprocess.Popen:
    from bench.serving import stop_server, wait_healthy

    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    try:
        wait_healthy(base_url, timeout_s=300, proc=proc)
    except BaseException:
        stop_server(proc)
        raise
    return proc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = peer_arg_parser(__doc__.split("\n\n")[0], "GGUF file",
                         "requests in flight at most (= -np); default: every session at once",
                         "extra llama-server flags, one shell-quoted string (e.g. '-fa on')")
    ap.add_argument("--binary", default=None, help="default: bench/.bin/llama-server")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from bench.serving import sampling_fields

    a = parse_args(argv)
    exit_on_sigterm()
    binary = find_binary(a.binary)
    if binary is None:
        raise SystemExit(unavailable_note(a.binary))
    from bench.datasets import default_tokenizer
    from bench.serving import Client, run, stop_server

    tok = default_tokenizer(a.model)
    ver = version(binary)
    print(f"{binary}: {ver}", flush=True)
    log = open(a.log, "ab") if a.log else subprocess.DEVNULL
    try:
        for w in iter_workloads(a.workload_file):
            parallel = workload_concurrency(w, a.max_concurrency)
            ctx = slot_context(w)
            port = a.port or free_port()
            base_url = f"http://127.0.0.1:{port}"
            cmd = server_command(binary, a.model, parallel, a.threads, ctx, port,
                                 extra=shlex.split(a.server_args))
            print("$ " + " ".join(cmd), flush=True)
            if log is not subprocess.DEVNULL:
                log.write(("\n$ " + " ".join(cmd) + "\n").encode())
                log.flush()
            t = time.perf_counter()
            proc = launch(cmd, base_url, log)
            try:
                load_s = time.perf_counter() - t
                warm_up(base_url, 120, cache_prompt=False)
                client = Client(base_url, "default", "completions", "ids", tokenizer=tok,
                                sampling=sampling_fields(a))
                run(client, [w], SYSTEM, a.out, parallel, a.progress, threads=a.threads,
                    load_s=load_s, llama_server=ver, parallel=parallel, ctx_per_slot=ctx,
                    server_cmd=cmd[1:])
            finally:
                stop_server(proc)
    finally:
        if log is not subprocess.DEVNULL:
            log.close()


if __name__ == "__main__":
    main()
