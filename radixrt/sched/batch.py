"""Turns the scheduler's choice for one step into KV allocations and a `ForwardBatch`."""

from __future__ import annotations

import torch

from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.sched.kv_owner import KVOwner, OutOfKVSlots
from radixrt.sched.prompt_scores import PromptScoring
from radixrt.sched.req import Req

__all__ = ["BatchBuilder", "OutOfKVSlots"]


class BatchBuilder:
    """Builds a step's batch: rows and slots through the `KVOwner` (which writes them into the
    request-to-token table), then the metadata, which `ForwardBatch.build` only reads."""

    def __init__(self, kv: KVOwner, device: torch.device):
        self.kv = kv
        self.device = device
        # The last batch's prompt-scoring rows, in `score_rows` order: (request's scoring
        # state, prompt position).
        self.scored: list[tuple[PromptScoring, int]] = []

    def build_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Each req computes `all_ids()[kv_len : kv_len + extend_len]` on top of its KV."""
        for req in reqs:
            if not self.kv.take_row(req):
                raise RuntimeError("no free request row (admission budget violated)")
        # A batch that scores prompt tokens runs batch-invariant, so the scores (and the K/V
        # later scores build on) do not depend on batch companions or cache hits.
        invariant = any(r.scoring is not None for r in reqs)
        self.kv.start_step(reqs, [r.extend_len for r in reqs], invariant)
        ids: list[int] = []
        rows: list[int] = []
        targets: list[int] = []
        self.scored = []
        for req in reqs:
            if req.scoring is not None:
                for t in req.scoring.targets(req.kv_len, req.extend_len):
                    rows.append(len(ids) + (t - 1 - req.kv_len))  # position t-1 scores t
                    targets.append(req.origin_input_ids[t])
                    self.scored.append((req.scoring, t))
            ids.extend(req.all_ids()[req.kv_len : req.kv_len + req.extend_len])
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, ids, [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            [r.kv_len for r in reqs], [r.extend_len for r in reqs],
            self.kv.req_pool.req_to_token, self.device,
        )
        fb.batch_invariant = invariant
        if rows:
            fb.score_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            fb.score_targets = torch.tensor(targets, dtype=torch.int64)
        return fb

    def build_mixed(self, extend: list[Req], decode: list[Req]) -> ForwardBatch:
        """An extend step that also advances each of `decode` (running requests, whose KV holds
        all but their last sampled token, and any tokens their grammar forced after it) by
        those `pending()` tokens: rows `extend ++ decode`. The decode rows are short extends
        on top of their KV, so one forward pass serves both and the weight reads of the
        prefill carry the decode tokens."""
        for req in decode:
            req.extend_len = req.pending()
        return self.build_extend([*extend, *decode])

    def build_decode(self, reqs: list[Req]) -> ForwardBatch:
        """One new token per request: the last sampled one, at position `kv_len`. When a
        grammar forced tokens after it (`pending()` > 1), the step is an extend of every row's
        pending tokens instead (rows of one token still attend as decode rows there)."""
        if any(r.pending() != 1 for r in reqs):
            for req in reqs:
                req.extend_len = req.pending()
            return self.build_extend(reqs)
        self.scored = []
        for req in reqs:
            req.extend_len = 1
        self.kv.start_step(reqs, [1] * len(reqs))
        return ForwardBatch.build(
            ForwardMode.DECODE, [r.output_ids[-1] for r in reqs],
            [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            [r.kv_len for r in reqs], [1] * len(reqs),
            self.kv.req_pool.req_to_token, self.device,
        )
