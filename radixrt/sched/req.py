"""`Req`: one request's state inside the scheduler."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.sampling_params import SamplingParams
from radixrt.grammar.base import GrammarMatcher
from radixrt.sampling.batch_info import SeenIds
from radixrt.sched.prompt_scores import PromptScoring

_EMPTY = torch.empty(0, dtype=torch.int64)


class NgramIndexLike(Protocol):
    """What a request keeps for its drafts (`radixrt.sched.speculative.NgramIndex`)."""

    def propose(self, ids: list[int], k: int) -> list[int]: ...


class Req:
    """KV bookkeeping (see `BasePrefixCache` for who owns which slot):
    - `req_pool_idx`: the ReqToTokenPool row, held from admission to finish/retraction.
    - `kv_len`: tokens of `all_ids()` whose KV is in the row (`row[:kv_len]` valid).
    - `prefix_indices`/`last_node`: the cache-owned, locked head of the row.
    - `exact_len`: how many leading KV tokens are exact (batch-invariant, from exact K/V).
    Everyone may read these; only `radixrt.sched.kv_owner.KVOwner` assigns them (checked
    by an AST test in tests/test_scheduler.py).
    """

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                 stream: bool = True):
        self.rid = rid
        self.stream = stream  # outputs are shown as they come (`GenerateReq.stream`)
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        self.sampling = sampling
        self.arrival_time = time.monotonic()
        # KV state
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.exact_len = 0  # leading KV tokens computed batch-invariantly (`TokenScores.exact`)
        # Scheduling state
        self.match_len = 0  # cached prefix length as last seen by the policy
        self.matched = False  # match_len was set since the request (re)entered the queue
        self.cached_tokens: int | None = None  # prompt tokens served by the cache (first admission)
        self.extend_len = 0  # tokens this step computes (set by the prefill adder)
        self.num_retractions = 0
        self.counted = False  # prompt/cached tokens added to the counters
        self.finish_counted = False  # counted in finished_requests (exactly once)
        # Output state
        self.finish_reason: str | None = None
        self.error = ""
        self.send_offset = 0  # output_ids already sent to the detokenizer
        self.pending_logprobs: TokenLogprobs | None = None
        # Prompt scores (`logprob_start_len >= 0`), reported once when the prompt is computed.
        self.scoring: PromptScoring | None = (
            PromptScoring(len(input_ids), sampling.logprob_start_len, sampling.top_logprobs)
            if sampling.logprob_start_len >= 0 else None)
        self.pending_prompt_logprobs: TokenLogprobs | None = None
        # Grammar (`sampling.grammar_key`): the future compiled grammar while the request waits
        # for it, then its matcher, which has consumed exactly `output_ids` (kept across
        # retraction, dropped when the request finishes).
        self.grammar_future: Future | None = None
        self.grammar: GrammarMatcher | None = None
        # Speculative decoding (`radixrt.sched.speculative`): tokens proposed to follow
        # `all_ids()`, computed with the pending ones in the next decode step and kept only as
        # far as verification accepts them (never in `output_ids` before that); the request's
        # n-gram index and its drafts' decayed accepted / rejected counts.
        self.draft_ids: list[int] = []
        # The distinct ids of the prompt and output, for a repetition penalty (built on its first
        # sampled step, extended by each step's new tokens: `SeenIds`).
        self.seen_ids: SeenIds | None = None
        self.ngram: NgramIndexLike | None = None
        self.spec_acc = 0.0
        self.spec_rej = 0.0

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def pending(self) -> int:
        """Tokens of `all_ids()` without KV: a decoding request's last sampled token (1), plus
        the tokens its grammar forced after it (`OutputProcessor.fast_forward`)."""
        return self.seq_len() - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))

    def __repr__(self) -> str:
        return (f"Req({self.rid}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
                f"kv={self.kv_len}, row={self.req_pool_idx})")
