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


class OutputProcessor:
    def __init__(self, kv: KVOwner, eos_token_ids: tuple[int, ...], max_context_len: int):
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len

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
                       logprobs: list[TokenLogprobs | None]) -> list[Req]:
        """Requests whose whole sequence is now in KV sample a token; chunked ones do not and
        are returned (mid-prefill, to continue next step)."""
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
            else:
                chunked.append(req)
            if not req.finished:
                self.kv.cache_unfinished(req)
        return chunked

    def process_decode(self, reqs: list[Req], next_ids: list[int],
                       logprobs: list[TokenLogprobs | None]) -> None:
        for i, req in enumerate(reqs):
            self.kv.commit(req)
            if not req.finished:
                self._append(req, next_ids[i], logprobs[i])

    @staticmethod
    def collect(reqs: list[Req]) -> TokenBatchOut:
        """New tokens since the last send (or a final out) for every request in `reqs`."""
        outs = []
        for req in reqs:
            new = req.output_ids[req.send_offset :]
            if (not new and not req.finished and req.pending_logprobs is None
                    and req.pending_prompt_logprobs is None):
                continue
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
