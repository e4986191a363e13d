"""`ApproxPrefixTree`: what one worker probably has cached, as the router saw it.

A compressed trie of the token ids routed to one worker, bounded in tokens with LRU eviction of
leaves (the worker's own radix cache evicts the same way), and trimmed when the worker reports an
eviction (`drop_extensions`). No KV slots, no locks: it is an estimate, never a source of truth.

Invariants: every non-root node has a non-empty key; children are keyed by their key's first
token; `len(tree)` is the number of tokens on all edges and stays <= `max_tokens` after every
`insert`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: list[int], parent: _Node | None, now: int):
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = now

    def __lt__(self, other: _Node) -> bool:
        return self.last_access < other.last_access


def _common_len(key: list[int], ids: Sequence[int], start: int) -> int:
    """Length of the common prefix of `key` and `ids[start:]`."""
    n = min(len(key), len(ids) - start)
    if key[:n] == list(ids[start:start + n]):  # fast path: the whole edge matches
        return n
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i


class ApproxPrefixTree:
    """Token-level prefix tree of one worker's routed prompts, at most `max_tokens` tokens."""

    def __init__(self, max_tokens: int):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        self._root = _Node([], None, 0)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    # -- lookup and insert ---------------------------------------------------------------------
    def match_len(self, ids: Sequence[int], touch: bool = False) -> int:
        """Length of the longest prefix of `ids` stored here; with `touch`, the matched path
        becomes most recently used."""
        node, i = self._root, 0
        now = next(self._clock) if touch else 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = _common_len(child.key, ids, i)
            if touch:
                child.last_access = now
            i += n
            if n < len(child.key):
                break
            node = child
        return i

    def insert(self, ids: Sequence[int]) -> int:
        """Store `ids` (most recently used); returns how many leading tokens were present.
        Evicts least recently used leaves if the bound is exceeded (never the path just
        inserted unless it alone exceeds the bound, in which case it is cut to fit)."""
        ids = list(ids[: self.max_tokens])
        node, i = self._root, 0
        now = next(self._clock)
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                new = _Node(ids[i:], node, now)
                node.children[ids[i]] = new
                self._size += len(new.key)
                break
            n = _common_len(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node = child
            i += n
        present = i
        if self._size > self.max_tokens:
            self._evict(self._size - self.max_tokens, protect=now)
        return present

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = _Node(child.key[:n], parent, child.last_access)
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # -- removal ---------------------------------------------------------------------------------
    def _evict(self, num_tokens: int, protect: int) -> None:
        """Drop least recently used leaves until `num_tokens` are gone; leaves touched at
        `protect` (the insert in progress) go last."""
        heap = [n for n in self._iter_nodes() if not n.children]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            if leaf.last_access == protect:  # only the fresh path is left (it fits the bound)
                break
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self._size -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, parent)

    def drop_extensions(self, prefix: Sequence[int]) -> int:
        """The worker holds nothing that extends `prefix` (its last token included): remove
        every stored token at position >= len(prefix) - 1 on paths starting with `prefix`.
        An empty `prefix` clears the tree. Returns the tokens removed."""
        if not prefix:
            removed = self._size
            self.clear()
            return removed
        cut_at = len(prefix) - 1  # tokens kept along the path
        node, i = self._root, 0
        while True:
            child = node.children.get(prefix[i])
            if child is None:
                return 0
            n = _common_len(child.key, prefix, i)
            if i + n > cut_at:  # the cut falls inside this edge (or at its start)
                if n < cut_at - i + 1:
                    return 0  # the path diverges before the cut: nothing there extends prefix
                keep = cut_at - i
                removed = self._subtree_size(child) - keep
                if keep == 0:
                    del node.children[child.key[0]]
                else:
                    child.key = child.key[:keep]
                    child.children = {}
                self._size -= removed
                return removed
            if n < len(child.key):
                return 0
            node = child
            i += n

    def _subtree_size(self, node: _Node) -> int:
        total, stack = 0, [node]
        while stack:
            n = stack.pop()
            total += len(n.key)
            stack.extend(n.children.values())
        return total

    def _iter_nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def sequences(self) -> list[list[int]]:
        """Every root-to-leaf token path (tests, debugging)."""
        out: list[list[int]] = []

        def walk(node: _Node, path: list[int]) -> None:
            if not node.children and node is not self._root:
                out.append(path)
            for c in node.children.values():
                walk(c, path + c.key)

        walk(self._root, [])
        return out

    def check_invariants(self) -> None:
        """Raise `ValueError` if sizes or keys are inconsistent."""
        total = 0
        for node in self._iter_nodes():
            if not node.key:
                raise ValueError("empty key below the root")
            if node.parent is None or node.parent.children.get(node.key[0]) is not node:
                raise ValueError("node not its parent's child")
            total += len(node.key)
        if total != self._size:
            raise ValueError(f"size {self._size} != actual {total}")
        if self._size > self.max_tokens:
            raise ValueError(f"size {self._size} above the bound {self.max_tokens}")
