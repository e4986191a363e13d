"""The whole-system slot ownership check that tests (and the debug endpoint) call.

It knows no requests: the scheduler side describes each live request's KV as a `KVHolding`
(`radixrt.sched.kv_owner.KVOwner.holdings`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from radixrt.core.errors import InvariantError
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class KVHolding:
    """What one live request holds: `row` (None: nothing), `kv_len` valid columns of it, of
    which the first `len(prefix_slots)` are cache-owned (locked) and the rest its private tail."""

    name: str
    row: int | None
    kv_len: int
    prefix_slots: torch.Tensor = _EMPTY


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise InvariantError(msg)


def check_ownership(
    req_pool: ReqToTokenPool,
    kv_pool: TokenToKVPool,
    cache: BasePrefixCache,
    holdings: Iterable[KVHolding],
) -> None:
    """Raise `InvariantError` unless every KV slot 1..size is owned exactly once (free list,
    tree, or one request's private tail) and every request row is either free or held by
    exactly one live request."""
    req_pool.check_invariants()
    kv_pool.check_invariants()
    cache.check_invariants()
    tree_slots = cache.owned_slots()
    owners = [kv_pool.free_slots(), tree_slots]
    tree_owned = torch.zeros(kv_pool.size + 1, dtype=torch.bool)
    tree_owned[tree_slots] = True
    rows_held: list[int] = []
    for h in holdings:
        p = int(h.prefix_slots.numel())
        if h.row is None:
            _need(h.kv_len == 0 and p == 0, f"{h.name}: KV without row")
            continue
        rows_held.append(h.row)
        row = req_pool.req_to_token[h.row].to(torch.int64).cpu()
        _need(p <= h.kv_len, f"{h.name}: prefix longer than its KV")
        _need(torch.equal(row[:p], h.prefix_slots.cpu()), f"{h.name}: row disagrees with prefix")
        _need(bool(tree_owned[row[:p]].all()), f"{h.name}: reads cached slots the tree dropped")
        owners.append(row[p : h.kv_len])
    slots = torch.cat(owners)
    counts = torch.bincount(slots, minlength=kv_pool.size + 1)
    _need(int(counts[0]) == 0, "dummy slot 0 is owned by someone")
    dup = (counts[1:] > 1).nonzero().flatten() + 1
    lost = (counts[1:] == 0).nonzero().flatten() + 1
    _need(dup.numel() == 0, f"KV slots owned twice: {dup[:10].tolist()}")
    _need(lost.numel() == 0, f"KV slots owned by nobody (leaked): {lost[:10].tolist()}")
    free_rows = req_pool.free_rows()
    _need(len(set(rows_held)) == len(rows_held), "a request row is held by two requests")
    _need(not set(rows_held) & set(free_rows), "a held request row is also free")
    _need(len(rows_held) + len(free_rows) == req_pool.size, "a request row leaked")
