"""`TokenLogprobs`: log-probabilities of tokens, carried from the scheduler up to the API.

Two uses: the sampler's report for each generated token, and prompt scores (`prompt_logprobs`
of an output), where entry j is about prompt token `logprob_start_len + j` given the tokens
before it. Prompt token 0 has no context, so its entry is `None` with no alternatives, as in
OpenAI's legacy `echo` + `logprobs` format.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
