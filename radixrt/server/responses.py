"""The Responses API (`POST /v1/responses`, OpenAI's newer text-generation endpoint and the one
the OpenAI Agents SDK's default model class calls) as a translation onto the chat endpoint.

A request becomes a chat request (`chat_body`): `instructions` the first system message, the
stored conversation of `previous_response_id` next, then `input`'s items as chat messages
(`function_call` items as assistant `tool_calls`, `function_call_output` items as `tool`
messages); `tools` / `tool_choice` / `text.format` / `max_output_tokens` in their chat
spelling. The chat endpoint's generation, tool-call parsing and grammar run unchanged, and
`ResponseBuilder` turns its deltas into the response's output items (a `message` with one
`output_text` part, then one `function_call` item per call) and, when streamed, into the
Responses event sequence. Errors name the Responses field (`input`, `max_output_tokens`,
`text.format`, `tools[i].name`), not its chat spelling.

`ResponseStore` keeps finished responses (unless `store: false`) in memory, least recently
used first out, for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items`.
"""

from __future__ import annotations

import copy
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from radixrt.server.api_fields import RESPONSES_PASSED_THROUGH
from radixrt.server.protocol import ApiError, bad, new_id

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Chat spellings of the fields an error can name → the Responses field.
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                ("messages", "input"))
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function\.")


def responses_param(param: str | None) -> str | None:
    """A chat-endpoint error's `param` in the Responses API's spelling."""
    if param is None:
        return None
    param = _TOOL_PARAM.sub(lambda m: f"tools[{m.group(1)}].", param)
    for chat, resp in _PARAM_NAMES:
        if param == chat or param.startswith((chat + "[", chat + ".")):
            return resp if chat == "messages" else resp + param[len(chat):]
    return param


def as_responses_error(e: ApiError) -> ApiError:
    """`e` with its field names in the Responses spelling (param and quoted names)."""
    message = _TOOL_PARAM.sub(lambda m: f"tools[{m.group(1)}].", e.message)
    for chat, resp in _PARAM_NAMES:
        message = message.replace(f"'{chat}'", f"'{resp}'")
    return ApiError(e.status, message, responses_param(e.param), e.type, e.code, e.headers)


# -- the request ---------------------------------------------------------------------------------
def _content_text(content: Any, where: str, parts: tuple[str, ...]) -> str:
    """A message's content: a string or a list of text parts of the kinds `parts` names."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"'{where}' must be a string or a list of content parts")
    texts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "refusal" and isinstance(p.get("refusal"), str):
            texts.append(p["refusal"])
        elif kind in parts and isinstance(p.get("text"), str):
            texts.append(p["text"])
        else:
            raise bad(f"{where}[{j}]", f"'{where}[{j}]': only text parts "
                                       f"({', '.join(parts)}) are supported, got {kind!r:.40}")
    return "".join(texts)


def _str_field(item: dict[str, Any], name: str, where: str) -> str:
    v = item.get(name)
    if not isinstance(v, str):
        raise bad(f"{where}.{name}", f"'{where}.{name}' must be a string")
    return v


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` as chat messages. A string is one user message. In a list, messages keep
    their role (`developer` → `system`); consecutive `function_call` items join the
    assistant message before them (or start one); `function_call_output` items become `tool`
    messages. Items we cannot render as text (images, files, reasoning, references) are a
    400 naming the item."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("input", "'input' must be a string or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"'{where}' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role", f"'{where}.role' must be 'user', 'system', "
                                           f"'developer' or 'assistant', got {role!r:.40}")
            text = _content_text(item.get("content"), f"{where}.content",
                                 ("input_text", "output_text"))
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = (output if isinstance(output, str) else
                    _content_text(output, f"{where}.output", ("input_text", "output_text")))
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                        "content": text})
        else:
            raise bad(f"{where}.type", f"input items of type {kind!r:.40} are not supported: "
                                       "this server takes 'message', 'function_call' and "
                                       "'function_call_output' items")
    return out


def listed_items(raw: Any) -> list[dict[str, Any]]:
    """`input` (already checked by `input_messages`) as `GET /v1/responses/{id}/input_items`
    lists it: a string as one user message, message content as text parts, every item with
    an `id` (the caller's, or a new one) and `status: completed`."""
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc"}.get(kind, "fco")
        item.setdefault("id", new_id(prefix))
        item.setdefault("status", "completed")
        out.append(item)
    return out


def _chat_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad("tools", "'tools' must be a list of function tools")
    out = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(where, f"'{where}' must be an object")
        if t.get("type") != "function":
            raise bad(f"{where}.type", f"'{where}.type' {t.get('type')!r:.40} is not supported: "
                                       "this server runs only 'function' tools (hosted tools "
                                       "such as web or file search are OpenAI's)")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(raw: Any) -> Any:
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    if raw is None or isinstance(raw, str):
        return raw
    raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                             "{\"type\": \"function\", \"name\": ...}")


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as the chat endpoint's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "'text' must be an object")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise bad("text.verbosity", "'text.verbosity' is not supported by this server (only "
                                    "the default, 'medium')", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad("text.format", "'text.format' must be {\"type\": \"text\"}, {\"type\": "
                             "\"json_object\"} or {\"type\": \"json_schema\", \"schema\": ...}")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request resolved against the store: the chat request that runs it, the
    conversation it continues and adds (`history`: stored messages then the new input's,
    without `instructions`, which OpenAI does not carry over), and what the response echoes."""

    chat_body: dict[str, Any]
    history: list[dict[str, Any]]
    items: list[dict[str, Any]]
    stream: bool
    store: bool
    echo: dict[str, Any]


def _include_logprobs(body: dict[str, Any]) -> bool:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("include", "'include' must be a list of strings")
    for x in include:
        if x != LOGPROBS_INCLUDE:
            raise bad("include", f"'include' value {x!r:.60} is not supported (this server "
                                 f"adds only {LOGPROBS_INCLUDE!r})", code="unsupported_parameter")
    return LOGPROBS_INCLUDE in include


def chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that runs Responses request `body` continuing `history` (the stored
    conversation of its `previous_response_id`, or nothing): `instructions` first, then the
    history, then `input`'s messages; the other fields in their chat spelling."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "'instructions' must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat: dict[str, Any] = {"messages": messages + input_messages(body.get("input"))}
    if "model" in body:
        chat["model"] = body["model"]
    for name in RESPONSES_PASSED_THROUGH:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if _include_logprobs(body):
        if tools and chat.get("tool_choice") != "none":
            raise bad("include", f"{LOGPROBS_INCLUDE!r} is not supported together with "
                                 "'tools' (only with tool_choice 'none')",
                      code="unsupported_parameter")
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    elif body.get("top_logprobs"):
        raise bad("top_logprobs", f"'top_logprobs' needs 'include': [{LOGPROBS_INCLUDE!r}]")
    return chat


def parse_request(body: dict[str, Any], store: ResponseStore) -> ResponsesRequest:
    """Checks and translates `body` (fields already checked against api_fields.RESPONSES)."""
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id", "'previous_response_id' must be a string")
        history = store.history(previous)
    chat = chat_body(body, history)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise bad("truncation", f"'truncation': {truncation!r:.40} is not supported (only "
                                "'disabled': an over-long input is a 400)",
                  code="unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise bad("stream", "'stream' must be a boolean")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}):
        raise bad("stream_options", "'stream_options' takes only 'include_obfuscation'")
    stored = body.get("store", True)
    if not isinstance(stored, bool | None):
        raise bad("store", "'store' must be a boolean")
    tools = chat.get("tools")
    instructions = body.get("instructions")
    conversation = chat["messages"][1:] if instructions else chat["messages"]

    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": previous,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs"),
        "truncation": "disabled",
        "user": body.get("user"),
        "store": stored is not False,
    }
    return ResponsesRequest(chat, conversation, listed_items(body["input"]), bool(stream),
                            stored is not False, echo)


# -- the response --------------------------------------------------------------------------------
def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat endpoint's usage object in the Responses spelling."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


class ResponseBuilder:
    """One response's output, built from the chat endpoint's deltas (`{"content": text}`, or
    `{"tool_calls": [...]}` that start a call or add to its arguments), and the Responses
    stream events that describe it. Each event gets the next `sequence_number`. Items are
    opened when their first delta arrives and closed (`...done` events) when the next item
    opens or the response finishes, so the events are what the openai SDK's stream helper
    checks: every item added before its deltas and done before `response.completed`."""

    def __init__(self, model: str, echo: dict[str, Any]):
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still taking deltas
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → its item
        self._item_status = "completed"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return ev

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "model": self.model, "output": copy.deepcopy(self.output),
                "usage": usage, "background": False,
                "reasoning": {"effort": None, "summary": None}, **self.echo}

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.output.append(item)
        self._open = item
        added = {**copy.deepcopy(item), "status": "in_progress"}
        events.append(self._event("response.output_item.added",
                                  output_index=len(self.output) - 1, item=added))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = self._item_status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event("response.output_text.done", **common, text=part["text"],
                                      logprobs=part.get("logprobs", [])))
            events.append(self._event("response.content_part.done", **common,
                                      part=copy.deepcopy(part)))
        else:
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=copy.deepcopy(item)))
        return events

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None,
              ) -> list[dict[str, Any]]:
        """The events of one chat delta; `logprobs`: its tokens' entries (chat's `content`
        list), asked for with `include: ["message.output_text.logprobs"]`."""
        events: list[dict[str, Any]] = []
        text = delta.get("content")
        if text or (logprobs and "tool_calls" not in delta):
            item = self._open
            if item is None or item["type"] != "message":
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
                if logprobs is not None:
                    part["logprobs"] = []
                item = {"type": "message", "id": new_id("msg"), "role": "assistant",
                        "status": "in_progress", "content": [part]}
                events += self._add(item)
                index = len(self.output) - 1
                events.append(self._event("response.content_part.added", item_id=item["id"],
                                          output_index=index, content_index=0,
                                          part=copy.deepcopy(part)))
            part = item["content"][0]
            part["text"] += text or ""
            if logprobs is not None:
                part.setdefault("logprobs", []).extend(logprobs)
            events.append(self._event("response.output_text.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0,
                                      delta=text or "", logprobs=logprobs or []))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a call starts
                item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                        "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}
                self._calls[call["index"]] = item
                events += self._add(item)
            item = self._calls[call["index"]]
            args = fn.get("arguments") or ""
            if args:
                item["arguments"] += args
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=item["id"], output_index=len(self.output) - 1,
                                          delta=args))
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any],
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(the final response, the stream's closing events) for the chat finish reason:
        `length` → `incomplete` (items too), `abort` → `cancelled`, else `completed`."""
        status = {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "",
                                                                     "completed")
        if status != "completed":
            self._item_status = "incomplete"
        events = self._close()
        final = self.response(status, responses_usage(usage))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.failed"}[status]
        events.append(self._event(kind, response=final))
        return final, events

    def error_event(self, err: ApiError) -> dict[str, Any]:
        return self._event("error", code=err.code or err.type, message=err.message,
                           param=err.param)

    def assistant_message(self) -> dict[str, Any]:
        """The output as one chat assistant message, for the stored conversation."""
        text = "".join(item["content"][0]["text"] for item in self.output
                       if item["type"] == "message")
        calls = [{"id": it["call_id"], "type": "function",
                  "function": {"name": it["name"], "arguments": it["arguments"]}}
                 for it in self.output if it["type"] == "function_call"]
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls
                               else None}
        if calls:
            msg["tool_calls"] = calls
        return msg


def sse_event(ev: dict[str, Any]) -> bytes:
    """One Responses stream event as SSE (`event:` names its type; no `[DONE]` follows)."""
    return f"event: {ev['type']}\ndata: ".encode() + orjson.dumps(ev) + b"\n\n"


# -- the store -----------------------------------------------------------------------------------
@dataclass
class _Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]
    items: list[dict[str, Any]]


class ResponseStore:
    """Finished responses by id, at most `capacity`, least recently used evicted first. Each
    keeps its response object and its conversation (the chat messages it was given, minus
    `instructions`, plus its own output), which `previous_response_id` continues."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], history: list[dict[str, Any]],
            items: list[dict[str, Any]] | None = None) -> None:
        self._items[response["id"]] = _Stored(copy.deepcopy(response), history, items or [])
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def _get(self, rid: str, param: str | None) -> _Stored:
        st = self._items.get(rid)
        if st is None:
            raise ApiError(404 if param is None else 400,
                           f"response {rid!r:.80} not found (never stored, stored with "
                           f"'store': false, deleted, or evicted: the store keeps the "
                           f"{self.capacity} most recently used)", param=param,
                           code="previous_response_not_found" if param else "not_found")
        self._items.move_to_end(rid)
        return st

    def get(self, rid: str) -> dict[str, Any]:
        return copy.deepcopy(self._get(rid, None).response)

    def history(self, rid: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self._get(rid, "previous_response_id").history)

    def input_items(self, rid: str, after: str | None = None, limit: int = 20,
                    order: str = "desc") -> dict[str, Any]:
        """One page of the response's input items (OpenAI's cursor list: `order` asc|desc,
        the `limit` items after the one whose id is `after`)."""
        if not 1 <= limit <= 100:
            raise bad("limit", f"'limit' must be in 1..100, got {limit}")
        if order not in ("asc", "desc"):
            raise bad("order", f"'order' must be 'asc' or 'desc', got {order!r:.20}")
        items = self._get(rid, None).items
        items = items[::-1] if order == "desc" else items
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise bad("after", f"'after': no input item {after!r:.60} in response {rid!r}")
            items = items[ids.index(after) + 1:]
        page = copy.deepcopy(items[:limit])
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, rid: str) -> None:
        self._get(rid, None)
        del self._items[rid]
