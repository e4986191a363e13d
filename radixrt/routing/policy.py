"""Routing policies: which worker (a `--dp` replica or a server behind `radixrt router`) gets a
request, decided on its prompt's token ids.

- `cache_aware` (default): the worker whose `ApproxPrefixTree` holds the longest prefix of the
  prompt, when that prefix covers at least `cache_threshold` of it, unless that worker's load
  exceeds the least loaded one's by more than `balance_abs` requests *and* `balance_rel` times;
  otherwise (a miss, or an imbalance) the least loaded worker, ties broken by the smallest tree
  (so new prefix groups spread over workers instead of piling on one) and then in turn.
- `round_robin`: workers in turn.
- `least_load`: fewest requests in flight, ties in turn.

Load is the number of requests routed to a worker and not yet finished (`finish`). Thread-safe:
one lock around every decision and update.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from radixrt.config import ROUTING_POLICIES, ServerArgs
from radixrt.routing.prefix_tree import ApproxPrefixTree

POLICIES = ROUTING_POLICIES
DEFAULT_TREE_TOKENS = 1 << 20


class NoWorkerError(RuntimeError):
    """No worker can take the request (none registered, or all excluded / unhealthy)."""


@dataclass
class WorkerStats:
    """Per-worker routing counters (monotonic) and its load (requests in flight)."""

    load: int = 0
    routed: int = 0
    routed_tokens: int = 0
    cache_routed: int = 0  # routed because the worker's tree matched (a predicted hit)
    matched_tokens: int = 0  # prompt tokens the tree predicted as cached, over all routes
    errors: int = 0


@dataclass(frozen=True)
class Decision:
    """Where a request goes. `reason`: cache (best prefix match), balance (best match skipped
    for load), miss (no good match: least loaded), round_robin, least_load."""

    worker: Hashable
    matched_tokens: int
    reason: str


class RoutingPolicy(ABC):
    """Picks a worker per request and keeps the per-worker counters."""

    name: str = ""

    def __init__(self, workers: Iterable[Hashable] = ()):
        self._lock = threading.RLock()
        self.stats: dict[Hashable, WorkerStats] = {}
        self._turn = 0
        for w in workers:
            self.add_worker(w)

    # -- membership ------------------------------------------------------------------------------
    def add_worker(self, worker: Hashable) -> None:
        with self._lock:
            if worker in self.stats:
                raise ValueError(f"worker {worker!r} is already registered")
            self.stats[worker] = WorkerStats()
            self._added(worker)

    def remove_worker(self, worker: Hashable) -> None:
        with self._lock:
            if worker not in self.stats:
                raise KeyError(worker)
            del self.stats[worker]
            self._removed(worker)

    def workers(self) -> list[Hashable]:
        with self._lock:
            return list(self.stats)

    def _added(self, worker: Hashable) -> None:  # noqa: B027 - optional hook
        """Hook: a worker joined."""

    def _removed(self, worker: Hashable) -> None:  # noqa: B027 - optional hook
        """Hook: a worker left."""

    # -- decisions -------------------------------------------------------------------------------
    def route(self, ids: Sequence[int], exclude: Iterable[Hashable] = ()) -> Decision:
        """Pick a worker for a prompt (token ids) among those not in `exclude`, and count it as
        routed there (its load rises until `finish`)."""
        with self._lock:
            skip = set(exclude)
            cands = [w for w in self.stats if w not in skip]
            if not cands:
                raise NoWorkerError("no worker available" + (
                    f" ({len(skip)} excluded as unhealthy or failed)" if skip else ""))
            d = self._pick(ids, cands)
            s = self.stats[d.worker]
            s.load += 1
            s.routed += 1
            s.routed_tokens += len(ids)
            s.matched_tokens += d.matched_tokens
            if d.reason == "cache":
                s.cache_routed += 1
            return d

    def finish(self, worker: Hashable, error: bool = False) -> None:
        """A request routed to `worker` ended (finished, aborted or failed)."""
        with self._lock:
            s = self.stats.get(worker)
            if s is not None:
                s.load = max(0, s.load - 1)
                s.errors += int(error)

    def evicted(self, worker: Hashable,  # noqa: B027 - cache-blind policies ignore it
                prefixes: Iterable[Sequence[int]]) -> None:
        """The worker reports it holds nothing extending each of `prefixes` (see
        `ApproxPrefixTree.drop_extensions`; an empty prefix: its cache was flushed)."""

    def forget(self, worker: Hashable) -> None:  # noqa: B027 - cache-blind: nothing to forget
        """Drop everything believed about `worker`'s cache (it restarted or lost events)."""

    def tree_tokens(self, worker: Hashable) -> int:
        """Tokens the policy believes `worker` caches (0 for cache-blind policies)."""
        return 0

    @abstractmethod
    def _pick(self, ids: Sequence[int], cands: list[Hashable]) -> Decision:
        """Choose among `cands` (non-empty, in registration order); called under the lock."""

    def _in_turn(self, tied: list[Hashable]) -> Hashable:
        w = tied[self._turn % len(tied)]
        self._turn += 1
        return w

    def _least_loaded(self, cands: list[Hashable]) -> list[Hashable]:
        low = min(self.stats[w].load for w in cands)
        return [w for w in cands if self.stats[w].load == low]


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def _pick(self, ids: Sequence[int], cands: list[Hashable]) -> Decision:
        return Decision(self._in_turn(cands), 0, "round_robin")


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def _pick(self, ids: Sequence[int], cands: list[Hashable]) -> Decision:
        return Decision(self._in_turn(self._least_loaded(cands)), 0, "least_load")


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, workers: Iterable[Hashable] = (), *, cache_threshold: float = 0.5,
                 balance_abs: int = 4, balance_rel: float = 1.5,
                 max_tree_tokens: int = DEFAULT_TREE_TOKENS):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[Hashable, ApproxPrefixTree] = {}
        super().__init__(workers)

    def _added(self, worker: Hashable) -> None:  # noqa: B027 - optional hook
        self.trees[worker] = ApproxPrefixTree(self.max_tree_tokens)

    def _removed(self, worker: Hashable) -> None:  # noqa: B027 - optional hook
        self.trees.pop(worker, None)

    def evicted(self, worker: Hashable,  # noqa: B027 - cache-blind policies ignore it
                prefixes: Iterable[Sequence[int]]) -> None:
        with self._lock:
            tree = self.trees.get(worker)
            if tree is not None:
                for p in prefixes:
                    tree.drop_extensions(p)

    def forget(self, worker: Hashable) -> None:  # noqa: B027 - cache-blind: nothing to forget
        with self._lock:
            tree = self.trees.get(worker)
            if tree is not None:
                tree.clear()

    def tree_tokens(self, worker: Hashable) -> int:
        with self._lock:
            tree = self.trees.get(worker)
            return len(tree) if tree is not None else 0

    def imbalanced(self, load: int, min_load: int) -> bool:
        """Whether a worker with `load` in flight is too busy next to the least loaded one."""
        return load - min_load > self.balance_abs and load > self.balance_rel * min_load

    def _pick(self, ids: Sequence[int], cands: list[Hashable]) -> Decision:
        match = {w: self.trees[w].match_len(ids) for w in cands}
        load = {w: self.stats[w].load for w in cands}
        min_load = min(load.values())
        best_len = max(match.values())
        if best_len > 0 and best_len >= self.cache_threshold * len(ids):
            best_load = min(load[w] for w in cands if match[w] == best_len)
            best = self._in_turn([w for w in cands if match[w] == best_len
                                  and load[w] == best_load])
            if not self.imbalanced(best_load, min_load):
                self.trees[best].insert(ids)
                return Decision(best, best_len, "cache")
            reason = "balance"
        else:
            reason = "miss"
        tied = [w for w in cands if load[w] == min_load]
        if reason == "balance":  # the prefix may already live on another idle worker
            top = max(match[w] for w in tied)
            tied = [w for w in tied if match[w] == top]
        # Among equally loaded workers: the smallest tree (a new prefix group goes where the
        # least is cached, not where a short shared head happens to match), then in turn.
        small = min(len(self.trees[w]) for w in tied)
        w = self._in_turn([w for w in tied if len(self.trees[w]) == small])
        self.trees[w].insert(ids)
        return Decision(w, match[w], reason)


def make_policy(name: str, workers: Iterable[Hashable] = (), *, cache_threshold: float = 0.5,
                balance_abs: int = 4, balance_rel: float = 1.5,
                max_tree_tokens: int = DEFAULT_TREE_TOKENS) -> RoutingPolicy:
    """The policy called `name` (one of `POLICIES`); the cache-aware knobs apply to it only."""
    if name == "cache_aware":
        return CacheAwarePolicy(workers, cache_threshold=cache_threshold,
                                balance_abs=balance_abs, balance_rel=balance_rel,
                                max_tree_tokens=max_tree_tokens)
    if name == "round_robin":
        return RoundRobinPolicy(workers)
    if name == "least_load":
        return LeastLoadPolicy(workers)
    raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")


def policy_from_args(args: ServerArgs, workers: Iterable[Hashable] = (),
                     tree_tokens: int = DEFAULT_TREE_TOKENS) -> RoutingPolicy:
    """The policy `args` configure; `tree_tokens` bounds each tree unless
    `args.routing_max_tree_tokens` is set."""
    return make_policy(args.routing_policy, workers,
                       cache_threshold=args.routing_cache_threshold,
                       balance_abs=args.routing_balance_abs,
                       balance_rel=args.routing_balance_rel,
                       max_tree_tokens=args.routing_max_tree_tokens or tree_tokens)
