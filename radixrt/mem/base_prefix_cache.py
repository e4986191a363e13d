"""The prefix-cache seam: `RadixCache` (shared prefixes) or `NoPrefixCache` (radix disabled).

Slot ownership contract with the scheduler (see also `memory_pool`):
- A request owns the slots in its ReqToTokenPool row from `len(req.prefix_indices)` up to
  `req.kv_len` (its private tail). The first `len(req.prefix_indices)` slots belong to the cache,
  which keeps them alive because the request holds a lock on `req.last_node`.
- `cache_unfinished_req` / `cache_finished_req` hand the private tail to the cache; duplicates of
  tokens the cache already holds are freed only after the row points at the cache's copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixrt.sched.req import Req


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 slots of the longest cached prefix
    last_node: Any  # opaque handle: lock it to keep `indices` alive


class BasePrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`. Touches the matched path (LRU)."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache `value[i]` as the KV slot of `key[i]`; returns how many leading tokens were
        already cached. The caller owns (and must free) `value[:returned]`."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect `node` and its ancestors from eviction (one more live reader)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one `inc_lock_ref`; the path becomes evictable when no reader is left."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """After a forward pass: give the request's computed KV to the cache, re-point its row
        at canonical slots, move its lock down to the new last node. The request keeps running."""

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """The request ends (finished or retracted): give its KV to the cache, unlock, and free
        its row. Afterwards the request holds no slots and no row."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached slots if possible; returns how many."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def owned_slots(self) -> torch.Tensor:
        """Every KV slot the cache owns (for the ownership invariant check)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop all cached entries without freeing slots (the caller clears the pools)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Assert the structure's internal consistency (sizes, lock counts, keys)."""
