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
        # The last decode batch's sampled row per request when some request has several rows
        # (`build_decode`), else None (row i is request i).
        self.sample_rows: list[int] | None = None

    def build_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Each req computes `all_ids()[kv_len : kv_len + extend_len]` on top of its KV."""
        self.sample_rows = None
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
        fb.decode_rows_from = len(reqs)  # build_mixed moves it to its first decode row
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
            if req.draft_ids:
                raise ValueError(f"{req.rid}: draft tokens ride only in decode steps")
            req.extend_len = req.pending()
        fb = self.build_extend([*extend, *decode])
        fb.decode_rows_from = len(extend)
        return fb

    def build_decode(self, reqs: list[Req]) -> ForwardBatch:
        """Each request computes its `pending()` tokens (its last sampled one, plus any its
        grammar forced after it) and its `draft_ids`: one decode row per token, the rows of a
        request consecutive over its one request-to-token row, each at its own position and
        attending to every token before it (those of the rows before it included: the step
        stores every row's K/V before any row attends). A batch of one token per request is
        the plain decode batch. `sample_rows` is then None, else each request's row of its last
        pending token, in request order: the request samples that row's logits, and a request
        with drafts reads the argmax of that row and of each draft's row after it."""
        self.scored = []
        lens = [r.pending() + len(r.draft_ids) for r in reqs]
        for req, n in zip(reqs, lens, strict=True):
            req.extend_len = n
        self.kv.start_step(reqs, lens)
        table = self.kv.req_pool.req_to_token
        if all(n == 1 for n in lens):
            self.sample_rows = None
            return ForwardBatch.build(
                ForwardMode.DECODE, [r.output_ids[-1] for r in reqs],
                [r.req_pool_idx for r in reqs],  # type: ignore[misc]
                [r.kv_len for r in reqs], [1] * len(reqs), table, self.device,
            )
        ids: list[int] = []
        rows: list[int] = []
        prefix: list[int] = []
        self.sample_rows = []
        for req in reqs:
            pending = req.pending()
            self.sample_rows.append(len(ids) + pending - 1)
            toks = [*req.output_ids[len(req.output_ids) - pending :], *req.draft_ids]
            ids.extend(toks)
            rows.extend([req.req_pool_idx] * len(toks))  # type: ignore[list-item]
            prefix.extend(range(req.kv_len, req.kv_len + len(toks)))
        return ForwardBatch.build(ForwardMode.DECODE, ids, rows, prefix, [1] * len(ids), table,
                                  self.device)
