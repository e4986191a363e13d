"""N-gram speculative decoding (prompt lookup): draft tokens from a request's own text, verified
in the next decode step.

A request whose text ends with an n-gram it has seen before proposes the tokens that followed
that n-gram's latest earlier occurrence (agents and editors copy from their context: arguments
of a tool call, code being edited, quoted passages). The next decode step computes the
request's last sampled token and its drafts as consecutive rows (`BatchBuilder`), and the
sampler picks a token at each of them as one-token-a-step decoding would at that position
(greedy: the argmax; sampled: the same settings, penalty counts and seeded noise as that
position gets, `Scheduler._sampling_info`). Drafts are accepted while each equals the token
picked before it, and the token picked after the last accepted one is the step's own. Every
token a request outputs is then the one picked for its position from the logits of its true
prefix: for greedy and seeded requests exactly the tokens one step at a time gives (same
logits, same pick); for unseeded ones a sample from the same distributions (fresh noise per
row). Speculation changes how many steps a request takes, not what it outputs; the rejected
drafts' KV slots go back to the pool (`KVOwner.commit(drop=...)`).
"""

from __future__ import annotations

from radixrt.sched.req import Req
from radixrt.sched.step_cost import StepCostModel

# A request's acceptance odds are counts of accepted and rejected drafts, decayed by ODDS_DECAY
# per verification (about the last five count), and by IDLE_DECAY per step in which they kept
# it from drafting, so a request whose drafts stopped paying is tried again once its record
# has faded back towards the prior (one of each): after a few to a few tens of steps.
ODDS_DECAY = 0.8
IDLE_DECAY = 0.95


class NgramIndex:
    """The latest occurrence of every n-gram (`min_n..max_n` tokens) of one growing token
    sequence, by where it ends. Appending never moves earlier tokens, so the index only adds
    the n-grams ending at new positions."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest
        self.indexed = 0  # n-grams ending at or before this position are in `ends`

    def _index_upto(self, ids: list[int], end: int) -> None:
        for e in range(max(self.indexed + 1, self.min_n), end + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.ends[tuple(ids[e - n : e])] = e
        self.indexed = max(self.indexed, end)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
        `ids` ends with (none: no n-gram of `min_n`+ tokens occurred before)."""
        total = len(ids)
        if total <= self.min_n or k <= 0:
            return []
        self._index_upto(ids, total - 1)  # occurrences that end before the text does
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(ids[total - n :]))
            if end is not None:
                return ids[end : end + k]
        return []


class NgramSpeculator:
    """Proposes drafts for a decode step's requests and counts what verification accepted.
    `drafted_tokens` / `accepted_tokens` / `verify_steps` are monotonic totals since start-up.

    How many drafts a request gets: the j-th draft is accepted with probability about p^j
    (p: the request's acceptance odds, `Req.spec_acc` / `spec_rej`), which is worth p^j of
    a token, i.e. p^j x (step time / rows) of time, and costs a row (`StepCostModel`'s c):
    drafts are added while the first outweighs the second, within `max_rows` rows in all and
    `num_draft_tokens` per request. Until the cost model can tell (the rows seen have not
    varied yet) every request drafts up to those limits, which makes them vary."""

    def __init__(self, num_draft_tokens: int, min_n: int, max_n: int, max_rows: int,
                 max_context_len: int):
        self.num_draft_tokens = num_draft_tokens
        self.max_context_len = max_context_len
        self.min_n = min_n
        self.max_n = max_n
        self.max_rows = max_rows
        self.cost = StepCostModel()
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.verify_steps = 0

    @staticmethod
    def eligible(req: Req) -> bool:
        """Any request but those that report logprobs (each token's distribution is sent),
        follow a grammar (its matcher would have to walk the drafts) or score their prompt.
        Sampled ones included: each draft row is sampled as that position would be
        (`Scheduler._sampling_info`), so a draft stands when it is what sampling picks there."""
        return (not req.sampling.logprobs and req.grammar is None and req.scoring is None
                and not req.finished)

    @staticmethod
    def odds(req: Req) -> float:
        """The request's estimated chance that a draft is accepted given the one before it
        was (prior: one accepted, one rejected)."""
        return (req.spec_acc + 1) / (req.spec_acc + req.spec_rej + 2)

    def worth(self, req: Req, base_rows: int) -> int:
        """How many drafts `req` should get in a step of `base_rows` rows (before caps)."""
        fit = self.cost.fit()
        if fit is None:
            return self.num_draft_tokens
        a, c = fit
        if c <= 0:
            return self.num_draft_tokens
        per_token = (a + c * base_rows) / base_rows
        p = self.odds(req)
        k, gain = 0, p
        while k < self.num_draft_tokens and gain * per_token >= c:
            k += 1
            gain *= p
        return k

    def propose(self, reqs: list[Req]) -> None:
        """Set each request's `draft_ids` for the coming decode step (`worth` drafts each, the
        step within `max_rows` rows), never past its `max_new_tokens` or the context (the
        token the step samples after them included)."""
        base = sum(r.pending() for r in reqs)
        rows = base
        for req in reqs:
            req.draft_ids = []
            room = self.max_rows - rows
            if room <= 0 or not self.eligible(req):
                continue
            k = min(self.worth(req, base), room, req.remaining_new_tokens() - 1,
                    self.max_context_len - req.seq_len() - 1)
            if k <= 0:
                req.spec_acc *= IDLE_DECAY
                req.spec_rej *= IDLE_DECAY
                continue
            if req.ngram is None:
                req.ngram = NgramIndex(self.min_n, self.max_n)
            draft = req.ngram.propose(req.all_ids(), k)
            req.draft_ids = draft
            rows += len(draft)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds` (for the cost model)."""
        self.cost.observe(rows, seconds)

    def accept(self, req: Req, argmax: list[int]) -> list[int]:
        """The tokens a verified request takes this step: its drafts while each equals the
        argmax before it (`argmax[i]`: after the last pending token and drafts[:i]), then the
        argmax after the last accepted one. Updates the request's acceptance odds."""
        drafts = req.draft_ids
        m = 0
        while m < len(drafts) and argmax[m] == drafts[m]:
            m += 1
        self.verify_steps += 1
        self.drafted_tokens += len(drafts)
        self.accepted_tokens += m
        req.spec_acc = ODDS_DECAY * req.spec_acc + m
        req.spec_rej = ODDS_DECAY * req.spec_rej + (m < len(drafts))
        return [*drafts[:m], argmax[m]]

    def stats(self) -> dict[str, float | int]:
        fit = self.cost.fit()
        return {
            "spec_verify_steps_total": self.verify_steps,
            "spec_draft_tokens_total": self.drafted_tokens,
            "spec_accepted_tokens_total": self.accepted_tokens,
            "spec_accept_rate": (self.accepted_tokens / self.drafted_tokens
                                 if self.drafted_tokens else 0.0),
            # The cost model's fit: ms per step without rows, ms per row (None until fitted).
            "spec_step_ms": None if fit is None else round(fit[0] * 1e3, 3),
            "spec_row_ms": None if fit is None else round(fit[1] * 1e3, 3),
        }
