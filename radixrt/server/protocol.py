"""OpenAI wire format: request parsing/validation (errors name the field) and response shapes."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from radixrt.core.errors import InvalidRequestError
from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.sampling_params import SamplingParams
from radixrt.core.validation import check_context_length

# SamplingParams field → the OpenAI parameter a user sent.
API_NAME = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}


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


def sampling_from_body(body: dict[str, Any], max_tokens: int, logprobs: bool,
                       top_logprobs: int) -> SamplingParams:
    """Common sampling fields of both endpoints; `max_tokens` already resolved and checked."""
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
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    if fields["temperature"] < 0:
        raise bad("temperature", f"'temperature' must be >= 0, got {fields['temperature']}")
    if not 0 < fields["top_p"] <= 1:
        raise bad("top_p", f"'top_p' must be in (0, 1], got {fields['top_p']}")
    try:
        sp = SamplingParams(**fields)
        sp.validate()
    except InvalidRequestError as e:
        raise invalid(e) from None
    return sp


def max_tokens_from(body: dict[str, Any], names: tuple[str, ...], default: int | None,
                    prompt_len: int, context: int, prompt_field: str = "prompt") -> int:
    """The output budget; `None` default means "the rest of the context"."""
    value, used = None, names[0]
    for name in names:
        if body.get(name) is not None:
            value, used = _get(body, name, (int,), None, "an integer >= 1"), name
            break
    if value is None:
        value = default if default is not None else context - prompt_len
    if value < 1:
        raise bad(used, f"'{used}' must be >= 1, got {value}")
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


def messages_from(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text", "") for p in content
                     if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"'messages[{i}].content' must be a string")
        out.append({**m, "content": content})
    return out


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

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

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
        tops = [{self.piece(i): v for i, v in zip(ti, tv, strict=True)} if ti else None
                for ti, tv in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        return {"tokens": tokens, "token_logprobs": list(lp.token_logprobs),
                "top_logprobs": tops, "text_offset": offsets}

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
