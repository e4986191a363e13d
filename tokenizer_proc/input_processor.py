"""Input preparation on the tokenizer side: tokenization, chat templates, and validation.

Every rejection is an `InvalidRequestError` naming the offending field.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

from radixrt.core.errors import InvalidRequestError
from radixrt.core.sampling_params import SamplingParams
from radixrt.core.validation import check_context_length, check_vocab_fields
from radixrt.grammar import check_params

ParamsLike = SamplingParams | dict[str, Any] | None


def to_params(p: ParamsLike) -> SamplingParams:
    """`None` (defaults), a `SamplingParams`, or a dict of its fields; validated, its grammar
    (if any) checked to compile (`GrammarError`, an `InvalidRequestError`, names the field)."""
    if p is None:
        sp = SamplingParams()
    elif isinstance(p, SamplingParams):
        sp = p
    elif isinstance(p, dict):
        sp = SamplingParams.from_dict(p)
    else:
        raise TypeError(f"sampling_params: expected SamplingParams or dict, got {type(p).__name__}")
    sp.validate()
    check_params(sp)
    return sp


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_context_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self._takes_tools: bool | None = None
        self._template_args: set[str] | None = None

    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt", f"expected a string, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None, *,
                            add_generation_prompt: bool | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids; `tools` (OpenAI function tools) go to the template, which
        must take them (`template_takes_tools`). `continue_final_message`: the last message is
        left open (no end-of-turn) for the model to continue; `add_generation_prompt` (a new
        assistant turn opened) defaults to its opposite; `template_kwargs`: extra
        variables for the template (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`),
        none of which may be an argument of the tokenizer's `apply_chat_template` itself."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages",
                                      "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(f"messages[{i}]", "must have 'role' and 'content'")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message", "cannot be combined with "
                                      "'add_generation_prompt': true (the last message is "
                                      "continued, no new turn is opened)")
        extra: dict[str, Any] = dict(template_kwargs or {})
        taken = sorted(set(extra) & self._template_arguments())
        if taken:
            raise InvalidRequestError(f"chat_template_kwargs.{taken[0]}",
                                      "is an argument of the template call, not a template "
                                      "variable")
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            extra["continue_final_message"] = True
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _template_arguments(self) -> set[str]:
        """Names the tokenizer's `apply_chat_template` takes as its own arguments (and
        `messages`, `tools`, which the request gives its own way)."""
        if self._template_args is None:
            params = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
            self._template_args = {p.name for p in params if p.kind is not p.VAR_KEYWORD} | {
                "messages", "tools"}
        return self._template_args

    def template_takes_tools(self) -> bool:
        """Whether the tokenizer's chat template reads a `tools` variable (computed once)."""
        if self._takes_tools is None:
            self._takes_tools = template_reads(getattr(self.tokenizer, "chat_template", None),
                                               "tools")
        return self._takes_tools

    def check_ids(self, ids: Sequence[int], max_new_tokens: int = 1, *,
                  ids_field: str = "input_ids", prompt_field: str = "prompt",
                  budget_field: str = "max_new_tokens") -> list[int]:
        """Token ids inside the vocabulary, and the context-length rule (prompt alone when
        `max_new_tokens` is left at 1)."""
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError(ids_field, "must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError(ids_field, "every token id must be an integer")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                ids_field, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        check_context_length(len(ids), self.max_context_len, max_new_tokens,
                             prompt_field=prompt_field, budget_field=budget_field)
        return list(ids)

    def prepare(self, prompts: str | list[str] | None, input_ids: Any,
                sampling_params: ParamsLike | list[ParamsLike],
                ) -> tuple[list[list[int]], list[SamplingParams], bool]:
        """(token id lists, their sampling params, whether a single prompt was given)."""
        if (prompts is None) == (input_ids is None):
            raise InvalidRequestError("prompts", "pass exactly one of prompts or input_ids")
        if prompts is not None:
            single = isinstance(prompts, str)
            plist = [prompts] if single else list(prompts)
            if not plist:
                raise InvalidRequestError("prompts", "must not be empty")
            ids_list = [self.tokenize(p) for p in plist]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            if not ids_list:
                raise InvalidRequestError("input_ids", "must not be empty")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise InvalidRequestError(
                    "sampling_params", "list length differs from the number of prompts")
            params = [to_params(p) for p in sampling_params]
        else:
            params = [to_params(sampling_params)] * len(ids_list)
        ids_list = [self.check_ids(ids, sp.max_new_tokens)
                    for ids, sp in zip(ids_list, params, strict=True)]
        for ids, sp in zip(ids_list, params, strict=True):
            check_logprob_start(len(ids), sp)
            check_vocab_fields(sp, self.vocab_size)
        return ids_list, params, single


def template_reads(template: Any, variable: str) -> bool:
    """Whether a Jinja chat template (or any of a dict of named templates) reads `variable`
    from its context."""
    if isinstance(template, dict):
        return any(template_reads(t, variable) for t in template.values())
    if not isinstance(template, str):
        return False
    from jinja2 import meta
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return variable in meta.find_undeclared_variables(env.parse(template))
    except TemplateSyntaxError:  # a dialect we cannot parse: look for the name
        return re.search(rf"\b{re.escape(variable)}\b", template) is not None


def check_logprob_start(prompt_len: int, sp: SamplingParams,
                        field: str = "logprob_start_len") -> None:
    """Prompt scores start at a prompt position: `logprob_start_len` < the prompt's length."""
    if sp.logprob_start_len >= prompt_len:
        raise InvalidRequestError(
            field, f"must be a prompt position (< {prompt_len}, the prompt's length) or -1, "
                   f"got {sp.logprob_start_len}")
