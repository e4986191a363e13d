"""What the HTTP server peers (llama-server, vLLM) share: their command-line options, the
concurrency a workload runs at, a free port and the warm-up request. Each peer script starts
its server, then drives it with bench/serving.py's client, as compare.py drives `radixrt
serve`."""

from __future__ import annotations

import argparse
import signal
import socket
from typing import Any

from bench.common import Workload, warmup_prompt


def workload_concurrency(w: Workload, max_concurrency: int | None = None) -> int:
    """Requests in flight at most: one per session (a chain sends one turn at a time), capped."""
    n = max(1, len(w.sessions))
    return min(n, max_concurrency) if max_concurrency else n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peer_arg_parser(description: str, model_help: str, concurrency_help: str,
                    server_args_help: str) -> argparse.ArgumentParser:
    """The options every server peer takes (compare.py's `system_command` passes them); a peer
    adds its own before parsing."""
    from bench.serving import add_sampling_args

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload-file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True, help=model_help)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-concurrency", type=int, default=None, help=concurrency_help)
    ap.add_argument("--port", type=int, default=0, help="0: a free one")
    ap.add_argument("--log", default=None, help="the server's output (default: discarded)")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--server-args", default="", help=server_args_help)
    add_sampling_args(ap)
    return ap


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so the peer's `finally` stops its server: the server runs in
    a session of its own, which compare.py's stop of the peer's process group (a timeout,
    Ctrl-C) does not reach."""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def warm_up(base_url: str, timeout_s: float, **fields: Any) -> None:
    """One short unrelated greedy request (`fields` added to its body); raises on an error."""
    import httpx

    r = httpx.post(base_url + "/v1/completions", timeout=timeout_s,
                   json={"prompt": warmup_prompt(), "max_tokens": 4, "temperature": 0,
                         "ignore_eos": True, **fields})
    r.raise_for_status()
