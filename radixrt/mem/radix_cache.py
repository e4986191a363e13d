"""RadixCache: token-id sequences → KV slot indices, shared across requests (page size 1).

A pure structure: it knows nothing of requests or pools (see `base_prefix_cache` for who owns
which slot). `evict` returns the slots it drops; the caller frees them.

Invariants (checked by `check_invariants`, which raises `InvariantError`):
- Every non-root node has a non-empty key and per-token payloads of the same length; children
  are keyed by the first token of their key.
- `lock_ref` of a node counts the live readers whose locked path passes through it, so it is
  ≥ the sum of its children's; a node with `lock_ref > 0` is never evicted.
- `evictable_size()` is the token count of nodes with `lock_ref == 0`, `protected_size()` of
  nodes with `lock_ref > 0`; both are kept exact on every lock change, insert, split and evict.

Per-token payloads: `TreeNode.PER_TOKEN` names the node fields holding one entry per key token
(today only `value`, the KV slots). Split and evict go through them, so a parallel payload
(e.g. prompt logprobs) is one more name there plus an argument to `insert`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import torch

from radixrt.core.errors import InvariantError
from radixrt.core.logprobs import TokenScores
from radixrt.mem.base_prefix_cache import BasePrefixCache, MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    # Fields with one entry per token of `key`: sliced together on split, dropped on evict.
    # `lp`/`top_id`/`top_lp`/`exact`: each token's `TokenScores` (NaN `lp` = never scored),
    # scores filled by whichever request first computes them and never changed after.
    PER_TOKEN = ("value", "lp", "top_id", "top_lp", "exact")
    __slots__ = ("key", "value", "lp", "top_id", "top_lp", "exact", "children", "parent",
                 "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, nid: int,
                 scores: TokenScores | None = None):
        self.key = key
        self.value = value
        if scores is None:
            scores = TokenScores.unknown(len(key))
        self.lp = scores.logprob
        self.top_id = scores.top_id
        self.top_lp = scores.top_logprob
        self.exact = scores.exact
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = 0
        self.id = nid

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


def _node_scores(node: TreeNode) -> TokenScores:
    """A view of `node`'s per-token scores (writes go through to the node)."""
    return TokenScores(node.lp, node.top_id, node.top_lp, node.exact)


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    def __init__(self) -> None:
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        # Called once per evicted leaf with the path to it plus the leaf's first token: the tree
        # no longer holds anything extending that prefix (how routers learn of evictions).
        self.on_evict: Callable[[list[int]], None] | None = None
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], _EMPTY, None, next(self._ids))
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # -- lookup and insert ---------------------------------------------------------------------
    def match_prefix(self, key: list[int]) -> MatchResult:
        node = self.root
        now = next(self._clock)
        node.last_access_time = now
        parts: list[torch.Tensor] = []
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            parts.append(child.value)
            node = child
            i += n
        indices = torch.cat(parts) if parts else _EMPTY
        return MatchResult(indices=indices, last_node=node)

    def insert(self, key: list[int], value: torch.Tensor,
               scores: TokenScores | None = None) -> int:
        if len(key) != int(value.numel()):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        if scores is not None and len(scores) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(scores)} scores")
        node = self.root
        now = next(self._clock)
        node.last_access_time = now
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                new = TreeNode(list(key[i:]), value[i:].clone(), node, next(self._ids),
                               None if scores is None else scores.slice(i, len(key)))
                new.last_access_time = now
                node.children[key[i]] = new
                self._evictable += len(new.key)
                return i
            n = _common_len(child.key, key[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            if scores is not None:
                _node_scores(child).fill_unknown(scores.slice(i, i + n))
            node = child
            i += n
        return i

    def adopt_exact(self, key: list[int], value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """Where the tree holds a token of `key` with inexact K/V in a node nobody has locked
        (so no request reads its slot), take the caller's exact slot `value[i]` instead;
        returns the replaced slots, which the caller now owns and frees."""
        node = self.root
        i = 0
        replaced: list[torch.Tensor] = []
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = _common_len(child.key, key[i:])
            if child.lock_ref == 0:
                swap = ~child.exact[:n] & exact[i : i + n]
                if bool(swap.any()):
                    idx = swap.nonzero().flatten()
                    replaced.append(child.value[idx].clone())
                    child.value[idx] = value[i : i + n][idx].to(child.value.dtype)
                    child.exact[idx] = True
            if n < len(child.key):
                break
            node = child
            i += n
        return torch.cat(replaced) if replaced else _EMPTY

    def prefix_scores(self, node: TreeNode) -> TokenScores:
        parts = []
        while node is not self.root:
            parts.append(_node_scores(node))
            node = node.parent  # type: ignore[assignment]
        return TokenScores.cat(parts[::-1])

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first `n` tokens; returns the new upper node. Sizes unchanged."""
        parent = child.parent
        if parent is None or not 0 < n < len(child.key):
            raise InvariantError(f"split of node {child.id} at {n} of {len(child.key)}")
        upper = TreeNode(child.key[:n], child.value[:n], parent, next(self._ids))
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        for name in TreeNode.PER_TOKEN:
            payload = getattr(child, name)
            setattr(upper, name, payload[:n].clone())
            setattr(child, name, payload[n:].clone())
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # -- locking ---------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    def parent(self, node: TreeNode) -> TreeNode | None:
        return node.parent

    # -- eviction --------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= 0:
            return _EMPTY
        heap = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        dropped: list[torch.Tensor] = []
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                raise InvariantError(f"node {leaf.id} below the root has no parent")
            dropped.append(leaf.value)
            if self.on_evict is not None:
                self.on_evict(self._path_key(parent) + leaf.key[:1])
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return torch.cat(dropped) if dropped else _EMPTY

    def _path_key(self, node: TreeNode) -> list[int]:
        """The token ids from the root down to `node` (inclusive)."""
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for key in reversed(parts) for t in key]

    # -- sizes and checks ------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def owned_slots(self) -> torch.Tensor:
        vals = [n.value for n in self._iter_nodes()]
        return torch.cat(vals) if vals else _EMPTY

    def check_invariants(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise InvariantError(f"radix tree: {msg}")

        need(self.root.lock_ref >= 1, "the root lost its permanent lock")
        evictable = protected = 0
        for node in self._iter_nodes():
            need(bool(node.key), f"node {node.id}: empty key below the root")
            for name in TreeNode.PER_TOKEN:
                need(len(node.key) == int(getattr(node, name).numel()),
                     f"node {node.id}: key and {name} lengths differ")
            need(node.lock_ref >= 0, f"node {node.id}: negative lock_ref")
            need(node.parent is not None and node.parent.children.get(node.key[0]) is node,
                 f"node {node.id}: not its parent's child")
            child_locks = sum(c.lock_ref for c in node.children.values())
            need(node.lock_ref >= child_locks, f"node {node.id}: locked less than its children")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        need(evictable == self._evictable, f"evictable {self._evictable} != actual {evictable}")
        need(protected == self._protected, f"protected {self._protected} != actual {protected}")

    def pretty(self) -> str:  # debugging aid
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for c in node.children.values():
                lines.append(f"{'  ' * depth}{c.key[:8]}{'…' if len(c.key) > 8 else ''} "
                             f"len={len(c.key)} lock={c.lock_ref}")
                walk(c, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)
