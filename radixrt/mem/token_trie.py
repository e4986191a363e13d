"""`TokenTrie`: a plain compressed trie of token-id sequences (no KV slots, no locks, no LRU).

For questions about *planned* or *routed* prompts rather than cached KV: "how many leading tokens
of this prompt does some inserted sequence share?" (the scheduler's in-batch deferral; later a
router's prefix affinity). Edges hold runs of tokens, so memory grows with distinct suffixes.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("key", "children")

    def __init__(self, key: list[int]):
        self.key = key  # the edge label leading to this node (empty only at the root)
        self.children: dict[int, _Node] = {}


def _common_len(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class TokenTrie:
    def __init__(self) -> None:
        self._root = _Node([])
        self._size = 0  # distinct (prefix) tokens stored

    def __len__(self) -> int:
        """Number of distinct non-empty prefixes stored (= tokens on all edges)."""
        return self._size

    def insert(self, ids: Sequence[int]) -> int:
        """Add `ids`; returns how many leading tokens were already present."""
        node = self._root
        i = 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                node.children[ids[i]] = _Node(list(ids[i:]))
                self._size += len(ids) - i
                return i
            n = _common_len(child.key, ids, i)
            if n < len(child.key):  # split the edge after n tokens
                upper = _Node(child.key[:n])
                child.key = child.key[n:]
                upper.children[child.key[0]] = child
                node.children[upper.key[0]] = upper
                child = upper
            node = child
            i += n
        return i

    def match_len(self, ids: Sequence[int]) -> int:
        """Length of the longest prefix of `ids` that is a prefix of some inserted sequence."""
        node = self._root
        i = 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            n = _common_len(child.key, ids, i)
            i += n
            if n < len(child.key):
                break
            node = child
        return i
