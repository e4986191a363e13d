"""The grammar seam: what the scheduler needs from a constrained-decoding library.

A grammar is named by its key `(kind, source)` (`SamplingParams.grammar_key`): kind is
"json_schema", "regex" or "ebnf". A backend compiles a key once (the result is shared by every
request with that key) and gives each request its own `GrammarMatcher`, which follows the
tokens that request generated.

Token masks use one layout everywhere (`radixrt.sampling.vocab_mask` applies them): an int32
tensor [rows, ceil(vocab / 32)] where bit j of word w (little-endian) allows token 32 * w + j.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from radixrt.core.errors import InvalidRequestError


def bitmask_words(vocab_size: int) -> int:
    """int32 words per mask row."""
    return (vocab_size + 31) // 32


class GrammarError(InvalidRequestError):
    """A grammar that does not compile; `field` is the SamplingParams field that held it."""


class GrammarMatcher(ABC):
    """One request's position in its grammar. Invariant: it has consumed exactly the tokens
    the request generated (a retracted request keeps it; a finished one drops it)."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one generated token; False (and an error state) if the grammar forbids
        it. An end-of-sequence token is accepted only where the grammar may end."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 CPU, contiguous)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted and nothing may follow: the request is complete."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here, in the backend's tokenization of the forced
        text, not consumed (the caller accepts them); [] when nothing is forced or the backend
        cannot tell. Only what every continuation shares may be returned."""
        return []


class GrammarBackend(ABC):
    """Compiles grammars against one tokenizer. `compile` may be slow and runs off the
    scheduling loop (`GrammarCompiler`); everything else is per step and cheap."""

    vocab_size: int

    @abstractmethod
    def compile(self, kind: str, source: str) -> object:
        """A compiled grammar, shareable by any number of matchers; `GrammarError` naming
        `kind` if it does not compile."""

    @abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` ← matchers[i]'s mask. Backends may batch this."""
        for i, m in enumerate(matchers):
            m.fill_bitmask(bitmask, i)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, bitmask_words(self.vocab_size), dtype=torch.int32)
