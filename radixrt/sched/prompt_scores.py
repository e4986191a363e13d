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
        return bool(self._known(pos, pos + 1)[0])

    def _known(self, lo: int, hi: int) -> torch.Tensor:
        """bool [hi - lo]: whether positions lo..hi-1 hold what the caller asked for."""
        if self.top_k > 1:
            return torch.tensor([p in self.wide for p in range(lo, hi)], dtype=torch.bool)
        return ~torch.isnan(self.scores.logprob[lo:hi])

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
        lo, hi = self.first_needed, min(match_len, self.num_prompt - 1) + 1
        if lo >= hi:
            return match_len
        missing = (~self._known(lo, hi)).nonzero()
        return match_len if missing.numel() == 0 else lo + int(missing[0]) - 1

    def targets(self, kv_len: int, extend_len: int) -> list[int]:
        """Prompt positions this step can score: `t` for each computed position `t - 1`."""
        lo = max(kv_len + 1, self.first_needed)
        hi = min(kv_len + extend_len, self.num_prompt - 1)
        if lo > hi:
            return []
        return (torch.arange(lo, hi + 1)[~self._known(lo, hi + 1)]).tolist()

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
        lo = max(self.start, 1)
        if self.start == 0 and self.num_prompt:
            out.token_logprobs.append(None)
            out.top_ids.append([])
            out.top_logprobs.append([])
        if lo >= self.num_prompt:
            self.reported = True
            return out
        if not bool(self._known(lo, self.num_prompt).all()):
            raise RuntimeError("a wanted prompt position was never scored")
        out.token_logprobs.extend(self.scores.logprob[lo:].tolist())
        if self.top_k > 1:
            for pos in range(lo, self.num_prompt):
                ids, lps = self.wide[pos]
                out.top_ids.append(list(ids))
                out.top_logprobs.append(list(lps))
        elif self.top_k == 1:
            out.top_ids.extend([i] for i in self.scores.top_id[lo:].tolist())
            out.top_logprobs.extend([v] for v in self.scores.top_logprob[lo:].tolist())
        else:
            out.top_ids.extend([] for _ in range(lo, self.num_prompt))
            out.top_logprobs.extend([] for _ in range(lo, self.num_prompt))
        self.reported = True
        return out


def record_scores(scored: list[tuple[PromptScoring, int]], rows: RowScores | None) -> None:
    """Store a step's computed scores (`rows[i]` is that of `scored[i]`: a request's scoring
    state and a prompt position), one indexed write per request."""
    if rows is None:
        return
    by_req: dict[int, tuple[PromptScoring, list[int], list[int]]] = {}
    for i, (scoring, pos) in enumerate(scored):
        entry = by_req.setdefault(id(scoring), (scoring, [], []))
        entry[1].append(i)
        entry[2].append(pos)
    for scoring, rows_i, positions in by_req.values():
        ri = torch.tensor(rows_i)
        pi = torch.tensor(positions)
        scoring.scores.logprob[pi] = rows.logprob[ri]
        scoring.scores.top_id[pi] = rows.top_ids[ri, 0]
        scoring.scores.top_logprob[pi] = rows.top_logprobs[ri, 0]
        if scoring.top_k > 1:
            ids = rows.top_ids[ri, : scoring.top_k].tolist()
            lps = rows.top_logprobs[ri, : scoring.top_k].tolist()
            for j, pos in enumerate(positions):
                scoring.wide[pos] = (ids[j], lps[j])
