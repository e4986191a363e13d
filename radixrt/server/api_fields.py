"""Which request fields each endpoint implements, accepts and ignores, or rejects.

Nothing is silently ignored: a field that is neither implemented nor pure platform metadata
gets a 400 naming it (OpenAI's own answer to an unknown argument), unless its value asks for
nothing (null, an empty list or object, or the value that means "off").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Implemented by both endpoints: OpenAI's sampling and streaming fields (logit_bias
# included), the SGLang/vLLM extras (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
# skip_special_tokens) and structured outputs (response_format, regex, ebnf).
COMMON = frozenset({
    "model", "n", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens", "response_format",
    "regex", "ebnf", "logit_bias",
})
COMPLETIONS = COMMON | {"prompt", "echo", "logprobs", "max_tokens", "suffix"}
# Tool calling (radixrt/server/tools.py) is chat only.
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
CHAT = COMMON | TOOL_FIELDS | {"messages", "logprobs", "top_logprobs", "max_tokens",
                               "max_completion_tokens", "add_generation_prompt",
                               "continue_final_message", "chat_template_kwargs"}
# The Responses API (radixrt/server/responses.py): its own fields, and the chat endpoint's
# sampling fields and SGLang/vLLM extras, which it passes through. Not implemented (a 400 unless
# null or empty): `reasoning`, `background`, `conversation`, `prompt`, `max_tool_calls`,
# `context_management`; hosted tools and non-text inputs are 400s of their own.
# Sampling fields and SGLang/vLLM extras of the chat endpoint (grammars included) that a
# Responses request passes to it under the same names.
RESPONSES_PASSED_THROUGH = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
    "logit_bias", "regex", "ebnf",
)
RESPONSES = frozenset({
    "model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
    "parallel_tool_calls", "max_output_tokens", "stream", "stream_options", "store", "text",
    "include", "top_logprobs", "truncation", *RESPONSES_PASSED_THROUGH,
})
# OpenAI's deprecated function calling (`functions`, `function_call`) is not implemented:
# rejected like any unimplemented field unless its value asks for nothing.

# Platform metadata: accepted and ignored, it never changes the output (README lists these).
IGNORED_METADATA = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key",
                              "prompt_cache_retention", "safety_identifier"})

# Values of unimplemented fields that request nothing (besides null / empty / false).
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v == 1,
    "modalities": lambda v: v == ["text"],
    "function_call": lambda v: v in ("none", "auto"),  # without functions: no call either way
}


# Fields whose empty object still asks for something: OpenAI's `web_search_options: {}` turns
# web search on with its default settings.
_EMPTY_ASKS = frozenset({"web_search_options"})


def _requests_nothing(name: str, value: Any) -> bool:
    if name in _EMPTY_ASKS:
        return value is None
    if value is None or value is False or (isinstance(value, (list, dict, str)) and not value):
        return True
    check = _NEUTRAL.get(name)
    return check is not None and check(value)


def unsupported_field(body: dict[str, Any], implemented: frozenset[str]) -> str | None:
    """The first field of `body` (sorted) that the endpoint must reject, or None."""
    for name in sorted(body):
        if name in implemented or name in IGNORED_METADATA:
            continue
        if _requests_nothing(name, body[name]):
            continue
        return name
    return None
