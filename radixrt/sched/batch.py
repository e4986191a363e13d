"""Turns the scheduler's choice for one step into KV allocations and a `ForwardBatch`."""

from __future__ import annotations

import torch

from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.sched.kv_owner import KVOwner, OutOfKVSlots
from radixrt.sched.req import Req

__all__ = ["BatchBuilder", "OutOfKVSlots"]


class BatchBuilder:
    """Builds a step's batch: rows and slots through the `KVOwner` (which writes them into the
    request-to-token table), then the metadata, which `ForwardBatch.build` only reads."""

    def __init__(self, kv: KVOwner, device: torch.device):
        self.kv = kv
        self.device = device

    def build_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Each req computes `all_ids()[kv_len : kv_len + extend_len]` on top of its KV."""
        for req in reqs:
            if not self.kv.take_row(req):
                raise RuntimeError("no free request row (admission budget violated)")
        self.kv.start_step(reqs, [r.extend_len for r in reqs])
        ids: list[int] = []
        for req in reqs:
            ids.extend(req.all_ids()[req.kv_len : req.kv_len + req.extend_len])
        return ForwardBatch.build(
            ForwardMode.EXTEND, ids, [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            [r.kv_len for r in reqs], [r.extend_len for r in reqs],
            self.kv.req_pool.req_to_token, self.device,
        )

    def build_decode(self, reqs: list[Req]) -> ForwardBatch:
        """One new token per request: the last sampled one, at position `kv_len`."""
        for req in reqs:
            req.extend_len = 1
        self.kv.start_step(reqs, [1] * len(reqs))
        return ForwardBatch.build(
            ForwardMode.DECODE, [r.output_ids[-1] for r in reqs],
            [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            [r.kv_len for r in reqs], [1] * len(reqs),
            self.kv.req_pool.req_to_token, self.device,
        )
