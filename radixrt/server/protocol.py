"""OpenAI wire format: request parsing/validation (errors name the field) and response shapes."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from radixrt.core.errors import EngineDeadError, InvalidRequestError, ReplicaDeadError
from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.sampling_params import SamplingParams
from radixrt.core.validation import check_context_length, check_vocab_fields
from radixrt.grammar import check_params
from radixrt.server.api_fields import unsupported_field

# SamplingParams field → the OpenAI parameter a user sent.
API_NAME = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs",
            "min_new_tokens": "min_tokens", "json_schema": "response_format"}
# response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class ApiError(Exception):
    """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,  # noqa: A002
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def unavailable(err: EngineDeadError) -> ApiError:
    """503 for a dead runtime (`engine_dead`) or a dead `--dp` replica (`replica_dead`: the
    request ran there; the server still serves new ones)."""
    code = "replica_dead" if isinstance(err, ReplicaDeadError) else "engine_dead"
    return ApiError(503, str(err), type="service_unavailable", code=code)


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid(err: InvalidRequestError) -> ApiError:
    """A 400 whose `param` is the field `err` names, in the API's spelling."""
    return bad(API_NAME.get(err.field, err.field), str(err), code=err.code)


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any,
         what: str) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if not ok or (isinstance(v, float) and not math.isfinite(v)):
        raise bad(name, f"'{name}' must be {what}, got {type(v).__name__} {v!r:.40}")
    return v


_NUM = (int, float)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "'stop' must be a non-empty string or a list of non-empty strings")
    if len(stop) > 16:
        raise bad("stop", "'stop' takes at most 16 strings")
    return tuple(stop)


def check_fields(body: dict[str, Any], implemented: frozenset[str]) -> None:
    """400 naming the first field the endpoint neither implements nor ignores as metadata
    (see `api_fields`): never a quiet success that dropped part of the request."""
    name = unsupported_field(body, implemented)
    if name is not None:
        raise bad(name, f"'{name}' is not supported by this server; remove it from the "
                        "request", code="unsupported_parameter")


def grammar_from_body(body: dict[str, Any]) -> dict[str, str]:
    """The SamplingParams grammar field set by `response_format` (`text`, `json_object`,
    `json_schema` with `schema` and optional `strict`), `regex` or `ebnf`; at most one."""
    fields: dict[str, str] = {}
    rf = _get(body, "response_format", (dict,), None, "an object")
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            fields["json_schema"] = JSON_OBJECT_SCHEMA
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("response_format.json_schema",
                          "'response_format.json_schema' must be an object with a 'schema'")
            schema = js.get("schema")
            if not isinstance(schema, dict):
                raise bad("response_format.json_schema.schema",
                          "'response_format.json_schema.schema' must be a JSON Schema object")
            strict = js.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad("response_format.json_schema.strict",
                          "'response_format.json_schema.strict' must be a boolean")
            name = js.get("name")
            if name is not None and not isinstance(name, str):
                raise bad("response_format.json_schema.name",
                          "'response_format.json_schema.name' must be a string")
            fields["json_schema"] = json.dumps(schema)
        elif kind != "text":
            raise bad("response_format.type", "'response_format.type' must be 'text', "
                                              f"'json_object' or 'json_schema', got {kind!r}")
    for name in ("regex", "ebnf"):
        v = _get(body, name, (str,), None, "a string")
        if v is not None:
            fields[name] = v
    if len(fields) > 1:
        given = ["response_format" if k == "json_schema" else k for k in fields]
        raise bad(given[1], f"only one of response_format (json), regex, ebnf may be set, "
                            f"got {' and '.join(given)}")
    return fields


def sampling_from_body(body: dict[str, Any], max_tokens: int, logprobs: bool,
                       top_logprobs: int, logprob_start_len: int = -1,
                       vocab_size: int | None = None) -> SamplingParams:
    """Common sampling fields of both endpoints; `max_tokens` already resolved and checked.
    `logprob_start_len` >= 0 asks for prompt scores (completions with `echo` + `logprobs`).
    `vocab_size`: the model's, to check the token ids the fields name (`logit_bias`)."""
    fields = {
        "max_new_tokens": max_tokens,
        "temperature": float(_get(body, "temperature", _NUM, 1.0, "a number >= 0")),
        "top_p": float(_get(body, "top_p", _NUM, 1.0, "a number in (0, 1]")),
        "top_k": _get(body, "top_k", (int,), -1, "an integer"),
        "min_p": float(_get(body, "min_p", _NUM, 0.0, "a number in [0, 1]")),
        "presence_penalty": float(_get(body, "presence_penalty", _NUM, 0.0, "a number")),
        "frequency_penalty": float(_get(body, "frequency_penalty", _NUM, 0.0, "a number")),
        "repetition_penalty": float(_get(body, "repetition_penalty", _NUM, 1.0, "a number > 0")),
        "seed": _get(body, "seed", (int,), None, "an integer"),
        "stop": _stop(body),
        "ignore_eos": _get(body, "ignore_eos", (bool,), False, "a boolean"),
        "skip_special_tokens": _get(body, "skip_special_tokens", (bool,), True, "a boolean"),
        "min_new_tokens": _get(body, "min_tokens", (int,), 0, "an integer >= 0"),
        "stop_token_ids": _get(body, "stop_token_ids", (list,), [], "a list of token ids"),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "logprob_start_len": logprob_start_len,
        "logit_bias": _get(body, "logit_bias", (dict,), None,
                           "an object mapping token ids to bias values"),
        **grammar_from_body(body),
    }
    if fields["temperature"] < 0:
        raise bad("temperature", f"'temperature' must be >= 0, got {fields['temperature']}")
    if not 0 < fields["top_p"] <= 1:
        raise bad("top_p", f"'top_p' must be in (0, 1], got {fields['top_p']}")
    try:
        sp = SamplingParams(**fields)
        sp.validate()
        if vocab_size is not None:
            check_vocab_fields(sp, vocab_size)
        check_params(sp)  # a grammar that does not compile is a 400 before anything queues
    except InvalidRequestError as e:
        raise invalid(e) from None
    return sp


def max_tokens_from(body: dict[str, Any], names: tuple[str, ...], default: int | None,
                    prompt_len: int, context: int, prompt_field: str = "prompt",
                    zero_ok: bool = False) -> int:
    """The output budget; `None` default means "the rest of the context". 0 is accepted only
    with `zero_ok` (completions with `echo`: the prompt and its scores, nothing generated)."""
    value, used = None, names[0]
    least = 0 if zero_ok else 1
    for name in names:
        if body.get(name) is not None:
            value, used = _get(body, name, (int,), None, f"an integer >= {least}"), name
            break
    if value is None:
        value = default if default is not None else context - prompt_len
    if value < least:
        hint = "" if zero_ok or value != 0 else " (0 only with 'echo': true)"
        raise bad(used, f"'{used}' must be >= {least}{hint}, got {value}")
    try:
        check_context_length(prompt_len, context, value, prompt_field=prompt_field,
                             budget_field=used)
    except InvalidRequestError as e:
        raise invalid(e) from None
    return value


def n_from(body: dict[str, Any]) -> int:
    n = _get(body, "n", (int,), 1, "an integer >= 1")
    if not 1 <= n <= 128:
        raise bad("n", f"'n' must be in 1..128, got {n}")
    return n


def stream_opts(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False, "a boolean")
    opts = _get(body, "stream_options", (dict,), {}, "an object")
    include_usage = _get(opts, "include_usage", (bool,), False, "a boolean")
    return stream, include_usage


def prompts_from(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of id lists."""
    p = body.get("prompt")
    msg = "'prompt' must be a non-empty string, list of strings, or (list of) token id lists"
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
        items = [p]
    elif isinstance(p, list) and p:
        items = p
    else:
        raise bad("prompt", msg)
    for it in items:
        if isinstance(it, str):
            if not it:
                raise bad("prompt", "'prompt' must not be empty")
        elif not (isinstance(it, list) and it and all(
                isinstance(t, int) and not isinstance(t, bool) for t in it)):
            raise bad("prompt", msg)
    return items


def _text(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: the text ones
        texts = [p.get("text") for p in content
                 if isinstance(p, dict) and p.get("type") in ("text", "input_text")]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise bad(where, f"'{where}': only text content parts ({{\"type\": \"text\", "
                             f"\"text\": ...}}) are supported")
        return "".join(texts)
    if not isinstance(content, str):
        raise bad(where, f"'{where}' must be a string, a list of text parts or null")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with each call's `arguments` JSON text turned into
    an object (what chat templates expect; a string that is not a JSON object stays as is)."""
    if not isinstance(calls, list):
        raise bad(where, f"'{where}' must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{j}]", f"'{where}[{j}]' must be {{\"id\", \"type\": "
                                       f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        elif not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments",
                      f"'{where}[{j}].function.arguments' must be a JSON string")
        call: dict[str, Any] = {"type": "function",
                                "function": {"name": fn["name"], "arguments": args}}
        if c.get("id") is not None:
            if not isinstance(c["id"], str):
                raise bad(f"{where}[{j}].id", f"'{where}[{j}].id' must be a string")
            call["id"] = c["id"]
        out.append(call)
    return out


def messages_from(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`messages` for the chat template: content as a string (text parts joined, null → ""),
    the `developer` role as `system`, assistant `tool_calls` with parsed arguments, `tool`
    messages with their `tool_call_id`."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object with a 'role'")
        msg = {**m, "content": _text(m.get("content"), f"messages[{i}].content")}
        if msg["role"] == "developer":
            msg["role"] = "system"
        if m.get("tool_calls") is not None:
            if msg["role"] != "assistant":
                raise bad(f"messages[{i}].tool_calls", "only assistant messages have 'tool_calls'")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        elif "tool_calls" in msg:
            del msg["tool_calls"]
        if msg["role"] == "tool" and m.get("tool_call_id") is not None and not isinstance(
                m["tool_call_id"], str):
            raise bad(f"messages[{i}].tool_call_id",
                      f"'messages[{i}].tool_call_id' must be a string")
        out.append(msg)
    return out


def template_options(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat-template fields as `apply_chat_template` options: `add_generation_prompt`
    (unset: true, false with `continue_final_message`), `continue_final_message` (default
    false), `chat_template_kwargs` (an object of extra template variables)."""
    cont = _get(body, "continue_final_message", (bool,), False, "a boolean")
    gen = _get(body, "add_generation_prompt", (bool,), None, "a boolean")
    kwargs = _get(body, "chat_template_kwargs", (dict,), {}, "an object")
    return {"add_generation_prompt": gen, "continue_final_message": cont,
            "template_kwargs": kwargs}


# -- responses --------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class TokenText:
    """Turns token ids into the per-token strings that logprobs report."""

    tokenizer: Any

    def __post_init__(self) -> None:
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        """One token's text, special tokens included (cached: at most one entry per id)."""
        p = self._pieces.get(token_id)
        if p is None:
            p = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return p

    def _tops(self, chosen: list[int], lp: TokenLogprobs) -> list[dict[str, float] | None]:
        """Legacy `top_logprobs`: per position, the alternatives (descending) plus the chosen
        token, as text → logprob; None where the chosen token has no logprob (prompt token 0).

        Values are the runtime's floats untouched, so when the chosen token is the argmax its
        entry equals `token_logprobs` exactly (lm-eval's is_greedy compares with ==). Two ids
        with the same text keep the first (larger) value, and the chosen token never
        overwrites an alternative: a non-argmax choice cannot look greedy.
        """
        out: list[dict[str, float] | None] = []
        for tid, v, ti, tv in zip(chosen, lp.token_logprobs, lp.top_ids, lp.top_logprobs,
                                  strict=True):
            if v is None:
                out.append(None)
                continue
            d: dict[str, float] = {}
            for i, x in zip(ti, tv, strict=True):
                d.setdefault(self.piece(i), x)
            d.setdefault(self.piece(tid), v)
            out.append(d)
        return out

    def _offsets(self, ids: list[int], tokens: list[str], text: str, start: int) -> list[int]:
        """Character offset of each token in `text` (which starts at `start` in the choice's
        text). Token texts that concatenate to `text` give exact offsets; otherwise (byte
        tokens split a character, an added BOS not in the text...) the offset of token i is
        the length of the decoded prefix `ids[:i]` without a trailing U+FFFD (the part of a
        character split across tokens: every token of that character starts at it), clamped
        into `text`."""
        offsets, pos = [], start
        if "".join(tokens) == text:
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            return offsets
        skip = self.tokenizer.decode(ids, skip_special_tokens=True) == text
        prev = 0
        for i in range(len(ids)):
            head = self.tokenizer.decode(ids[:i], skip_special_tokens=skip) if i else ""
            n = len(head.rstrip("\ufffd"))
            prev = min(max(prev, n), len(text))
            offsets.append(start + prev)
        return offsets

    def completion_logprobs(self, ids: list[int], lp: TokenLogprobs | None,
                            text_offset: int) -> dict[str, Any] | None:
        """Legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        if lp is None:
            return None
        tokens = [self.piece(t) for t in ids]
        offsets, pos = [], text_offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": list(lp.token_logprobs),
                "top_logprobs": self._tops(ids, lp), "text_offset": offsets}

    def prompt_logprobs(self, ids: list[int], lp: TokenLogprobs, text: str) -> dict[str, Any]:
        """`echo` + `logprobs`: the prompt's part of a choice's logprobs (`text` is the echoed
        prompt; `lp` scores every prompt token, None for token 0)."""
        if len(lp.token_logprobs) != len(ids):
            raise ApiError(500, f"the runtime scored {len(lp.token_logprobs)} of the prompt's "
                                f"{len(ids)} tokens", type="internal_error")
        tokens = [self.piece(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": list(lp.token_logprobs),
                "top_logprobs": self._tops(ids, lp),
                "text_offset": self._offsets(ids, tokens, text, 0)}

    @staticmethod
    def join(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
        """Prompt part `a` followed by completion part `b` (None: nothing generated)."""
        if b is None:
            return a
        return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs",
                                           "text_offset")}

    def chat_logprobs(self, ids: list[int], lp: TokenLogprobs | None) -> dict[str, Any] | None:
        if lp is None:
            return None
        content = []
        for tid, v, ti, tv in zip(ids, lp.token_logprobs, lp.top_ids, lp.top_logprobs,
                                  strict=True):
            tok = self.piece(tid)
            content.append({
                "token": tok, "logprob": v, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (p := self.piece(i)), "logprob": x,
                                  "bytes": list(p.encode())} for i, x in zip(ti, tv, strict=True)],
            })
        return {"content": content}
