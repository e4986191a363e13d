"""The llguidance backend (chosen by measurement: see README "Structured outputs").

llguidance compiles JSON Schema, regular expressions and Lark / GBNF grammars into an Earley
parser over a lexer, and computes each step's token mask on the fly from a token trie; its
wheel has no Python dependencies. `check_grammar` validates a grammar without a tokenizer (the
frontends call it so a bad schema is a 400 before the request is queued); the backend compiles
against the served tokenizer inside the scheduler.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import torch

from radixrt.grammar.base import GrammarBackend, GrammarError, GrammarMatcher

# JSON Schema compile options: no free whitespace between tokens (compact JSON, as OpenAI's
# structured outputs produce) so a weak model cannot spend its budget on blank lines; keywords
# llguidance does not implement are an error, never silently dropped.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "lenient": False}


def _llg() -> Any:
    import llguidance

    return llguidance


def grammar_text(kind: str, source: str) -> str:
    """The llguidance grammar for a `(kind, source)` key; `GrammarError` naming `kind` when
    the source cannot even be translated (bad JSON, GBNF with an undefined rule, ...)."""
    llg = _llg()
    try:
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(source)
        if kind == "ebnf":  # Lark syntax, or GBNF (`root ::= ...`) converted to Lark
            return llg.grammar_from("ebnf", source)
    except (ValueError, json.JSONDecodeError) as e:
        raise GrammarError(kind, f"invalid grammar: {e}") from None
    raise GrammarError(kind, f"unknown grammar kind {kind!r}")


@functools.lru_cache(maxsize=512)
def _check(kind: str, source: str) -> str:
    """'' when valid, else the error message (cached: clients resend the same schemas)."""
    try:
        text = grammar_text(kind, source)
    except GrammarError as e:
        return e.message
    err = _llg().LLMatcher.validate_grammar(text)
    return f"invalid grammar: {err}" if err else ""


def check_grammar(kind: str, source: str) -> None:
    """Raise `GrammarError` (field = `kind`) unless the grammar compiles. Tokenizer-free, so
    callable on the request path; milliseconds for ordinary schemas."""
    err = _check(kind, source)
    if err:
        raise GrammarError(kind, err)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def forced_tokens(self) -> list[int]:
        # llguidance's fast-forward tokens: the forced bytes, tokenized only as far as no
        # later byte could change their tokenization.
        return list(self._m.compute_ff_tokens())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


class LLGuidanceBackend(GrammarBackend):
    """`tokenizer`: a fast HF tokenizer; `vocab_size`: the model's logits width (masks cover
    max(that, the tokenizer's size) tokens; ids the tokenizer lacks are never allowed);
    `eos_token_ids`: the ids that may end a request where the grammar accepts."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.hf

        self.vocab_size = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=list(eos_token_ids) or None)

    def compile(self, kind: str, source: str) -> object:
        """A pristine matcher: llguidance builds the parser per matcher, so the compiled form
        is one matcher at the start state, deep-copied for each request (cheap)."""
        llg = _llg()
        m = llg.LLMatcher(self.tokenizer, grammar_text(kind, source), log_level=0)
        if m.is_error():
            raise GrammarError(kind, f"invalid grammar: {m.get_error()}")
        return m

    def matcher(self, compiled: object) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())  # type: ignore[attr-defined]
