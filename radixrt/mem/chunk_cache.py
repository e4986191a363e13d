"""`NoPrefixCache`: the prefix cache when `disable_radix_cache=True`.

Nothing is shared: a request's every slot stays private until it finishes, when all are freed.
Chunked prefill still works because the request's row keeps the earlier chunks' slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixrt.mem.base_prefix_cache import BasePrefixCache, MatchResult
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

if TYPE_CHECKING:
    from radixrt.sched.req import Req

_EMPTY = torch.empty(0, dtype=torch.int64)


class NoPrefixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(indices=_EMPTY, last_node=None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        return 0  # nothing is kept: the caller frees `value` itself

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_unfinished_req(self, req: Req) -> None:
        pass  # the row keeps every computed slot; the next chunk extends past `req.kv_len`

    def cache_finished_req(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]
        self.token_to_kv_pool.free(slots.to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.release_kv()

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def owned_slots(self) -> torch.Tensor:
        return _EMPTY

    def reset(self) -> None:
        pass

    def check_invariants(self) -> None:
        pass
