"""The prefix-cache seam: `RadixCache` (shared prefixes) or `NoPrefixCache` (radix disabled).

A prefix cache is a pure structure over token ids and KV slot numbers. It knows nothing of
requests or pools: it never allocates, never frees into a pool and never writes a request row.
The scheduler's KV owner (`radixrt.sched.kv_owner.KVOwner`) drives it and moves slots between
the cache, the pools and the requests.

Slot ownership (the invariant `radixrt.mem.invariants.check_ownership` verifies): every KV slot
is owned by exactly one of the pool's free list, the cache, or one live request's private tail.
- `insert(key, value)` transfers `value[already:]` to the cache; `value[:already]` (tokens the
  cache held before) stays with the caller, who re-points readers at the cache's copies before
  freeing them.
- `evict(n)` transfers the slots it drops back to the caller, who frees them into the pool.
Locks: a handle returned by `match_prefix` stays valid (its slots stay cached) while it holds at
least one lock. `lock_ref` changes only in `inc_lock_ref` / `dec_lock_ref`, one pair per reader;
`match_prefix` and `insert` may split nodes but never change the locked token counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from radixrt.core.logprobs import TokenScores


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 slots of the longest cached prefix
    last_node: Any  # opaque handle: lock it to keep `indices` alive


class BasePrefixCache(ABC):
    #: False when nothing is ever kept (the KV owner frees a request's slots itself).
    keeps_kv: bool = True

    @abstractmethod
    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of `key`. Touches the matched path (LRU)."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor,
               scores: TokenScores | None = None) -> int:
        """Cache `value[i]` as the KV slot of `key[i]`; returns how many leading tokens were
        already cached. The cache now owns `value[returned:]`; the caller keeps (and must
        eventually free) `value[:returned]`. `scores` (aligned with `key`) fill in prompt
        scores of tokens that hold none yet; a known score is never overwritten."""

    def adopt_exact(self, key: list[int], value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """Upgrade cached tokens of `key` whose K/V is not exact to the caller's exact slots
        (`value[i]` where `exact[i]`), in unlocked nodes only; returns the replaced slots, which
        the caller now owns and frees. The radix-disabled cache holds nothing to upgrade."""
        return torch.empty(0, dtype=torch.int64)

    def prefix_scores(self, node: Any) -> TokenScores:
        """The prompt scores of every token on the path to `node` (NaN where never scored)."""
        return TokenScores.unknown(0)

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect `node` and its ancestors from eviction (one more live reader)."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one `inc_lock_ref`; the path becomes evictable when no reader is left."""

    @abstractmethod
    def parent(self, node: Any) -> Any:
        """The handle above `node`, or None at the root (for tree-shaped scheduling)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop at least `num_tokens` unlocked cached tokens if possible, least recently used
        leaves first; returns their slots (int64), which the caller now owns and frees."""

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
        """Raise `InvariantError` unless the structure is consistent (sizes, lock counts, keys)."""
