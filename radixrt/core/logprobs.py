"""`TokenLogprobs`: log-probabilities of tokens, carried from the scheduler up to the API.

Two uses: the sampler's report for each generated token, and prompt scores (`prompt_logprobs`
of an output), where entry j is about prompt token `logprob_start_len + j` given the tokens
before it. Prompt token 0 has no context, so its entry is `None` with no alternatives, as in
OpenAI's legacy `echo` + `logprobs` format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenLogprobs:
    """Log-probabilities of the chosen tokens, and the top alternatives at each position."""

    token_logprobs: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_logprobs.extend(other.token_logprobs)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)


@dataclass
class TokenScores:
    """The per-token payload the radix tree keeps beside each KV slot, aligned with a token
    sequence:
    - `logprob[i]`: log p(token i | tokens < i), NaN where never scored; `top_id[i]` /
      `top_logprob[i]`: the most likely token there. Only the top-1 alternative is kept (what
      eval harnesses read: lm-eval's `is_greedy`); wider `top_logprobs` are recomputed.
    - `exact[i]`: token i's K/V was computed by a batch-invariant step from exact K/V, so it is
      a bitwise function of tokens <= i alone; prompt scores only build on exact K/V.
    About 13 bytes a token, against tens of KB of K/V.
    """

    logprob: torch.Tensor  # float32 [n]
    top_id: torch.Tensor  # int64 [n]
    top_logprob: torch.Tensor  # float32 [n]
    exact: torch.Tensor  # bool [n]

    @classmethod
    def unknown(cls, n: int, exact_len: int = 0) -> TokenScores:
        return cls(torch.full((n,), float("nan")), torch.zeros(n, dtype=torch.int64),
                   torch.full((n,), float("nan")), torch.arange(n) < exact_len)

    def __len__(self) -> int:
        return int(self.logprob.numel())

    def known(self) -> torch.Tensor:
        """bool [n]: positions holding a score."""
        return ~torch.isnan(self.logprob)

    def exact_len(self) -> int:
        """Length of the leading run of exact tokens."""
        bad = (~self.exact).nonzero()
        return int(bad[0]) if bad.numel() else len(self)

    def slice(self, start: int, end: int) -> TokenScores:
        return TokenScores(self.logprob[start:end].clone(), self.top_id[start:end].clone(),
                           self.top_logprob[start:end].clone(), self.exact[start:end].clone())

    def fill_unknown(self, other: TokenScores, offset: int = 0) -> None:
        """Copy `other`'s known scores into positions `offset ..` of self that hold none (a
        score, once known, never changes: the first computation is the canonical one).
        `exact` describes K/V slots, which a fill never replaces, so it is left alone."""
        n = min(len(other), len(self) - offset)
        if n <= 0:
            return
        take = torch.isnan(self.logprob[offset : offset + n]) & other.known()[:n]
        for mine, theirs in ((self.logprob, other.logprob), (self.top_id, other.top_id),
                             (self.top_logprob, other.top_logprob)):
            view = mine[offset : offset + n]
            view[take] = theirs[:n][take]

    @staticmethod
    def cat(parts: list[TokenScores]) -> TokenScores:
        if not parts:
            return TokenScores.unknown(0)
        return TokenScores(torch.cat([p.logprob for p in parts]),
                           torch.cat([p.top_id for p in parts]),
                           torch.cat([p.top_logprob for p in parts]),
                           torch.cat([p.exact for p in parts]))
