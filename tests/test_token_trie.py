"""TokenTrie: the plain token trie behind in-batch deferral (no slots, no locks)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.mem.token_trie import TokenTrie


def test_empty_trie_matches_nothing() -> None:
    trie = TokenTrie()
    assert trie.match_len([1, 2, 3]) == 0 and trie.match_len([]) == 0 and len(trie) == 0


def test_insert_returns_shared_length_and_match_splits_edges() -> None:
    trie = TokenTrie()
    assert trie.insert([1, 2, 3, 4]) == 0
    assert trie.insert([1, 2, 9]) == 2  # splits the [1, 2, 3, 4] edge
    assert trie.insert([1, 2]) == 2
    assert trie.insert([]) == 0
    assert trie.match_len([1, 2, 3, 4, 5]) == 4
    assert trie.match_len([1, 2, 3, 7]) == 3  # ends inside an edge
    assert trie.match_len([1, 2, 9]) == 3
    assert trie.match_len([2]) == 0
    assert len(trie) == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), max_size=8), max_size=8),
       st.lists(st.integers(0, 2), max_size=10))
def test_matches_a_set_of_prefixes(seqs: list[list[int]], query: list[int]) -> None:
    trie = TokenTrie()
    prefixes: set[tuple[int, ...]] = set()
    for s in seqs:
        already = max(i for i in range(len(s) + 1) if tuple(s[:i]) in prefixes | {()})
        assert trie.insert(s) == already
        prefixes |= {tuple(s[: i + 1]) for i in range(len(s))}
    expect = max(i for i in range(len(query) + 1) if i == 0 or tuple(query[:i]) in prefixes)
    assert trie.match_len(query) == expect
    assert len(trie) == len(prefixes)
