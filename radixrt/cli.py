"""`radixrt serve ...` / `radixrt router ...` (also `python -m radixrt ...`): every flag is a
`ServerArgs` field (the router takes the ones that concern it, `ROUTER_FIELDS`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from collections.abc import Sequence

from radixrt.config import ServerArgs

# Short names users know from SGLang / vLLM.
ALIASES = {"model_path": ["--model", "--model-path"],
           "worker_urls": ["--worker-url", "--worker-urls"]}

# `radixrt router`: where it listens, its API key, the tokenizer it routes with (the workers'
# model), the routing policy and the workers.
ROUTER_FIELDS = ("model_path", "tokenizer_path", "host", "port", "api_key", "log_level",
                 "max_request_bytes", "routing_policy", "routing_cache_threshold",
                 "routing_balance_factor", "routing_max_tree_tokens",
                 "worker_urls", "worker_api_key", "health_check_interval_s")


def _base_type(tp: object) -> type:
    """`int | None` → int; `str` → str."""
    if isinstance(tp, str):
        tp = eval(tp, {}, {})  # annotations are strings under `from __future__ import annotations`
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp  # type: ignore[return-value]


def add_server_args(parser: argparse.ArgumentParser,
                    only: Sequence[str] | None = None) -> None:
    for f in dataclasses.fields(ServerArgs):
        if only is not None and f.name not in only:
            continue
        flags = ALIASES.get(f.name, [f"--{f.name.replace('_', '-')}"])
        help_text = f.metadata.get("help", "")
        tp = _base_type(f.type)
        if tp is bool:
            parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        elif typing.get_origin(tp) is tuple:
            parser.add_argument(*flags, dest=f.name, nargs="+", action="extend", default=[],
                                metavar="URL", help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, type=tp, default=f.default,
                                metavar=f.name.upper(),
                                help=f"{help_text} (default: {f.default})")


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)
                         if hasattr(ns, f.name)})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_server_args(serve)
    router = sub.add_parser("router", help="route OpenAI API requests over radixrt servers, "
                                           "cache-aware (README: Scaling out)")
    add_server_args(router, ROUTER_FIELDS)
    ns = parser.parse_args(argv)
    try:
        args = args_from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.command == "serve":
        from radixrt.server.http import serve as run_server

        sys.exit(run_server(args))
    if ns.command == "router":
        if not args.worker_urls:
            logging.getLogger("radixrt.router").warning(
                "no --worker-url given: add workers with POST /workers")
        from radixrt.router.app import serve as run_router

        sys.exit(run_router(args))


if __name__ == "__main__":
    main()
