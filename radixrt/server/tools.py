"""Tool calling on the chat endpoint: the request's `tools` / `tool_choice` /
`parallel_tool_calls` (validated, errors name the field), how tools reach the prompt (the
chat template when it takes `tools`, else the fallback block below), the grammar that enforces
`required` and a named function, and the response: `message.tool_calls` or streamed
`delta.tool_calls`, with `finish_reason: "tool_calls"`.

Fallback format (templates without `tools`): a system block lists the functions as JSON, one
per line, and asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
hermes format, parsed by `HermesParser`); assistant `tool_calls` in the history are rendered
as such blocks, `tool` messages as user messages wrapping the result in
`<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixrt.server.protocol import bad
from radixrt.server.tool_parsers import (
    TOOL_PARSERS,
    ArgsDelta,
    CallStart,
    ContentDelta,
    Event,
    HermesParser,
    JsonArrayCallParser,
    NamedCallParser,
    ToolCallParser,
)

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tool settings. `choice` is none | auto | required | function (then
    `function` names it); `tools` are normalized `{"type": "function", "function": {"name",
    "description"?, "parameters"}}` entries, in request order, names unique."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"]["parameters"]
        raise KeyError(name)

    @property
    def constrained(self) -> bool:
        """`required` and a named function are enforced by the grammar."""
        return self.choice in ("required", "function")

    def grammar_schema(self) -> str | None:
        """The JSON schema (as text) the output must follow, or None (`auto` / `none`).

        Named function: its `parameters` (the output is the arguments object). `required`: an
        array of `{"name": <one tool's name>, "arguments": <that tool's parameters>}`, anyOf
        over the tools, at least one item, at most one without `parallel_tool_calls`."""
        if self.choice == "function":
            assert self.function is not None
            return json.dumps(self.parameters(self.function))
        if self.choice != "required":
            return None
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "arguments": self.parameters(name)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name in self.names]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)

    def parser(self, family: type[ToolCallParser]) -> ToolCallParser | None:
        """A fresh parser for one choice's output (None: `none`, the text is content)."""
        if self.choice == "function":
            assert self.function is not None
            return NamedCallParser(self.function)
        if self.choice == "required":
            return JsonArrayCallParser()
        if self.choice == "auto":
            return family()
        return None


def _tool(i: int, t: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise bad(where, f"'{where}' must be an object")
    if t.get("type", "function") != "function":
        raise bad(f"{where}.type", f"'{where}.type' must be 'function', got {t.get('type')!r}")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", f"'{where}.function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(f"{where}.function.name", f"'{where}.function.name' must be 1-64 letters, "
                                            f"digits, '_', '-', '.' or ':', got {name!r:.80}")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad(f"{where}.function.description",
                  f"'{where}.function.description' must be a string")
    params = fn.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise bad(f"{where}.function.parameters",
                  f"'{where}.function.parameters' must be a JSON schema object")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.function.strict", f"'{where}.function.strict' must be a boolean")
    out: dict[str, Any] = {"name": name}
    if desc is not None:
        out["description"] = desc
    out["parameters"] = params
    return {"type": "function", "function": out}


def tool_request_from(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tool settings; None when it has no tools (an empty list is none).
    Errors (HTTP 400) name the field: a malformed tool, duplicate names, an unknown
    `tool_choice`, a function `tool_choice` does not find among `tools`, `tool_choice`
    without `tools`."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad("tools", "'tools' must be a list of function tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw or []))
    names = [t["function"]["name"] for t in tools]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise bad(f"tools[{i}].function.name", f"duplicate function name {n!r} in 'tools'")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    choice = body.get("tool_choice")
    if choice is not None and not tools:
        raise bad("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
    if not tools:
        return None
    function = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise bad("tool_choice", f"'tool_choice' names function {name!r}, which is not "
                                     f"in 'tools' ({', '.join(names)})")
        choice, function = "function", name
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice", f"'tool_choice' must be 'none', 'auto', 'required' or a "
                                 f"function object, got {choice!r:.60}")
    return ToolRequest(tools, choice, function, parallel if parallel is not None else True)


# -- the prompt ----------------------------------------------------------------------------------
def parser_for_template(template: Any) -> str:
    """The tool-call parser a chat template's markers point to (`--tool-call-parser auto`):
    mistral for `[TOOL_CALLS]`, llama3_json for `<|python_tag|>` / Llama 3 `ipython`, else
    hermes (`<tool_call>`, and the fallback format)."""
    if isinstance(template, dict):
        text = "\n".join(str(v) for v in template.values())
    else:
        text = template if isinstance(template, str) else ""
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "ipython" in text):
        return "llama3_json"
    return "hermes"


def fallback_block(treq: ToolRequest) -> str:
    """The system text that lists the functions for a template without `tools`."""
    lines = [json.dumps(t, ensure_ascii=False) for t in treq.tools]
    one = "" if treq.parallel else " Call at most one function per answer."
    return ("You can call functions to help answer. The functions, one JSON object per "
            "line:\n" + "\n".join(lines) + "\n\nTo call a function, reply with a block like "
            "this for each call (arguments as a JSON object):\n"
            f"{HermesParser.start}\n"
            '{"name": "<function name>", "arguments": {"<parameter>": <value>}}\n'
            f"{HermesParser.end}\n" + one.strip()).rstrip()


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    obj = {"name": fn.get("name", ""), "arguments": args}
    return f"{HermesParser.start}\n{json.dumps(obj, ensure_ascii=False)}\n{HermesParser.end}"


def prompt_messages(messages: list[dict[str, Any]], treq: ToolRequest | None,
                    template_takes_tools: bool,
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. A template that takes `tools` gets them and
    the history as is; otherwise the tools become the fallback system block and the history's
    tool calls and results become text (see the module docstring)."""
    if template_takes_tools:
        return messages, list(treq.tools) if treq is not None else None
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            text = f"{m['content']}\n{blocks}" if m["content"] else blocks
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = text
        elif m.get("role") == "tool":
            m = {"role": "user",
                 "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if treq is not None:
        block = fallback_block(treq)
        if out and out[0].get("role") == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


# -- the response --------------------------------------------------------------------------------
class _Remover:
    """Removes given strings (special tokens' text) from a stream, holding back a suffix that
    could still become one."""

    def __init__(self, strings: tuple[str, ...]):
        self.strings = tuple(s for s in strings if s)
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> str:
        buf = self._buf + text
        for s in self.strings:
            buf = buf.replace(s, "")
        keep = 0
        if not final:
            for s in self.strings:
                for n in range(min(len(s) - 1, len(buf)), keep, -1):
                    if buf.endswith(s[:n]):
                        keep = n
                        break
        self._buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]


class ToolCallStream:
    """One choice's generated text → OpenAI chat deltas (`feed`, `finish`), and the same
    content and calls as one message (`message`). Calls get ids as they start; without
    `parallel_tool_calls` only the first call is kept. `remove`: special tokens' text the
    parser does not want (when special tokens are kept in the text for its markers)."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True,
                 remove: tuple[str, ...] = ()):
        self.parser = parser
        self.max_calls = None if parallel else 1
        self._remover = _Remover(remove) if remove else None
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._remover is not None:
            text = self._remover.feed(text)
        return self._deltas(self.parser.feed(text) if text else [])

    def finish(self) -> list[dict[str, Any]]:
        events: list[Event] = []
        if self._remover is not None:
            tail = self._remover.feed("", final=True)
            if tail:
                events += self.parser.feed(tail)
        return self._deltas(events + self.parser.finish())

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ContentDelta):
                self.content.append(ev.text)
                out.append({"content": ev.text})
                continue
            if self.max_calls is not None and ev.index >= self.max_calls:
                continue
            if isinstance(ev, CallStart):
                call = {"id": self.parser.new_call_id(), "type": "function",
                        "function": {"name": ev.name, "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": ev.index, "id": call["id"],
                                            "type": "function",
                                            "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ArgsDelta):
                self.calls[ev.index]["function"]["arguments"] += ev.text
                out.append({"tool_calls": [{"index": ev.index,
                                            "function": {"arguments": ev.text}}]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` when the model stopped after calling; `length`/`abort` stay."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The assistant message: content (null when there are calls and no text) and
        `tool_calls` when there are any."""
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not self.calls else None}
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


def parser_class(name: str, template: Any) -> type[ToolCallParser]:
    """The parser `--tool-call-parser` names (`auto`: from the chat template)."""
    return TOOL_PARSERS[parser_for_template(template) if name == "auto" else name]


def kept_specials(parser: type[ToolCallParser], special_tokens: list[str],
                  ) -> tuple[bool, tuple[str, ...]]:
    """(keep special tokens in the text?, the special tokens to remove then): a parser whose
    marker the tokenizer treats as special needs it in the text."""
    specials = set(special_tokens)
    if not any(m in specials for m in parser.markers):
        return False, ()
    return True, tuple(sorted(specials - set(parser.markers), key=len, reverse=True))
