"""`radixrt serve ...` (also `python -m radixrt serve`): every flag is a `ServerArgs` field."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Sequence

from radixrt.config import ServerArgs

# Short names users know from SGLang / vLLM.
ALIASES = {"model_path": ["--model", "--model-path"]}


def _base_type(tp: object) -> type:
    """`int | None` → int; `str` → str."""
    if isinstance(tp, str):
        tp = eval(tp, {}, {})  # annotations are strings under `from __future__ import annotations`
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp  # type: ignore[return-value]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServerArgs):
        flags = ALIASES.get(f.name, [f"--{f.name.replace('_', '-')}"])
        help_text = f.metadata.get("help", "")
        tp = _base_type(f.type)
        if tp is bool:
            parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, type=tp, default=f.default,
                                metavar=f.name.upper(),
                                help=f"{help_text} (default: {f.default})")


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_server_args(serve)
    ns = parser.parse_args(argv)
    try:
        args = args_from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    if ns.command == "serve":
        from radixrt.server.http import serve as run_server

        sys.exit(run_server(args))


if __name__ == "__main__":
    main()
