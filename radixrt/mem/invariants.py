"""The whole-system slot ownership check that tests (and the debug endpoint) call."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

if TYPE_CHECKING:
    from radixrt.sched.req import Req


def check_ownership(
    req_pool: ReqToTokenPool,
    kv_pool: TokenToKVPool,
    cache: BasePrefixCache,
    live_reqs: Iterable[Req],
) -> None:
    """Assert every KV slot 1..size is owned exactly once (free list, tree, or one request's
    private tail) and every request row is either free or held by exactly one live request."""
    req_pool.check_invariants()
    kv_pool.check_invariants()
    cache.check_invariants()
    tree_slots = cache.owned_slots()
    owners = [kv_pool.free_slots(), tree_slots]
    tree_owned = torch.zeros(kv_pool.size + 1, dtype=torch.bool)
    tree_owned[tree_slots] = True
    rows_held: list[int] = []
    for req in live_reqs:
        if req.req_pool_idx is None:
            assert req.kv_len == 0 and len(req.prefix_indices) == 0, f"{req.rid}: KV without row"
            continue
        rows_held.append(req.req_pool_idx)
        row = req_pool.req_to_token[req.req_pool_idx].to(torch.int64)
        p = len(req.prefix_indices)
        assert p <= req.kv_len, f"{req.rid}: prefix longer than its KV"
        assert torch.equal(row[:p], req.prefix_indices), f"{req.rid}: row disagrees with prefix"
        assert bool(tree_owned[row[:p]].all()), f"{req.rid}: reads cached slots the tree dropped"
        owners.append(row[p : req.kv_len])
    slots = torch.cat(owners)
    counts = torch.bincount(slots, minlength=kv_pool.size + 1)
    assert int(counts[0]) == 0, "dummy slot 0 is owned by someone"
    dup = (counts[1:] > 1).nonzero().flatten() + 1
    lost = (counts[1:] == 0).nonzero().flatten() + 1
    assert dup.numel() == 0, f"KV slots owned twice: {dup[:10].tolist()}"
    assert lost.numel() == 0, f"KV slots owned by nobody (leaked): {lost[:10].tolist()}"
    free_rows = req_pool.free_rows()
    assert len(set(rows_held)) == len(rows_held), "a request row is held by two requests"
    assert not set(rows_held) & set(free_rows), "a held request row is also free"
    assert len(rows_held) + len(free_rows) == req_pool.size, "a request row leaked"
