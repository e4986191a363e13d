"""RadixCache: token-id sequences → KV slot indices, shared across requests (page size 1).

Invariants (checked by `check_invariants`):
- Every non-root node has a non-empty key and a value of the same length; children are keyed by
  the first token of their key.
- `lock_ref` of a node counts the live requests whose locked path passes through it, so it is
  ≥ the sum of its children's; a node with `lock_ref > 0` is never evicted.
- `evictable_size()` is the token count of nodes with `lock_ref == 0`, `protected_size()` of
  nodes with `lock_ref > 0`; both are kept exact on every lock change, insert, split and evict.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

import torch

from radixrt.mem.base_prefix_cache import BasePrefixCache, MatchResult
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

if TYPE_CHECKING:
    from radixrt.sched.req import Req

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, nid: int):
        self.key = key
        self.value = value
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = 0
        self.id = nid

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self._ids = itertools.count()
        self._clock = itertools.count(1)
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

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        if len(key) != int(value.numel()):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        node = self.root
        now = next(self._clock)
        node.last_access_time = now
        i = 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                new = TreeNode(list(key[i:]), value[i:].clone(), node, next(self._ids))
                new.last_access_time = now
                node.children[key[i]] = new
                self._evictable += len(new.key)
                return i
            n = _common_len(child.key, key[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            node = child
            i += n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first `n` tokens; returns the new upper node. Sizes unchanged."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.value[:n].clone(), parent, next(self._ids))
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
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

    # -- request hand-over -----------------------------------------------------------------------
    def _give_kv_to_tree(self, req: Req) -> MatchResult:
        """Insert the request's computed tokens; free its duplicate slots after re-pointing."""
        row = req.req_pool_idx
        assert row is not None
        kv_len = req.kv_len
        key = req.all_ids()[:kv_len]
        slots = self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64)
        old_prefix = len(req.prefix_indices)
        already = self.insert(key, slots)
        match = self.match_prefix(key)
        assert int(match.indices.numel()) == kv_len, "tree must hold every inserted token"
        if already > old_prefix:
            # Another request cached [old_prefix, already) meanwhile: point our row at the
            # tree's canonical copies first, then free our now-unreferenced duplicates.
            self.req_to_token_pool.req_to_token[row, old_prefix:already] = match.indices[
                old_prefix:already
            ].to(torch.int32)
            self.token_to_kv_pool.free(slots[old_prefix:already])
        return match

    def cache_unfinished_req(self, req: Req) -> None:
        if req.kv_len == 0:
            return
        match = self._give_kv_to_tree(req)
        self.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    def cache_finished_req(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        if req.kv_len > 0:
            self._give_kv_to_tree(req)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.release_kv()

    # -- eviction --------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.token_to_kv_pool.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

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
        evictable = protected = 0
        for node in self._iter_nodes():
            assert node.key, "empty key below the root"
            assert len(node.key) == int(node.value.numel()), "key and value lengths differ"
            assert node.lock_ref >= 0, "negative lock_ref"
            assert node.parent is not None and node.parent.children.get(node.key[0]) is node
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "a node is locked less than its children"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable, f"evictable {self._evictable} != actual {evictable}"
        assert protected == self._protected, f"protected {self._protected} != actual {protected}"

    def pretty(self) -> str:  # debugging aid
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for c in node.children.values():
                lines.append(f"{'  ' * depth}{c.key[:8]}{'…' if len(c.key) > 8 else ''} "
                             f"len={len(c.key)} lock={c.lock_ref}")
                walk(c, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)
