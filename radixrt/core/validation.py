"""The request rules every entry point shares (Engine, HTTP server, scheduler), each raising
`InvalidRequestError` that names the offending field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixrt.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from radixrt.core.sampling_params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def check_context_length(prompt_len: int, context_len: int, max_new_tokens: int = 1, *,
                         prompt_field: str = "prompt",
                         budget_field: str = "max_new_tokens") -> None:
    """The context-length rule: the prompt plus its output budget must fit the model's context.

    A prompt that leaves no room for even one new token is the prompt's fault
    (`prompt_field`); otherwise an over-long budget is the budget's (`budget_field`). The
    default budget of 1 checks the prompt alone.
    """
    if prompt_len + 1 > context_len:
        raise InvalidRequestError(
            prompt_field, f"the prompt has {prompt_len} tokens; this model's context is "
                          f"{context_len} tokens and must leave room for at least one new token",
            code=CONTEXT_LENGTH_EXCEEDED)
    if prompt_len + max_new_tokens > context_len:
        raise InvalidRequestError(
            budget_field, f"this model's context is {context_len} tokens; the prompt has "
                          f"{prompt_len} and '{budget_field}' asks for {max_new_tokens} more",
            code=CONTEXT_LENGTH_EXCEEDED)


def check_vocab_fields(sp: SamplingParams, vocab_size: int, field: str = "logit_bias") -> None:
    """The sampling fields that name token ids the model must have: `logit_bias`'s keys."""
    outside = sorted(t for t in (sp.logit_bias or {}) if not 0 <= t < vocab_size)
    if outside:
        raise InvalidRequestError(field, f"token id {outside[0]} is outside the vocabulary "
                                         f"[0, {vocab_size})")
