"""`NoPrefixCache`: the prefix cache when `disable_radix_cache=True`.

Nothing is shared: a request's every slot stays private until it finishes, when the KV owner
frees them all (`keeps_kv` is False). Chunked prefill still works because the request's row
keeps the earlier chunks' slots.
"""

from __future__ import annotations

from typing import Any

import torch

from radixrt.core.logprobs import TokenScores
from radixrt.mem.base_prefix_cache import BasePrefixCache, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)


class NoPrefixCache(BasePrefixCache):
    keeps_kv = False

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(indices=_EMPTY, last_node=None)

    def insert(self, key: list[int], value: torch.Tensor,
               scores: TokenScores | None = None) -> int:
        raise NotImplementedError("NoPrefixCache keeps nothing (keeps_kv is False)")

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def parent(self, node: Any) -> Any:
        return None

    def evict(self, num_tokens: int) -> torch.Tensor:
        return _EMPTY

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
