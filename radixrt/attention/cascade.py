"""Cascade decode's groups: decode requests whose KV rows start with the same cached prefix.

The radix cache points every request that matched a cached prefix at the same canonical slots,
so equal slots mean equal tokens (and equal K/V). A group's shared prefix is attended once for
all of its requests and merged with each request's own suffix by log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Decode requests whose rows start with at least this many identical slots attend to that
# prefix together (below it, the per-group work costs more than it saves).
CASCADE_MIN_SHARED = 32


@dataclass(frozen=True)
class SharedPrefixGroup:
    """`rows` (>= 2 batch rows, ascending) share their first `shared` slots; `shared` >=
    `CASCADE_MIN_SHARED` and < every row's length, so each row keeps >= 1 key of its own."""

    rows: list[int]
    shared: int


def shared_prefix_groups(
    kv_indices: torch.Tensor,
    kv_starts: Sequence[int],
    seq_lens: Sequence[int],
    min_shared: int = CASCADE_MIN_SHARED,
) -> list[SharedPrefixGroup]:
    """Groups of a decode batch; row b's slots are `kv_indices[kv_starts[b]:][:seq_lens[b]]`.

    A slot names one token path in the radix tree, so rows holding the same slot at position
    `min_shared - 1` share at least their first `min_shared` slots (grouping by position 0
    would lump every chat request together on a short shared template header).
    """
    bs = len(seq_lens)
    cand = [b for b in range(bs) if seq_lens[b] > min_shared]
    if len(cand) < 2:
        return []
    dev = kv_indices.device
    pos = torch.tensor([kv_starts[b] + min_shared - 1 for b in cand], dtype=torch.int64)
    by_key: dict[int, list[int]] = {}
    for b, key in zip(cand, kv_indices[pos.to(dev)].tolist(), strict=True):
        if key != 0:  # slot 0 is the pool's dummy, never a token's
            by_key.setdefault(key, []).append(b)
    groups: list[SharedPrefixGroup] = []
    for rows in by_key.values():
        if len(rows) < 2:
            continue
        limit = min(seq_lens[b] for b in rows) - 1
        if limit < min_shared:
            continue
        starts = torch.tensor([kv_starts[b] for b in rows], dtype=torch.int64)
        cols = starts.unsqueeze(1) + torch.arange(limit, dtype=torch.int64)
        sub = kv_indices[cols.to(dev)]
        same = (sub == sub[0]).all(dim=0)
        shared = limit if bool(same.all()) else int((~same).nonzero()[0])
        if shared >= min_shared:
            groups.append(SharedPrefixGroup(rows, shared))
    return groups
