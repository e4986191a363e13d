"""Turns the scheduler's choice for one step into KV allocations and a `ForwardBatch`."""

from __future__ import annotations

import torch

from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.sched.req import Req


class OutOfKVSlots(RuntimeError):
    pass


class BatchBuilder:
    """The one place that allocates rows/slots for a step and builds its metadata."""

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool,
                 cache: BasePrefixCache, device: torch.device):
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.cache = cache
        self.device = device
        self._pending: torch.Tensor | None = None

    def take_pending_slots(self) -> torch.Tensor | None:
        """Slots allocated for the current step that no request owns yet (until `kv_len`
        advances past them); returns and forgets them."""
        slots, self._pending = self._pending, None
        return slots

    def alloc_slots(self, n: int) -> torch.Tensor:
        """`n` free slots, evicting unlocked cache leaves (LRU) if needed."""
        short = n - self.kv_pool.available_size()
        if short > 0:
            self.cache.evict(short)
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise OutOfKVSlots(f"need {n} KV slots, {self.kv_pool.available_size()} free")
        self._pending = slots
        return slots

    def build_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Each req computes `all_ids()[kv_len : kv_len + extend_len]` on top of its KV."""
        for req in reqs:
            if req.req_pool_idx is None:
                row = self.req_pool.alloc()
                if row is None:
                    raise RuntimeError("no free request row (admission budget violated)")
                req.req_pool_idx = row
                p = len(req.prefix_indices)
                if p:
                    self.req_pool.req_to_token[row, :p] = req.prefix_indices.to(torch.int32)
        total = sum(r.extend_len for r in reqs)
        out_loc = self.alloc_slots(total)
        ids: list[int] = []
        for req in reqs:
            ids.extend(req.all_ids()[req.kv_len : req.kv_len + req.extend_len])
        return ForwardBatch.build(
            ForwardMode.EXTEND, ids, [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            [r.kv_len for r in reqs], [r.extend_len for r in reqs], out_loc,
            self.req_pool.req_to_token, self.device,
        )

    def build_decode(self, reqs: list[Req]) -> ForwardBatch:
        """One new token per request: the last sampled one, at position `kv_len`."""
        out_loc = self.alloc_slots(len(reqs))
        for req in reqs:
            req.extend_len = 1
        return ForwardBatch.build(
            ForwardMode.DECODE, [r.output_ids[-1] for r in reqs],
            [r.req_pool_idx for r in reqs],  # type: ignore[misc]
            [r.kv_len for r in reqs], [1] * len(reqs), out_loc,
            self.req_pool.req_to_token, self.device,
        )
