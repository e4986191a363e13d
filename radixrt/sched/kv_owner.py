"""`KVOwner`: the one writer of every request's KV state, and the one mover of KV slots.

Slots move between three owners (see `radixrt.mem.base_prefix_cache`): the pool's free list,
the prefix cache, and a live request's private tail. Every move happens here:

    admit          lock the matched prefix; the request reads the cache's slots
    take_row       a ReqToTokenPool row, holding the prefix slots
    start_step     allocate a step's slots (evicting if needed), write them into the rows;
                   until `commit`, nobody owns them (they are "in flight", tracked here)
    commit         a forward pass computed them: the request's `kv_len` covers them now
                   (rejected draft tokens' slots go back to the free list)
    cache_unfinished
                   a running request gives its computed KV to the cache: insert, re-point the
                   row at the cache's copies BEFORE freeing the duplicates, move the lock down
    release        finished / retracted / aborted: cache its KV, unlock, free the row; also
                   frees the request's in-flight slots if its step never committed
    abort_step     a step failed: free every in-flight slot no request committed
    evict          free unlocked cached slots into the pool (counted in `evicted_tokens`)

`Req` keeps `req_pool_idx`, `kv_len`, `prefix_indices` and `last_node` for everyone to read;
only this module assigns them (an AST test in tests/test_scheduler.py checks it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from radixrt.core.errors import InvariantError
from radixrt.core.logprobs import TokenScores
from radixrt.mem.base_prefix_cache import BasePrefixCache, MatchResult
from radixrt.mem.invariants import KVHolding, check_ownership
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.sched.req import Req

_EMPTY = torch.empty(0, dtype=torch.int64)


class OutOfKVSlots(RuntimeError):
    pass


class KVOwner:
    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, cache: BasePrefixCache):
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.cache = cache
        self.evicted_tokens = 0  # monotonic: every token evicted since start-up
        # Slots of the current step that no request owns yet: id(req) → (req, slots).
        self._in_flight: dict[int, tuple[Req, torch.Tensor]] = {}
        self._invariant = False  # the step in flight runs batch-invariant

    # -- queries ----------------------------------------------------------------------------------
    def match(self, ids: list[int]) -> MatchResult:
        return self.cache.match_prefix(ids)

    def room(self) -> int:
        """Slots a step could get: free plus evictable."""
        return self.kv_pool.available_size() + self.cache.evictable_size()

    def in_flight_slots(self) -> int:
        return sum(int(s.numel()) for _, s in self._in_flight.values())

    # -- admission --------------------------------------------------------------------------------
    def admit(self, req: Req, match: MatchResult) -> None:
        """Lock `match` for `req` (which holds nothing): its KV starts as the cached prefix."""
        if req.req_pool_idx is not None or req.last_node is not None or req.kv_len:
            raise InvariantError(f"{req.rid}: admitted while holding KV")
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.kv_len = int(match.indices.numel())
        # Exactness matters to prompt scoring only: plain requests skip the path walk and count
        # as inexact (conservative: their tokens are then never marked exact).
        req.exact_len = (self.cache.prefix_scores(match.last_node).exact_len()
                         if req.kv_len and req.scoring is not None else 0)

    def take_row(self, req: Req) -> bool:
        """Give an admitted request a row holding its prefix slots; False when none is free."""
        if req.req_pool_idx is not None:
            return True
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        p = int(req.prefix_indices.numel())
        if p:
            self.req_pool.req_to_token[row, :p] = req.prefix_indices.to(torch.int32)
        return True

    # -- a step -----------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        """`n` free slots, evicting unlocked cache leaves (LRU) if needed. The caller owns them."""
        short = n - self.kv_pool.available_size()
        if short > 0:
            self.evict(short)
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise OutOfKVSlots(f"need {n} KV slots, {self.kv_pool.available_size()} free")
        return slots

    def start_step(self, reqs: Sequence[Req], lens: Sequence[int],
                   invariant: bool = False) -> None:
        """Allocate `lens[i]` slots for each request (each already holds a row) and write them
        into its row at columns `kv_len ..`; they stay in flight until `commit`. `invariant`:
        the step runs batch-invariant, so its tokens extend a request's exact run."""
        for req in reqs:
            if req.req_pool_idx is None:
                raise InvariantError(f"{req.rid}: a step without a row")
            if id(req) in self._in_flight:
                raise InvariantError(f"{req.rid}: two steps in flight")
        slots = self.alloc(sum(lens))
        self.req_pool.write([r.req_pool_idx for r in reqs],  # type: ignore[misc]
                            [r.kv_len for r in reqs], lens, slots)
        start = 0
        for req, n in zip(reqs, lens, strict=True):
            self._in_flight[id(req)] = (req, slots[start : start + n])
            start += n
        self._invariant = invariant

    def commit(self, req: Req, drop: int = 0) -> None:
        """The step's forward pass computed `req`'s in-flight tokens: they are its KV now,
        except the last `drop` (draft tokens verification rejected), whose slots go back to
        the free list (nobody else ever pointed at them)."""
        entry = self._in_flight.pop(id(req), None)
        if entry is None:
            raise InvariantError(f"{req.rid}: commit without a step in flight")
        slots = entry[1]
        n = int(slots.numel())
        if not 0 <= drop <= n:
            raise InvariantError(f"{req.rid}: cannot drop {drop} of {n} in-flight slots")
        if drop:
            self.kv_pool.free(slots[n - drop :])
            n -= drop
        if self._invariant and req.exact_len == req.kv_len:
            req.exact_len += n
        req.kv_len += n
        if req.kv_len > req.seq_len():
            raise InvariantError(f"{req.rid}: {req.kv_len} KV tokens for a sequence of "
                                 f"{req.seq_len()}")

    def abort_step(self) -> int:
        """Free the in-flight slots of every request whose step was not committed."""
        n = 0
        for _, slots in self._in_flight.values():
            self.kv_pool.free(slots)
            n += int(slots.numel())
        self._in_flight.clear()
        return n

    def end_step(self) -> None:
        """A step completed: every in-flight slot must have been committed."""
        if self._in_flight:
            names = [r.rid for r, _ in self._in_flight.values()]
            raise InvariantError(f"step ended with uncommitted slots of {names}")

    # -- hand-over to the cache -------------------------------------------------------------------
    def _give_to_cache(self, req: Req) -> MatchResult:
        """Insert `req`'s computed tokens; re-point its row at the cache's copies, then free
        the duplicates. Returns the match of everything inserted (locked by nobody new)."""
        row = req.req_pool_idx
        if row is None:
            raise InvariantError(f"{req.rid}: KV handed over without a row")
        kv_len = req.kv_len
        key = req.all_ids()[:kv_len]
        slots = self.req_pool.req_to_token[row, :kv_len].to(torch.int64).cpu()
        old_prefix = int(req.prefix_indices.numel())
        scores = None  # plain traffic: nothing to store beside the slots (the hot path)
        if req.scoring is not None:
            scores = req.scoring.tree_payload(kv_len, req.exact_len)
        elif req.exact_len:
            scores = TokenScores.unknown(kv_len, req.exact_len)
        if scores is not None and req.exact_len > old_prefix:
            # Exact K/V we computed replaces inexact cached copies nobody reads, so a prefix
            # first cached by plain traffic becomes usable for prompt scores.
            replaced = self.cache.adopt_exact(key, slots, scores.exact)
            if replaced.numel():
                self.kv_pool.free(replaced)
        already = self.cache.insert(key, slots, scores)
        match = self.cache.match_prefix(key)
        if int(match.indices.numel()) != kv_len:
            raise InvariantError(f"{req.rid}: the cache lost tokens it was just given")
        if already > old_prefix:
            # Another request cached [old_prefix, already) meanwhile: point our row at the
            # cache's canonical copies first, then free our now-unreferenced duplicates (those
            # the cache did not adopt).
            ours = slots[old_prefix:already]
            canonical = match.indices[old_prefix:already]
            self.req_pool.req_to_token[row, old_prefix:already] = canonical.to(
                self.req_pool.req_to_token.device, torch.int32)
            self.kv_pool.free(ours[ours != canonical])
            if req.exact_len > old_prefix:  # the row now reads the cache's copies: exact?
                req.exact_len = min(req.exact_len,
                                    self.cache.prefix_scores(match.last_node).exact_len())
        return match

    def cache_unfinished(self, req: Req) -> None:
        """After a forward pass of a request that keeps running: its computed KV becomes cached
        (shared from now on) and its lock moves down to the new last node."""
        if req.kv_len == 0 or not self.cache.keeps_kv:
            return  # without a tree the row keeps every computed slot privately
        match = self._give_to_cache(req)
        self.cache.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    def release(self, req: Req) -> None:
        """The request stops holding KV (finished, retracted or aborted): its computed KV goes to
        the cache (or back to the pool without one), its lock and row are released. Idempotent."""
        entry = self._in_flight.pop(id(req), None)
        if entry is not None:
            self.kv_pool.free(entry[1])
        row = req.req_pool_idx
        if row is not None and req.kv_len > 0:
            if self.cache.keeps_kv:
                self._give_to_cache(req)
            else:
                self.kv_pool.free(self.req_pool.req_to_token[row, : req.kv_len].to(torch.int64))
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        if row is not None:
            self.req_pool.free(row)
        req.req_pool_idx = None
        req.kv_len = 0
        req.prefix_indices = _EMPTY
        req.last_node = None
        req.exact_len = 0

    # -- eviction and reset -----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached slots if possible; returns how many."""
        slots = self.cache.evict(num_tokens)
        self.kv_pool.free(slots)
        n = int(slots.numel())
        self.evicted_tokens += n
        return n

    def reset(self) -> None:
        """Drop the whole cache and every pool entry (only when no request holds anything)."""
        self.cache.reset()
        self.kv_pool.clear()
        self.req_pool.clear()
        self._in_flight.clear()

    # -- checks -----------------------------------------------------------------------------------
    @staticmethod
    def holdings(reqs: Iterable[Req]) -> list[KVHolding]:
        return [KVHolding(r.rid, r.req_pool_idx, r.kv_len, r.prefix_indices) for r in reqs]

    def check(self, live: Iterable[Req]) -> None:
        """Raise `InvariantError` unless pools, cache and `live` own every slot exactly once."""
        if self._in_flight:
            raise InvariantError("ownership checked while a step is in flight")
        check_ownership(self.req_pool, self.kv_pool, self.cache, self.holdings(live))
