"""Per-request sampling parameters (OpenAI / SGLang semantics).

`SamplingParams` crosses process boundaries, so it stays a plain picklable dataclass. Construction
only normalizes (`stop` / `stop_token_ids` become tuples); `validate()` checks everything, and
`from_dict()` is the entry point for untrusted input (unknown keys rejected, then validated).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from radixrt.core.errors import InvalidRequestError

# Temperatures below this are treated as greedy (dividing by them would overflow float32 logits).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# The fields that constrain generation with a grammar; at most one may be set.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


def _normalize_bias(value: Any) -> Any:
    """A logit_bias mapping with its token ids as ints (JSON object keys arrive as strings:
    "50256" -> 50256); None or empty -> None; anything odd is left for validate()."""
    if value is None or (isinstance(value, dict) and not value):
        return None
    if not isinstance(value, dict):
        return value
    out: dict[Any, Any] = {}
    for k, v in value.items():
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        out[k] = float(v) if isinstance(v, int) and not isinstance(v, bool) else v
    return out


def _normalize_seq(value: Any, elem: type) -> Any:
    """Turn None / a single element / a list into a tuple; leave anything odd for validate()."""
    if value is None:
        return ()
    if isinstance(value, elem) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        return tuple(value)
    return value


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    temperature == 0 (or below GREEDY_TEMPERATURE_EPS) or top_k == 1 means greedy. top_k of -1
    or 0 disables top-k. repetition_penalty follows HF (over prompt + output tokens: positive
    logits are divided, negative multiplied); frequency/presence penalties follow OpenAI (over
    output tokens only: logit -= frequency * count + presence * (count > 0)). min_new_tokens
    bans EOS and stop_token_ids until that many tokens were generated. top_logprobs (0..20)
    alternatives are returned only when logprobs is True. logit_bias (OpenAI) maps token ids
    to values in [-100, 100] added to their logits before sampling, greedy included (after
    the penalties, before bans and grammar masks); logprobs stay those of the raw logits.

    logprob_start_len >= 0 asks for prompt scores: the log-probability of every prompt token
    from that position on given the tokens before it (position 0 has none), with
    `top_logprobs` alternatives each; -1 (default) asks for none. They are served from the
    radix cache when a cached prefix already holds them. max_new_tokens == 0 (allowed only
    with prompt scores) scores the prompt without generating.

    Structured output: at most one of `json_schema` (a JSON Schema as JSON text; "{}" or
    '{"type": "object"}' for "any JSON object"), `regex` or `ebnf` (a Lark-style grammar whose
    start rule is `start`) constrains every generated token; the request ends ("stop") when the
    grammar accepts and can go no further, or when it reaches EOS in an accepting state.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    logprob_start_len: int = -1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self.normalize()

    def normalize(self) -> None:
        """Accept a str or list for `stop` and a list / int for `stop_token_ids`; store tuples."""
        self.stop = _normalize_seq(self.stop, str)
        self.stop_token_ids = _normalize_seq(self.stop_token_ids, int)
        self.logit_bias = _normalize_bias(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, source) of the request's grammar: kind is "json_schema", "regex" or "ebnf";
        None when unconstrained. Compiled grammars are cached by this key."""
        for kind in GRAMMAR_FIELDS:
            src = getattr(self, kind)
            if src is not None:
                return kind, src
        return None

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise `InvalidRequestError` (a ValueError) naming the first offending field.
        Context-length checks (prompt + max_new_tokens) are `core.validation`'s, called by
        whoever knows the model."""

        def bad(name: str, msg: str) -> None:
            raise InvalidRequestError(name, f"{msg}, got {getattr(self, name)!r}")

        for name in ("max_new_tokens", "top_k", "min_new_tokens", "top_logprobs",
                     "logprob_start_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(name, "must be an integer")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                bad(name, "must be a number")
            if not math.isfinite(v):
                bad(name, "must be finite")
        for name in ("ignore_eos", "skip_special_tokens", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")

        if self.logprob_start_len < -1:
            bad("logprob_start_len", "must be -1 (no prompt scores) or a prompt position >= 0")
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and self.logprob_start_len < 0):
            bad("max_new_tokens", "must be >= 1 (0 only when scoring the prompt: "
                                  "logprob_start_len >= 0)")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", "must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs > 0 and not self.logprobs and self.logprob_start_len < 0:
            bad("top_logprobs", "requires logprobs=True or logprob_start_len >= 0")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            bad("seed", "must be an integer or None")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")
        self._validate_bias()
        self._validate_grammar()

    def _validate_bias(self) -> None:
        """logit_bias: None, or token id (int >= 0) -> a finite number in [-100, 100]. Whether
        the ids are in the vocabulary is `core.validation.check_vocab_fields`'s (it knows the
        model)."""
        b = self.logit_bias
        if b is None:
            return
        if not isinstance(b, dict):
            raise InvalidRequestError("logit_bias", "must be an object mapping token ids to "
                                                    f"bias values, got {type(b).__name__}")
        for k, v in b.items():
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise InvalidRequestError("logit_bias", "keys must be token ids (non-negative "
                                                        f"integers), got {k!r}")
            if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                    or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                raise InvalidRequestError("logit_bias", f"values must be numbers in "
                                                        f"[-100, 100], got {v!r} for token {k}")

    def _validate_grammar(self) -> None:
        """At most one grammar field, each a non-empty string; a JSON schema must parse as a
        JSON object (its meaning is checked by the grammar backend)."""
        given = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        for k in given:
            if not isinstance(getattr(self, k), str) or not getattr(self, k).strip():
                raise InvalidRequestError(k, "must be a non-empty string")
        if len(given) > 1:
            raise InvalidRequestError(given[1], "only one of json_schema, regex, ebnf may be "
                                                f"set, got {' and '.join(given)}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise InvalidRequestError("json_schema", f"is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("json_schema", "must be a JSON object (a JSON "
                                                         "Schema), got "
                                                         f"{type(schema).__name__}")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from untrusted input: unknown keys are an `InvalidRequestError` naming them;
        then validate."""
        if not isinstance(d, dict):
            raise InvalidRequestError("sampling_params",
                                      f"must be a dict, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in cls.field_names())
        if unknown:
            raise InvalidRequestError(unknown[0], "unknown sampling parameter(s): "
                                                  f"{', '.join(unknown)}")
        params = cls(**d)
        params.validate()
        return params

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple)
                     else dict(v) if isinstance(v, dict) else v)
            for f in dataclasses.fields(self)
        }
