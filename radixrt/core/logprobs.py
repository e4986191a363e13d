"""`TokenLogprobs`: what the sampler reports per sampled position, carried up to the API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probabilities of the chosen tokens, and the top alternatives at each position."""

    token_logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_logprobs.extend(other.token_logprobs)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)
