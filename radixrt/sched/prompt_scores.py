"""Prompt scores of one request: which prompt positions it wants, which the radix tree
already holds, which this step computes, and what finally goes to the caller.

A prompt token's log-probability depends only on the tokens before it, like its KV, so the
tree stores it beside the KV slot (`TokenScores`, top-1 alternative included). Scoring token
`t` needs the logits at position `t - 1`, so a request wanting token `t` scored where the tree
has no score must compute position `t - 1`: admission cuts its cached prefix to `t - 1` tokens
(`usable_prefix`). Everything the tree holds is read, nothing scored is computed twice.
"""

from __future__ import annotations

import torch

from radixrt.core.logprobs import TokenLogprobs, TokenScores
from radixrt.model.scoring import RowScores


class PromptScoring:
    """Per-request state. `scores` covers every prompt position (NaN = not known yet); `wide`
    holds the `top_k` > 1 alternatives of positions computed by this request (the tree keeps
    only the top-1, so those are never read from it)."""

    def __init__(self, num_prompt: int, start: int, top_k: int):
        self.num_prompt = num_prompt
        self.start = max(start, 0)
        self.top_k = top_k
        self.scores = TokenScores.unknown(num_prompt)
        self.wide: dict[int, tuple[list[int], list[float]]] = {}
        self.reported = False

    @property
    def first_needed(self) -> int:
        """Position 0 has no context: it is reported as None, never scored."""
        return max(self.start, 1)

    def known(self, pos: int) -> bool:
        if self.top_k > 1:
            return pos in self.wide
        return not bool(torch.isnan(self.scores.logprob[pos]))

    def take_from_tree(self, tree_scores: TokenScores) -> int:
        """Adopt the tree's scores of the matched prefix (positions it holds, we lack); returns
        how much of the prefix is usable: its exact run (see `usable_prefix`)."""
        self.scores.fill_unknown(tree_scores.slice(0, min(len(tree_scores), self.num_prompt)))
        return self.usable_prefix(tree_scores.exact_len())

    def usable_prefix(self, match_len: int) -> int:
        """How much of a `match_len`-token cached prefix (all exact) the request can use: every
        wanted position at or after the prefix's end is scored by this request, which needs
        the logits of the position before it, so the prefix stops before the first position
        neither known nor computable."""
        for pos in range(self.first_needed, min(match_len, self.num_prompt - 1) + 1):
            if not self.known(pos):
                return pos - 1
        return match_len

    def targets(self, kv_len: int, extend_len: int) -> list[int]:
        """Prompt positions this step can score: `t` for each computed position `t - 1`."""
        lo = max(kv_len + 1, self.first_needed)
        hi = min(kv_len + extend_len, self.num_prompt - 1)
        return [t for t in range(lo, hi + 1) if not self.known(t)]

    def record(self, pos: int, logprob: float, top_ids: list[int], top_lps: list[float]) -> None:
        self.scores.logprob[pos] = logprob
        self.scores.top_id[pos] = top_ids[0]
        self.scores.top_logprob[pos] = top_lps[0]
        if self.top_k > 1:
            self.wide[pos] = (top_ids[: self.top_k], top_lps[: self.top_k])

    def tree_payload(self, length: int, exact_len: int) -> TokenScores:
        """Payload for the first `length` tokens of the sequence: the scores that build on
        exact K/V only (token t's score reads K/V < t), exactness from `exact_len`."""
        out = TokenScores.unknown(length, exact_len)
        n = min(length, self.num_prompt, exact_len + 1)
        out.fill_unknown(self.scores.slice(0, n))
        return out

    def report(self) -> TokenLogprobs:
        """Entries for prompt positions `start ..`; raises if one was never scored."""
        out = TokenLogprobs()
        for pos in range(self.start, self.num_prompt):
            if pos == 0:
                out.token_logprobs.append(None)
                out.top_ids.append([])
                out.top_logprobs.append([])
                continue
            if not self.known(pos):
                raise RuntimeError(f"prompt position {pos} was never scored")
            out.token_logprobs.append(float(self.scores.logprob[pos]))
            if self.top_k > 1:
                ids, lps = self.wide[pos]
                out.top_ids.append(list(ids))
                out.top_logprobs.append(list(lps))
            elif self.top_k == 1:
                out.top_ids.append([int(self.scores.top_id[pos])])
                out.top_logprobs.append([float(self.scores.top_logprob[pos])])
            else:
                out.top_ids.append([])
                out.top_logprobs.append([])
        self.reported = True
        return out


def record_scores(scored: list[tuple[PromptScoring, int]], rows: RowScores | None) -> None:
    """Store a step's computed scores (`rows[i]` is that of `scored[i]`: a request's scoring
    state and a prompt position)."""
    if rows is None:
        return
    lp = rows.logprob.tolist()
    ids = rows.top_ids.tolist()
    tops = rows.top_logprobs.tolist()
    for i, (scoring, pos) in enumerate(scored):
        scoring.record(pos, lp[i], ids[i], tops[i])
