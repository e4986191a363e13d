"""After a forward pass: append sampled tokens, decide who finished, hand KV to the cache, and
collect what goes to the detokenizer."""

from __future__ import annotations

from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.messages import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    ReqTokenOut,
    TokenBatchOut,
    Usage,
)
from radixrt.sched.kv_owner import KVOwner
from radixrt.sched.req import Req

# Tokens a request read only once finished (not streamed, no stop strings) gathers between
# outs: nothing downstream acts on them before it finishes, so each out carries many tokens
# (fewer detokenizer and front-end wake-ups); not only at the end, so the detokenizer's work
# and the caller's usage counts advance with it.
HELD_INTERVAL = 32
# A grammar's forced run after a sampled token is fast-forwarded when it has at least this
# many tokens per row of the step (`OutputProcessor.fast_forward`).
MID_RUN_PER_ROW = 2
# ... and the grammar is not even asked when the step's rule wants more than this many: forced
# runs that long are rare, and asking costs about a mask's time per row (7-20 us with
# llguidance), so steps of more than 8 rows skip it.
MAX_MID_RUN = 16


class OutputProcessor:
    """`stream_interval`: tokens a streamed request gathers between outs (`due`).
    `fast_forward`: append the tokens a request's grammar forces (`fast_forward`)."""

    def __init__(self, kv: KVOwner, eos_token_ids: tuple[int, ...], max_context_len: int,
                 stream_interval: int = 1, fast_forward: bool = True):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len
        self.stream_interval = stream_interval
        self.fast_forward_on = fast_forward
        self.forced_tokens = 0  # tokens appended by fast_forward (monotonic)

    def fast_forward(self, req: Req, min_tokens: int = 1) -> int:
        """Append the tokens `req`'s grammar forces from here, if at least `min_tokens` (its
        matcher accepts them, the usual finish rules apply to each); returns how many. They
        have no KV yet: the next step computes them with the row's next token (`Req.pending()`
        > 1: one decode row each in a decode step, `BatchBuilder.build_decode`; a short extend
        row in a mixed step), instead of one decode step each. Not for requests that report
        logprobs (a forced token has no sampled distribution) or score their prompt.

        Where: at admission (they join the prompt's prefill: free), and after a sampled token
        when at least `MID_RUN_PER_ROW` x the step's rows are forced. Set when a step with a
        row to catch up ran as an extend (about 2 decode steps' time more at 4-8 rows: every
        forced run fast-forwarded took 1.11x the time of none at 4 rows, 1.09x at 8). Since
        the catch-up rows ride the decode step, every run fast-forwarded measured 1.05 / 1.05 /
        1.02x faster than none at 1 / 4 / 8 rows against this rule's 1.07 / 1.01 / 1.03x
        (bench/grammar_fast_forward.py, 3 rounds; within the host's noise), so the rule
        stayed."""
        g = req.grammar
        if (not self.fast_forward_on or g is None or req.finished or req.sampling.logprobs
                or req.scoring is not None or min_tokens > MAX_MID_RUN):
            return 0
        forced = g.forced_tokens()
        if len(forced) < min_tokens:
            return 0
        n = 0
        for token in forced:
            self._append(req, token, None)
            n += 1
            if req.finished:
                break
        self.forced_tokens += n
        return n

    def _append(self, req: Req, token: int, logprobs: TokenLogprobs | None) -> None:
        req.output_ids.append(token)
        if logprobs is not None:
            if req.pending_logprobs is None:
                req.pending_logprobs = TokenLogprobs()
            req.pending_logprobs.extend(logprobs)
        sp = req.sampling
        g = req.grammar
        if (not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids:
            req.finish_reason = FINISH_STOP
        elif g is not None and token in self.eos_token_ids:
            # The mask allows EOS only where the grammar may end: it ends the request even
            # with ignore_eos (the grammar, not the model, decides when output is complete).
            req.finish_reason = FINISH_STOP
        elif g is not None and not g.accept_token(token):
            req.finish_reason = FINISH_ABORT
            req.error = f"internal error: token {token} violates the request's grammar"
        elif g is not None and g.is_terminated():
            req.finish_reason = FINISH_STOP  # the grammar accepted and nothing may follow
        elif len(req.output_ids) >= sp.max_new_tokens or req.seq_len() >= self.max_context_len:
            req.finish_reason = FINISH_LENGTH

    def process_extend(self, reqs: list[Req], next_ids: list[int],
                       logprobs: list[TokenLogprobs | None],
                       step_rows: int | None = None) -> list[Req]:
        """Requests whose whole sequence is now in KV sample a token; chunked ones do not and
        are returned (mid-prefill, to continue next step). `step_rows`: the step's rows
        (default: `reqs`), for `fast_forward`."""
        rows = len(reqs) if step_rows is None else step_rows
        chunked = []
        for i, req in enumerate(reqs):
            self.kv.commit(req)
            if req.finished:  # aborted while in flight
                continue
            if req.kv_len == req.seq_len():
                if req.scoring is not None and not req.scoring.reported:
                    req.pending_prompt_logprobs = req.scoring.report()
                if req.sampling.max_new_tokens == 0:  # scoring only: nothing is generated
                    req.finish_reason = FINISH_LENGTH
                else:
                    self._append(req, next_ids[i], logprobs[i])
                    self.fast_forward(req, MID_RUN_PER_ROW * rows)
            else:
                chunked.append(req)
            if not req.finished:
                self.kv.cache_unfinished(req)
        return chunked

    def process_decode(self, reqs: list[Req], next_ids: list[int],
                       logprobs: list[TokenLogprobs | None],
                       step_rows: int | None = None,
                       verified: list[list[int] | None] | None = None) -> None:
        """`verified[i]`: for a request that had `draft_ids`, the tokens verification accepted
        (`NgramSpeculator.accept`: accepted drafts, then the step's own token); they are
        appended in order under the usual finish rules, and the KV of drafts not appended is
        dropped. Every request's drafts are cleared."""
        rows = len(reqs) if step_rows is None else step_rows
        for i, req in enumerate(reqs):
            drafts = len(req.draft_ids)
            req.draft_ids = []
            accepted = verified[i] if verified is not None else None
            if accepted is None or req.finished:
                self.kv.commit(req, drop=drafts)
                if not req.finished:
                    self._append(req, next_ids[i], logprobs[i])
                    self.fast_forward(req, MID_RUN_PER_ROW * rows)
                continue
            # Drafts first (each may finish the request), then the bonus token; KV is kept for
            # the pending tokens and the drafts appended.
            appended = 0
            for token in accepted:
                self._append(req, token, None)
                appended += 1
                if req.finished:
                    break
            self.kv.commit(req, drop=drafts - min(appended, len(accepted) - 1))

    def due(self, req: Req) -> bool:
        """Whether `req` has an out to send now. Always: when it finished (or failed), with its
        prompt scores, and with its first token (time to first token is the same whatever the
        interval). Otherwise once `stream_interval` unsent tokens gathered; for a request that
        is not streamed and has no stop strings, `max(stream_interval, HELD_INTERVAL)` (stop
        strings are found by the detokenizer, so their text goes down every interval, as
        streamed: a held one would run past its stop for up to the interval)."""
        if req.finished or req.pending_prompt_logprobs is not None:
            return True
        unsent = len(req.output_ids) - req.send_offset
        if unsent == 0:
            return False
        if req.send_offset == 0:
            return True
        held = not req.stream and not req.sampling.stop
        return unsent >= (max(self.stream_interval, HELD_INTERVAL) if held
                          else self.stream_interval)

    def collect(self, reqs: list[Req]) -> TokenBatchOut:
        """The due outs (`due`) among `reqs`: each carries the tokens (and their logprobs)
        produced since the request's last out."""
        outs = []
        for req in reqs:
            if not self.due(req):
                continue
            new = req.output_ids[req.send_offset :]
            req.send_offset = len(req.output_ids)
            sp = req.sampling
            outs.append(ReqTokenOut(
                rid=req.rid, new_ids=new, finish_reason=req.finish_reason,
                usage=Usage(prompt_tokens=len(req.origin_input_ids),
                            cached_tokens=req.cached_tokens or 0,
                            completion_tokens=len(req.output_ids)),
                logprobs=req.pending_logprobs, prompt_logprobs=req.pending_prompt_logprobs,
                stop=sp.stop, skip_special_tokens=sp.skip_special_tokens, error=req.error,
            ))
            req.pending_logprobs = None
            req.pending_prompt_logprobs = None
        return TokenBatchOut(outs)
