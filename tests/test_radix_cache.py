"""RadixCache / NoPrefixCache: tree operations, slot hand-over and the ownership invariant (CPU).

The request lifecycle is simulated without a model, the way the scheduler drives the cache
through its `KVOwner`: admission (match on `all_ids()[:-1]`, `admit`, `take_row`), extend/decode
(`start_step` allocates and writes the row, `commit` advances `kv_len`, sample),
`cache_unfinished` after extends and `release` at finish, retraction or abort. Every slot write records which token prefix its KV stands for, so a slot
that is reused while someone still reads it, or a row pointing at the wrong copy, is caught.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixrt.core.errors import InvariantError
from radixrt.core.sampling_params import SamplingParams
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.chunk_cache import NoPrefixCache
from radixrt.mem.invariants import check_ownership
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.mem.radix_cache import RadixCache, TreeNode
from radixrt.sched.kv_owner import KVOwner, OutOfKVSlots
from radixrt.sched.req import Req

HUGE = 10**9


def make_pools(slots: int = 64, rows: int = 4, ctx: int = 32) -> tuple[ReqToTokenPool, TokenToKVPool]:
    return ReqToTokenPool(rows, ctx), TokenToKVPool(slots, 1, 1, 1)


class PoolCache(RadixCache):
    """A RadixCache next to its pools, evicting into the pool the way `KVOwner.evict` does, so
    the tree tests can watch slots come back."""

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        super().__init__()
        self.req_to_token_pool = req_pool
        self.token_to_kv_pool = kv_pool

    def evict(self, num_tokens: int) -> int:  # type: ignore[override]
        slots = super().evict(num_tokens)
        self.token_to_kv_pool.free(slots)
        return int(slots.numel())


def make_cache(slots: int = 64, rows: int = 4) -> PoolCache:
    return PoolCache(*make_pools(slots, rows))


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def tree_entries(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached token prefix → its slot, read off the tree."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            p = path
            for tok, slot in zip(child.key, child.value.tolist(), strict=True):
                p = (*p, tok)
                out[p] = slot
            stack.append((child, p))
    return out


def node_path(cache: RadixCache, node: TreeNode) -> tuple[list[int], list[int]]:
    """(tokens, slots) from the root down to `node`; asserts `node` is still in the tree."""
    keys: list[list[int]] = []
    vals: list[list[int]] = []
    while node is not cache.root:
        parent = node.parent
        assert parent is not None, "node detached from the tree"
        assert parent.children.get(node.key[0]) is node, "node detached from the tree"
        keys.append(node.key)
        vals.append(node.value.tolist())
        node = parent
    return [k for key in reversed(keys) for k in key], [v for val in reversed(vals) for v in val]


def shape(node: TreeNode) -> dict[tuple[int, ...], dict]:
    """The tree below `node` as nested {key tuple: subtree}."""
    return {tuple(c.key): shape(c) for c in node.children.values()}


def fill(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with fresh slots from the pool (freeing duplicates); returns the slots used."""
    slots = cache.token_to_kv_pool.alloc(len(key))
    assert slots is not None
    already = cache.insert(key, slots)
    cache.token_to_kv_pool.free(slots[:already])
    return slots


# --------------------------------------------------------------------------------------------
# 1. Tree operations
# --------------------------------------------------------------------------------------------


def test_match_on_empty_tree() -> None:
    cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.indices.numel() == 0 and m.indices.dtype == torch.int64
    assert m.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.owned_slots().numel() == 0
    assert cache.evict(HUGE) == 0
    cache.inc_lock_ref(cache.root)  # locking the root (an empty match) is a no-op
    cache.dec_lock_ref(cache.root)
    cache.check_invariants()


def test_insert_returns_already_cached_length() -> None:
    cache = make_cache()
    assert cache.insert([1, 2, 3], t([11, 12, 13])) == 0
    assert cache.insert([1, 2, 3, 4, 5], t([21, 22, 23, 24, 25])) == 3
    assert cache.insert([1, 2, 3], t([31, 32, 33])) == 3
    assert cache.insert([1, 2, 9], t([41, 42, 43])) == 2
    assert cache.insert([7], t([51])) == 0
    assert cache.insert([], t([])) == 0
    # first insertion wins: the later duplicates are not in the tree
    assert tree_entries(cache) == {
        (1,): 11, (1, 2): 12, (1, 2, 3): 13, (1, 2, 3, 4): 24, (1, 2, 3, 4, 5): 25,
        (1, 2, 9): 43, (7,): 51,
    }
    assert cache.total_size() == cache.evictable_size() == 7
    assert sorted(cache.owned_slots().tolist()) == [11, 12, 13, 24, 25, 43, 51]
    cache.check_invariants()


def test_insert_length_mismatch_raises() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2], t([1]))


def test_insert_clones_value() -> None:
    cache = make_cache()
    value = t([5, 6, 7])
    cache.insert([1, 2, 3], value)
    value[:] = 0
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [5, 6, 7]


def test_partial_match_splits_node() -> None:
    cache = make_cache()
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    assert shape(cache.root) == {(1, 2, 3, 4): {}}
    m = cache.match_prefix([1, 2, 7])
    assert m.indices.tolist() == [10, 11]
    assert m.last_node.key == [1, 2]
    assert m.last_node.value.tolist() == [10, 11]
    assert shape(cache.root) == {(1, 2): {(3, 4): {}}}
    upper = cache.root.children[1]
    assert upper is m.last_node and upper.parent is cache.root
    lower = upper.children[3]
    assert lower.value.tolist() == [12, 13] and lower.parent is upper
    assert cache.total_size() == cache.evictable_size() == 4  # a split changes no size
    cache.check_invariants()
    # the full key still matches across the split
    m2 = cache.match_prefix([1, 2, 3, 4, 5])
    assert m2.indices.tolist() == [10, 11, 12, 13] and m2.last_node is lower
    # a match ending exactly at a node boundary does not split
    cache.match_prefix([1, 2])
    assert shape(cache.root) == {(1, 2): {(3, 4): {}}}


def test_split_keeps_locks_and_sizes() -> None:
    cache = make_cache()
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    full = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(full)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    m = cache.match_prefix([1, 2])  # splits the locked node
    assert m.last_node is not full and m.last_node.lock_ref == 1 and full.lock_ref == 1
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_invariants()
    cache.dec_lock_ref(full)
    assert m.last_node.lock_ref == 0 and cache.evictable_size() == 4
    cache.check_invariants()


def test_insert_prefix_of_existing_key() -> None:
    cache = make_cache()
    assert cache.insert([1, 2, 3, 4], t([10, 11, 12, 13])) == 0
    assert cache.insert([1, 2], t([20, 21])) == 2  # caller owns (and frees) [20, 21]
    assert shape(cache.root) == {(1, 2): {(3, 4): {}}}
    assert cache.match_prefix([1, 2]).indices.tolist() == [10, 11]
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 11, 12, 13]
    assert cache.total_size() == 4
    # and a longer key diverging inside an edge
    assert cache.insert([1, 2, 3, 9], t([30, 31, 32, 33])) == 3
    assert shape(cache.root) == {(1, 2): {(3,): {(4,): {}, (9,): {}}}}
    assert cache.match_prefix([1, 2, 3, 9]).indices.tolist() == [10, 11, 12, 33]
    assert cache.total_size() == 5
    cache.check_invariants()


def test_evict_lru_order_and_frees_slots() -> None:
    cache = make_cache(slots=16)
    pool = cache.token_to_kv_pool
    a = fill(cache, [1, 1])
    b = fill(cache, [2, 2])
    c = fill(cache, [3, 3])
    cache.match_prefix([1, 1])  # touch a: b is now the oldest
    assert pool.available_size() == 10
    assert cache.evict(1) == 2  # whole leaves go
    assert set(tree_entries(cache)) == {(1,), (1, 1), (3,), (3, 3)}
    assert set(pool.free_slots().tolist()) >= set(b.tolist())
    assert cache.evict(2) == 2
    assert set(tree_entries(cache)) == {(1,), (1, 1)}
    assert set(pool.free_slots().tolist()) >= set(c.tolist())
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.evict(HUGE) == 2
    assert set(pool.free_slots().tolist()) >= set(a.tolist())
    assert pool.available_size() == 16 and cache.total_size() == 0
    check_ownership(cache.req_to_token_pool, pool, cache, [])


def test_evict_parent_after_its_last_child() -> None:
    cache = make_cache(slots=16)
    fill(cache, [9])  # oldest
    fill(cache, [1, 2, 3])
    fill(cache, [1, 2, 4])  # splits: parent [1, 2] with children [3] and [4]
    assert shape(cache.root) == {(9,): {}, (1, 2): {(3,): {}, (4,): {}}}
    assert cache.evict(1) == 1
    assert shape(cache.root) == {(1, 2): {(3,): {}, (4,): {}}}
    assert cache.evict(1) == 1  # [3] is older than [4]; the parent still has a child
    assert shape(cache.root) == {(1, 2): {(4,): {}}}
    assert cache.evict(1) == 1
    assert shape(cache.root) == {(1, 2): {}}
    assert cache.evict(1) == 2  # now a leaf itself
    assert shape(cache.root) == {}
    # one call may go on to the parent once its last child is gone
    fill(cache, [1, 2, 3])
    fill(cache, [1, 2, 4])
    assert cache.evict(3) == 4
    assert cache.total_size() == 0 and cache.token_to_kv_pool.available_size() == 16
    cache.check_invariants()


def test_match_refreshes_lru() -> None:
    cache = make_cache(slots=16)
    fill(cache, [1, 2, 3])
    fill(cache, [1, 2, 4])
    cache.match_prefix([1, 2, 3])  # [3] is now newer than [4]
    assert cache.evict(1) == 1
    assert shape(cache.root) == {(1, 2): {(3,): {}}}


def test_locked_nodes_never_evicted() -> None:
    cache = make_cache(slots=16)
    pool = cache.token_to_kv_pool
    slots = fill(cache, [1, 2, 3, 4])
    fill(cache, [1, 2, 5])
    fill(cache, [7, 7])
    m = cache.match_prefix([1, 2, 3])  # splits [3, 4]
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 4
    assert cache.evict(HUGE) == 4
    assert tree_entries(cache) == {(1,): int(slots[0]), (1, 2): int(slots[1]),
                                   (1, 2, 3): int(slots[2])}
    assert cache.evict(HUGE) == 0
    check_ownership(cache.req_to_token_pool, pool, cache, [])
    cache.dec_lock_ref(m.last_node)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    assert cache.evict(HUGE) == 3
    assert pool.available_size() == 16


def test_sizes_exact_under_lock_changes() -> None:
    cache = make_cache()
    cache.insert([1, 2, 3, 4], t([1, 2, 3, 4]))
    cache.insert([1, 2, 5], t([5, 6, 7]))
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (5, 0, 5)
    a = cache.match_prefix([1, 2, 3, 4]).last_node
    b = cache.match_prefix([1, 2, 5]).last_node
    cache.inc_lock_ref(a)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.inc_lock_ref(b)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)
    cache.inc_lock_ref(a)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)
    assert a.lock_ref == 2 and b.lock_ref == 1 and a.parent.lock_ref == 3
    cache.check_invariants()
    cache.dec_lock_ref(a)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)
    cache.dec_lock_ref(b)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.dec_lock_ref(a)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.total_size() == 5
    cache.check_invariants()


def test_dec_lock_ref_on_unlocked_node_raises() -> None:
    cache = make_cache()
    cache.insert([1, 2], t([1, 2]))
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    cache.check_invariants()  # a refused unlock changes nothing
    assert cache.evictable_size() == 2


def test_reset() -> None:
    cache = make_cache()
    cache.insert([1, 2, 3], t([1, 2, 3]))
    cache.insert([4], t([4]))
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.owned_slots().numel() == 0 and cache.root.children == {}
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
    assert cache.evict(HUGE) == 0
    cache.check_invariants()
    assert cache.insert([1, 2], t([7, 8])) == 0
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [7, 8]


def test_owned_slots_and_ownership_partition() -> None:
    cache = make_cache(slots=20)
    pool = cache.token_to_kv_pool
    fill(cache, [1, 2, 3])
    fill(cache, [1, 2, 3, 4])
    fill(cache, [2])
    assert cache.owned_slots().numel() == cache.total_size() == 5
    assert pool.available_size() == 15
    check_ownership(cache.req_to_token_pool, pool, cache, [])
    # a leaked slot and a double-owned slot are both caught
    leaked = pool.alloc(1)
    with pytest.raises(InvariantError, match="leaked"):
        check_ownership(cache.req_to_token_pool, pool, cache, [])
    pool.free(cache.owned_slots()[:1])
    pool.free(leaked)  # type: ignore[arg-type]
    with pytest.raises(InvariantError):
        check_ownership(cache.req_to_token_pool, pool, cache, [])


# --------------------------------------------------------------------------------------------
# Lifecycle simulator
# --------------------------------------------------------------------------------------------


class Sim:
    """The scheduler's use of the cache, minus the model. Requests are in exactly one of
    `waiting` (no row), `extending` (row, prompt or recomputation not done) or `decoding`."""

    def __init__(self, cache_cls: type[BasePrefixCache], slots: int = 64, rows: int = 4,
                 ctx: int = 32):
        self.req_pool, self.kv_pool = make_pools(slots, rows, ctx)
        self.cache = cache_cls()
        self.kv = KVOwner(self.req_pool, self.kv_pool, self.cache)
        self.radix = isinstance(self.cache, RadixCache)
        self.waiting: list[Req] = []
        self.extending: list[Req] = []
        self.decoding: list[Req] = []
        self.content: dict[int, tuple[int, ...]] = {}  # slot → token prefix its KV stands for
        self._n = 0

    # -- requests --------------------------------------------------------------------------
    def new(self, prompt: list[int], max_new: int = 4) -> Req:
        self._n += 1
        req = Req(f"r{self._n}", list(prompt), SamplingParams(max_new_tokens=max_new))
        self.waiting.append(req)
        return req

    def live(self) -> list[Req]:
        return [*self.waiting, *self.extending, *self.decoding]

    def admit(self, req: Req) -> bool:
        """`PrefillAdder.add` + the row part of `BatchBuilder.build_extend`."""
        assert req in self.waiting
        self.kv.admit(req, self.kv.match(req.all_ids()[:-1]))
        if not self.kv.take_row(req):
            self.kv.release(req)
            return False
        if req.kv_len:
            row = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len]  # type: ignore[index]
            assert torch.equal(row.to(torch.int64), req.prefix_indices)
        self.waiting.remove(req)
        self.extending.append(req)
        return True

    def _compute(self, req: Req, n: int) -> bool:
        """Write KV for `all_ids()[kv_len : kv_len + n]` into fresh slots; advance kv_len."""
        try:
            self.kv.start_step([req], [n])
        except OutOfKVSlots:
            return False
        row = req.req_pool_idx
        assert row is not None
        ids = req.all_ids()
        slots = self.req_pool.req_to_token[row, req.kv_len : req.kv_len + n]
        for j, s in enumerate(slots.tolist()):
            self.content[s] = tuple(ids[: req.kv_len + j + 1])
        self.kv.commit(req)
        return True

    def _sample(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        if len(req.output_ids) >= req.sampling.max_new_tokens:
            req.finish_reason = "length"

    def compute(self, req: Req, n: int) -> bool:
        """The extend forward pass of `req`: up to `n` more tokens' KV."""
        assert req in self.extending
        return self._compute(req, min(n, req.seq_len() - req.kv_len))

    def after_extend(self, req: Req, token: int) -> None:
        """`OutputProcessor.process_extend` + the finish handling of `Scheduler._run`."""
        if req.kv_len == req.seq_len():
            self._sample(req, token)
            self.extending.remove(req)
            if req.finished:
                self.kv.release(req)
                return
            self.decoding.append(req)
        self.kv.cache_unfinished(req)

    def extend(self, req: Req, n: int, token: int) -> bool:
        if not self.compute(req, n):
            return False
        self.after_extend(req, token)
        return True

    def decode(self, req: Req, token: int) -> bool:
        assert req in self.decoding and req.kv_len == req.seq_len() - 1
        if not self._compute(req, 1):
            return False
        self._sample(req, token)
        if req.finished:
            self.decoding.remove(req)
            self.kv.release(req)
        return True

    def retract(self, req: Req) -> None:
        self._drop(req)
        self.kv.release(req)
        req.num_retractions += 1
        self.waiting.insert(0, req)

    def abort(self, req: Req) -> None:
        self._drop(req)
        self.kv.release(req)
        req.finish_reason = "abort"

    def _drop(self, req: Req) -> None:
        for lst in (self.waiting, self.extending, self.decoding):
            if req in lst:
                lst.remove(req)

    def finish_all(self) -> None:
        for req in self.live():
            self.abort(req)

    # -- checks ----------------------------------------------------------------------------
    def check(self) -> None:
        live = self.live()
        self.kv.check(live)
        free = set(self.kv_pool.free_slots().tolist())
        tree = set(self.cache.owned_slots().tolist())
        for req in live:
            if req.req_pool_idx is None:
                assert req.last_node is None, f"{req.rid}: holds a lock without a row"
                continue
            row = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()
            p = len(req.prefix_indices)
            # a live request only reads slots the tree keeps alive for it or its own tail
            assert set(row[:p]) <= tree, f"{req.rid}: reads a prefix slot the tree dropped"
            assert not set(row) & free, f"{req.rid}: reads a free slot"
            assert not set(row[p:]) & tree, f"{req.rid}: private tail slot owned by the tree"
            ids = req.all_ids()
            for j, s in enumerate(row):
                assert self.content.get(s) == tuple(ids[: j + 1]), f"{req.rid}: slot {s} at {j}"
            if self.radix:
                assert isinstance(self.cache, RadixCache)
                keys, vals = node_path(self.cache, req.last_node)
                assert req.last_node is self.cache.root or req.last_node.lock_ref > 0
                assert keys == ids[:p] and vals == req.prefix_indices.tolist()
        if self.radix:
            assert isinstance(self.cache, RadixCache)
            for path, slot in tree_entries(self.cache).items():
                assert self.content.get(slot) == path, f"tree slot {slot} holds the wrong KV"
        else:
            assert self.cache.owned_slots().numel() == 0 and self.cache.total_size() == 0

    def check_drained(self) -> None:
        """Everything finished: after evicting the whole tree, every slot and row is free."""
        assert not self.live()
        self.check()
        if self.radix:
            assert self.cache.protected_size() == 0
            self.kv.evict(HUGE)
        assert self.cache.total_size() == 0
        assert self.kv_pool.available_size() == self.kv_pool.size
        assert sorted(self.kv_pool.free_slots().tolist()) == list(range(1, self.kv_pool.size + 1))
        assert self.req_pool.available_size() == self.req_pool.size
        check_ownership(self.req_pool, self.kv_pool, self.cache, [])


# --------------------------------------------------------------------------------------------
# 2. Hand-over: cache_unfinished_req / cache_finished_req
# --------------------------------------------------------------------------------------------


def test_same_prompt_computed_concurrently_dedups() -> None:
    sim = Sim(RadixCache)
    prompt = [5, 6, 7, 8, 9]
    a, b = sim.new(prompt), sim.new(prompt)
    assert sim.admit(a) and sim.admit(b)  # both see an empty tree: both compute privately
    sim.check()
    assert sim.extend(a, 5, token=1)
    sim.check()
    canonical = a.prefix_indices.clone()
    assert canonical.numel() == 5
    # B's forward computes the same prompt into its own slots...
    assert sim.compute(b, 5)
    sim.check()
    assert b.req_pool_idx is not None
    dup = sim.req_pool.req_to_token[b.req_pool_idx, :5].to(torch.int64).clone()
    assert not set(dup.tolist()) & set(canonical.tolist())
    free_before = set(sim.kv_pool.free_slots().tolist())
    # ...and handing them over re-points B's row and frees exactly the duplicates
    sim.after_extend(b, token=2)
    sim.check()
    row = sim.req_pool.req_to_token[b.req_pool_idx, :5].to(torch.int64)
    assert torch.equal(row, canonical), "B must read A's canonical slots"
    assert torch.equal(b.prefix_indices, canonical)
    assert set(sim.kv_pool.free_slots().tolist()) == free_before | set(dup.tolist())
    assert a.last_node is b.last_node and a.last_node.lock_ref == 2
    assert isinstance(sim.cache, RadixCache)
    assert sim.cache.total_size() == sim.cache.protected_size() == 5
    assert sim.kv_pool.available_size() == sim.kv_pool.size - 5  # only the tree holds slots
    # both decode different tokens privately; A finishes while B still reads the prefix
    assert sim.decode(a, 3) and sim.decode(b, 4)
    sim.check()
    sim.abort(a)
    sim.check()
    assert sim.cache.protected_size() == 5
    sim.kv.evict(HUGE)  # must not touch B's locked prefix
    sim.check()
    assert torch.equal(b.prefix_indices, canonical)
    assert set(canonical.tolist()) <= set(sim.cache.owned_slots().tolist())
    sim.abort(b)
    sim.check_drained()


def test_duplicate_slots_freed_after_row_repointed() -> None:
    """B's duplicate slots are exactly the ones returned to the free list."""
    sim = Sim(RadixCache, slots=32)
    prompt = [1, 2, 3, 4]
    a, b = sim.new(prompt), sim.new(prompt)
    sim.admit(a)
    sim.admit(b)
    sim.extend(a, 2, token=0)  # chunk 1 of A: cached and locked
    sim.check()
    # B computes the whole prompt privately; grab its slots before the hand-over
    assert b.req_pool_idx is not None and sim.compute(b, 4)
    slots = sim.req_pool.req_to_token[b.req_pool_idx, :4].to(torch.int64).clone()
    sim.after_extend(b, token=7)
    sim.check()
    free = set(sim.kv_pool.free_slots().tolist())
    assert set(slots[:2].tolist()) <= free, "B's copies of A's cached tokens are freed"
    assert not set(slots[2:].tolist()) & free, "B's new tokens now belong to the tree"
    row = sim.req_pool.req_to_token[b.req_pool_idx, :4].tolist()
    assert row[:2] == a.prefix_indices.tolist() and row[2:] == slots[2:].tolist()
    # A finishes its prompt later: its chunk-2 copies are the duplicates now
    assert sim.extend(a, 2, token=0)
    sim.check()
    assert a.prefix_indices.tolist() == row
    sim.finish_all()
    sim.check_drained()


def test_partial_prefix_repoint() -> None:
    """B matched 2 cached tokens at admission; A caches 2 more meanwhile; only those are re-pointed."""
    sim = Sim(RadixCache, slots=32)
    warm = sim.new([1, 2, 9])
    sim.admit(warm)
    sim.extend(warm, 3, token=0)
    sim.abort(warm)  # tree: [1, 2, 9]
    a, b = sim.new([1, 2, 3, 4, 5]), sim.new([1, 2, 3, 4, 6])
    sim.admit(a)
    sim.admit(b)
    assert len(a.prefix_indices) == len(b.prefix_indices) == 2
    head = b.prefix_indices.tolist()
    sim.extend(a, 5, token=0)
    sim.extend(b, 5, token=0)
    sim.check()
    row_b = sim.req_pool.req_to_token[b.req_pool_idx, :5].tolist()  # type: ignore[index]
    row_a = sim.req_pool.req_to_token[a.req_pool_idx, :5].tolist()  # type: ignore[index]
    assert row_b[:2] == head and row_b[:4] == row_a[:4] and row_b[4] != row_a[4]
    sim.finish_all()
    sim.check_drained()


def test_finish_immediately_frees_duplicates_and_row() -> None:
    sim = Sim(RadixCache, slots=16, rows=2)
    a, b = sim.new([3, 3, 3], max_new=1), sim.new([3, 3, 3], max_new=1)
    sim.admit(a)
    sim.admit(b)
    sim.extend(a, 3, token=1)  # finishes at once: cache_finished_req
    sim.check()
    assert a.req_pool_idx is None and a.last_node is None and a.kv_len == 0
    sim.extend(b, 3, token=1)
    sim.check()
    assert b.req_pool_idx is None
    assert isinstance(sim.cache, RadixCache)
    assert sim.cache.total_size() == 3 and sim.cache.protected_size() == 0
    assert sim.kv_pool.available_size() == 13
    assert sim.req_pool.available_size() == 2
    sim.check_drained()


def test_chunked_prefill_moves_lock_down() -> None:
    sim = Sim(RadixCache, slots=32)
    req = sim.new(list(range(10)))
    sim.admit(req)
    assert req.last_node is sim.cache.root
    nodes = []
    for _ in range(3):
        sim.extend(req, 3, token=0)
        sim.check()
        nodes.append(req.last_node)
    assert req.kv_len == 9 and len(req.prefix_indices) == 9
    assert [n.lock_ref for n in nodes] == [1, 1, 1]  # one reader on the path, not three
    assert isinstance(sim.cache, RadixCache)
    assert sim.cache.protected_size() == 9 and sim.cache.evictable_size() == 0
    sim.extend(req, 3, token=4)
    sim.check()
    assert req in sim.decoding and req.kv_len == 10
    sim.decode(req, 5)
    sim.decode(req, 6)
    sim.check()
    assert sim.cache.protected_size() == 10  # decode tokens stay private until the end
    sim.retract(req)
    sim.check()
    assert sim.cache.total_size() == 12 and sim.cache.protected_size() == 0
    # re-admission hits everything but the last token
    sim.admit(req)
    assert req.kv_len == req.seq_len() - 1 == 12
    sim.check()
    sim.extend(req, 5, token=7)
    sim.check()
    sim.finish_all()
    sim.check_drained()


def test_no_prefix_cache_lifecycle_basic() -> None:
    sim = Sim(NoPrefixCache, slots=32)
    a, b = sim.new([1, 2, 3]), sim.new([1, 2, 3])
    sim.admit(a)
    sim.admit(b)
    assert a.kv_len == b.kv_len == 0
    sim.extend(a, 2, token=0)
    sim.extend(b, 3, token=0)
    sim.check()
    assert sim.kv_pool.available_size() == 32 - 5
    sim.extend(a, 3, token=0)
    sim.decode(a, 1)
    sim.check()
    sim.abort(a)
    sim.check()
    assert sim.kv_pool.available_size() == 32 - 3
    sim.abort(b)
    assert sim.kv_pool.available_size() == 32  # nothing is kept without a tree
    sim.check_drained()


# --------------------------------------------------------------------------------------------
# 3. Property tests
# --------------------------------------------------------------------------------------------

TOKENS = st.integers(0, 2)
KEYS = st.lists(TOKENS, max_size=6)
SLOTS = 40


class RadixTreeMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against a dict of cached prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.req_pool, self.kv_pool = make_pools(SLOTS, rows=1, ctx=8)
        self.cache = PoolCache(self.req_pool, self.kv_pool)
        self.ref: dict[tuple[int, ...], int] = {}  # cached token prefix → slot
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []

    def ref_match(self, key: list[int]) -> int:
        i = 0
        while i < len(key) and tuple(key[: i + 1]) in self.ref:
            i += 1
        return i

    def locked(self) -> set[tuple[int, ...]]:
        return {p[:i] for _, p in self.locks for i in range(1, len(p) + 1)}

    def do_evict(self, n: int) -> None:
        before = dict(self.ref)
        locked = self.locked()
        evictable = len(before) - len(locked)
        freed = self.cache.evict(n)
        after = tree_entries(self.cache)
        assert after.items() <= before.items(), "evict changed a surviving entry"
        removed = before.keys() - after.keys()
        assert not removed & locked, "evicted a locked path"
        assert freed == len(removed)
        if n <= 0:
            assert freed == 0
        else:
            assert freed >= min(n, evictable)
            assert freed < n + 6, "evicted far more than asked"  # whole nodes ≤ 6 tokens
        free = set(self.kv_pool.free_slots().tolist())
        assert {before[k] for k in removed} <= free
        self.ref = after

    @rule(key=KEYS)
    def insert(self, key: list[int]) -> None:
        short = len(key) - self.kv_pool.available_size()
        if short > 0:
            self.do_evict(short)
        slots = self.kv_pool.alloc(len(key))
        if slots is None:
            return
        expected = self.ref_match(key)
        assert self.cache.insert(key, slots) == expected
        self.kv_pool.free(slots[:expected])
        for i in range(expected, len(key)):
            self.ref[tuple(key[: i + 1])] = int(slots[i])

    @rule(key=KEYS)
    def match(self, key: list[int]) -> None:
        n = self.ref_match(key)
        m = self.cache.match_prefix(key)
        assert m.indices.tolist() == [self.ref[tuple(key[: i + 1])] for i in range(n)]
        keys, vals = node_path(self.cache, m.last_node)
        assert keys == key[:n] and vals == m.indices.tolist()

    @rule(key=KEYS)
    def lock(self, key: list[int]) -> None:
        m = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(m.last_node)
        self.locks.append((m.last_node, tuple(key[: int(m.indices.numel())])))

    @precondition(lambda self: bool(self.locks))
    @rule(i=st.integers(0, 20))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(key=KEYS)
    def unlock_unlocked(self, key: list[int]) -> None:
        node = self.cache.match_prefix(key).last_node
        if node is not self.cache.root and node.lock_ref == 0:
            with pytest.raises(RuntimeError):
                self.cache.dec_lock_ref(node)

    @rule(n=st.integers(-1, 20))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.kv_pool.clear()
        self.ref = {}

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        check_ownership(self.req_pool, self.kv_pool, self.cache, [])
        assert tree_entries(self.cache) == self.ref
        locked = self.locked()
        assert locked <= self.ref.keys()
        assert self.cache.protected_size() == len(locked)
        assert self.cache.evictable_size() == len(self.ref) - len(locked)
        assert self.cache.total_size() == len(self.ref)
        for node, path in self.locks:
            assert node.lock_ref > 0 or node is self.cache.root
            keys, _ = node_path(self.cache, node)
            assert tuple(keys) == path

    def teardown(self) -> None:
        for node, _ in self.locks:
            self.cache.dec_lock_ref(node)
        self.locks = []
        self.do_evict(HUGE)
        assert not self.ref and self.kv_pool.available_size() == SLOTS


RadixTreeMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixTree = RadixTreeMachine.TestCase


# One op: (kind, target, chunk, token, prompt, max_new). "step" moves a live request one stage on
# (admit if waiting, else one extend chunk, else one decode token), so most ops do something.
OP_KINDS = ["new", "new", "step", "step", "step", "step", "step", "step", "retract", "abort",
            "evict"]
OPS = st.lists(
    st.tuples(st.sampled_from(OP_KINDS), st.integers(0, 7), st.integers(1, 8), TOKENS,
              st.lists(st.integers(0, 1), min_size=1, max_size=7), st.integers(1, 4)),
    min_size=20, max_size=60,
)


def run_lifecycle(cache_cls: type[BasePrefixCache], ops: list[tuple]) -> None:
    # 24 slots for up to 4 rows × (7 prompt + 4 output) tokens: allocations hit eviction and,
    # when the tree cannot give enough back, fail (the step is skipped, as with a retraction).
    sim = Sim(cache_cls, slots=24, rows=4, ctx=16)
    for kind, i, n, token, prompt, max_new in ops:
        live = sim.live()
        if kind == "new" and len(live) < 6:
            sim.new(prompt, max_new)
        elif kind == "step" and live:
            req = live[i % len(live)]
            if req in sim.waiting:
                sim.admit(req)
            elif req in sim.extending:
                sim.extend(req, n, token)
            else:
                sim.decode(req, token)
        elif kind == "retract":
            held = [*sim.extending, *sim.decoding]
            if held:
                sim.retract(held[i % len(held)])
        elif kind == "abort" and live:
            sim.abort(live[i % len(live)])
        elif kind == "evict":
            sim.kv.evict(n * 2)
        sim.check()
    sim.finish_all()
    sim.check_drained()


LIFECYCLE_SETTINGS = settings(max_examples=80, deadline=None, report_multiple_bugs=False,
                              suppress_health_check=[HealthCheck.too_slow])


@LIFECYCLE_SETTINGS
@given(ops=OPS)
def test_lifecycle_radix(ops: list[tuple]) -> None:
    run_lifecycle(RadixCache, ops)


# --------------------------------------------------------------------------------------------
# 4. The same lifecycle without a tree
# --------------------------------------------------------------------------------------------


@LIFECYCLE_SETTINGS
@given(ops=OPS)
def test_lifecycle_no_prefix_cache(ops: list[tuple]) -> None:
    run_lifecycle(NoPrefixCache, ops)


def test_lifecycle_scripted_busy_run() -> None:
    """A fixed, longer run with many shared prompts (exercises paths random ops may miss)."""
    for cache_cls in (RadixCache, NoPrefixCache):
        sim = Sim(cache_cls, slots=30, rows=3, ctx=16)
        g = torch.Generator().manual_seed(0)
        for step in range(300):
            r = int(torch.randint(0, 100, (1,), generator=g))
            if r < 15 and len(sim.live()) < 6:
                n = int(torch.randint(2, 8, (1,), generator=g))
                sim.new([1, 0, 1][: min(n, 3)] + [step % 2] * max(0, n - 3), 3)
            elif r < 35 and sim.waiting:
                sim.admit(sim.waiting[r % len(sim.waiting)])
            elif r < 60 and sim.extending:
                sim.extend(sim.extending[r % len(sim.extending)], 1 + r % 4, r % 3)
            elif r < 90 and sim.decoding:
                sim.decode(sim.decoding[r % len(sim.decoding)], r % 3)
            elif r < 95 and sim.decoding:
                sim.retract(sim.decoding[0])
            else:
                sim.kv.evict(r % 7)
            sim.check()
        sim.finish_all()
        sim.check_drained()


# --------------------------------------------------------------------------------------------
# 5. The tree is a pure structure; the KV owner moves slots; checks raise InvariantError
# --------------------------------------------------------------------------------------------


def test_tree_evict_returns_slots_and_touches_no_pool() -> None:
    cache = RadixCache()  # no pools at all
    cache.insert([1, 2, 3], t([7, 8, 9]))
    cache.insert([1, 2, 4], t([10, 11, 12]))
    node = cache.match_prefix([1, 2, 3]).last_node
    assert cache.parent(node) is cache.match_prefix([1, 2]).last_node
    assert cache.parent(cache.parent(node)) is cache.root and cache.parent(cache.root) is None
    cache.inc_lock_ref(node)
    dropped = cache.evict(HUGE)
    assert dropped.dtype == torch.int64 and dropped.tolist() == [12]
    assert sorted(cache.owned_slots().tolist()) == [7, 8, 9]
    assert cache.evict(0).numel() == 0
    cache.dec_lock_ref(node)
    assert sorted(cache.evict(HUGE).tolist()) == [7, 8, 9] and cache.total_size() == 0


def test_no_prefix_cache_parent_and_evict() -> None:
    cache = NoPrefixCache()
    assert cache.parent(cache.match_prefix([1]).last_node) is None
    assert cache.evict(HUGE).numel() == 0 and not cache.keeps_kv


def test_invariant_checks_raise_invariant_error() -> None:
    cache = RadixCache()
    cache.insert([1, 2], t([3, 4]))
    cache.check_invariants()
    cache._evictable += 1  # a broken size counter
    with pytest.raises(InvariantError, match="evictable"):
        cache.check_invariants()
    cache._evictable -= 1
    node = cache.match_prefix([1, 2]).last_node
    node.value = t([3])  # key and payload lengths differ
    with pytest.raises(InvariantError, match="lengths differ"):
        cache.check_invariants()
    req_pool, kv_pool = make_pools(slots=8, rows=2)
    req_pool._free_rows.append(0)  # a row free twice
    with pytest.raises(InvariantError, match="twice"):
        req_pool.check_invariants()
    kv_pool._free[kv_pool._num_free - 1] = kv_pool._free[0]  # a slot free twice
    with pytest.raises(InvariantError, match="free twice"):
        kv_pool.check_invariants()
    assert issubclass(InvariantError, Exception) and not issubclass(InvariantError, AssertionError)


@pytest.mark.parametrize("cache_cls", [RadixCache, NoPrefixCache])
def test_kv_owner_step_abort_and_release_leave_every_slot_owned_once(cache_cls) -> None:
    sim = Sim(cache_cls, slots=32, rows=3)
    a, b, c = sim.new([1, 2, 3, 4]), sim.new([1, 2, 5]), sim.new([6, 6])
    for r in (a, b, c):
        assert sim.admit(r)
    sim.extend(a, 4, token=0)
    sim.check()
    free = sim.kv_pool.available_size()
    # a step takes slots for b and c; only b's forward "completes" before the failure
    sim.kv.start_step([b, c], [3, 2])
    for r, n in ((b, 3), (c, 2)):  # what the forward pass would write there
        row = sim.req_pool.req_to_token[r.req_pool_idx].tolist()  # type: ignore[index]
        for j in range(r.kv_len, r.kv_len + n):
            sim.content[row[j]] = tuple(r.all_ids()[: j + 1])
    assert sim.kv.in_flight_slots() == 5 and sim.kv_pool.available_size() == free - 5
    with pytest.raises(InvariantError):
        sim.kv.check(sim.live())  # nobody owns in-flight slots: no check mid-step
    sim.kv.commit(b)
    with pytest.raises(InvariantError, match="uncommitted"):
        sim.kv.end_step()
    assert sim.kv.abort_step() == 2  # c's slots go back; b owns its 3 now
    assert b.kv_len == 3 and c.kv_len == 0
    sim.check()
    with pytest.raises(InvariantError):
        sim.kv.commit(c)  # nothing in flight any more
    # release frees a request's in-flight slots too, and is idempotent
    sim.kv.start_step([c], [2])
    sim.kv.release(c)
    sim.kv.release(c)
    sim.extending.remove(c)
    sim.check()
    sim.finish_all()
    sim.check_drained()


def test_kv_owner_counts_evicted_tokens() -> None:
    sim = Sim(RadixCache, slots=8, rows=2)
    a = sim.new([1, 2, 3, 4, 5], max_new=1)
    sim.admit(a)
    sim.extend(a, 5, token=0)  # finishes: 5 cached, 3 free
    assert sim.kv.evicted_tokens == 0
    b = sim.new([7, 7, 7, 7, 7])
    sim.admit(b)
    assert sim.extend(b, 5, token=0)  # needs 2 slots from the tree
    assert sim.kv.evicted_tokens == 5  # a whole leaf goes
    sim.check()
    sim.finish_all()
    sim.check_drained()
