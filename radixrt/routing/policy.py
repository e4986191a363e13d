"""Routing policies: which worker (a `--dp` replica or a server behind `radixrt router`) gets a
request, decided on its prompt's token ids.

- `cache_aware` (default): the worker whose `ApproxPrefixTree` holds the longest prefix of the
  prompt, when that prefix covers at least `cache_threshold` of it, unless the request would
  finish sooner elsewhere: another worker's pending work is smaller by more than
  `balance_factor` times the prefix tokens it would recompute, or the best worker is at its
  capacity (a new request would wait for a row) while another has room. Otherwise (a miss, or
  a spill) a worker with little pending work: for a spill the least, ties broken by fewer
  requests; for a miss any within the request's own work of the least, the smallest tree first
  (so new prefix groups spread evenly over workers instead of piling on one), then in turn.
  An idle worker also takes a request whose best worker runs `IDLE_SPILL_LOAD` or more.
- `round_robin`: workers in turn.
- `least_load`: least pending work, ties in turn.

A worker's load is counted two ways, both over the requests routed to it and not yet finished
(`finish`): `load`, the number of requests, and `pending`, their work in tokens = the prompt
tokens its tree did not predict as cached + the output budget (`max_new_tokens`, capped at
`MAX_OUTPUT_TOKENS`; `UNKNOWN_OUTPUT_TOKENS` when the request sets none). The work of a
request is fixed when it is routed (progress is not tracked): an estimate, like the trees.
Capacity (`set_capacity`: the worker's `max_running_requests`) is optional. Thread-safe: one
lock around every decision and update.
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
# Output budget assumed for a request that gives none (a chat request without max_tokens may
# generate up to the context; most stop far earlier), and the cap on a given budget.
UNKNOWN_OUTPUT_TOKENS = 128
MAX_OUTPUT_TOKENS = 1024
# cache_aware: a worker with nothing in flight takes a request whose best match is on a worker
# running at least this many.
IDLE_SPILL_LOAD = 2


class NoWorkerError(RuntimeError):
    """No worker can take the request (none registered, or all excluded / unhealthy)."""


@dataclass
class WorkerStats:
    """Per-worker routing counters (monotonic), its load (requests in flight), their pending
    work (tokens) and its capacity (requests it runs at once; None: unknown)."""

    load: int = 0
    pending: int = 0
    capacity: int | None = None
    routed: int = 0
    routed_tokens: int = 0
    cache_routed: int = 0  # routed because the worker's tree matched (a predicted hit)
    matched_tokens: int = 0  # prompt tokens the tree predicted as cached, over all routes
    errors: int = 0
    # What the worker reported it actually computed (usage of its answers), when it did:
    measured_requests: int = 0
    measured_prompt_tokens: int = 0
    measured_cached_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    """Where a request goes. `reason`: cache (best prefix match), balance (best match skipped
    for load), miss (no good match: least loaded), round_robin, least_load. `work`: the
    tokens it adds to the worker's pending work (give it back to `finish`)."""

    worker: Hashable
    matched_tokens: int
    reason: str
    work: int = 0


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
    def route(self, ids: Sequence[int], exclude: Iterable[Hashable] = (),
              output_tokens: int | None = None) -> Decision:
        """Pick a worker for a prompt (token ids) among those not in `exclude`, and count it as
        routed there (its load and pending work rise until `finish`). `output_tokens`: the
        request's output budget (None: unknown)."""
        with self._lock:
            skip = set(exclude)
            cands = [w for w in self.stats if w not in skip]
            if not cands:
                raise NoWorkerError("no worker available" + (
                    f" ({len(skip)} excluded as unhealthy or failed)" if skip else ""))
            out = self.output_estimate(output_tokens)
            d = self._pick(ids, cands, out)
            d = Decision(d.worker, d.matched_tokens, d.reason,
                         len(ids) - d.matched_tokens + out)
            s = self.stats[d.worker]
            s.load += 1
            s.pending += d.work
            s.routed += 1
            s.routed_tokens += len(ids)
            s.matched_tokens += d.matched_tokens
            if d.reason == "cache":
                s.cache_routed += 1
            return d

    def finish(self, decision: Decision, error: bool = False) -> None:
        """The request routed by `decision` ended (finished, aborted or failed): its worker's
        load and pending work drop back."""
        with self._lock:
            s = self.stats.get(decision.worker)
            if s is not None:
                s.load = max(0, s.load - 1)
                s.pending = max(0, s.pending - decision.work)
                s.errors += int(error)

    def observed(self, worker: Hashable, prompt_tokens: int, cached_tokens: int) -> None:
        """The worker answered a request routed to it with this usage (its real cache hits,
        to set beside `matched_tokens`, the predicted ones)."""
        with self._lock:
            s = self.stats.get(worker)
            if s is not None:
                s.measured_requests += 1
                s.measured_prompt_tokens += prompt_tokens
                s.measured_cached_tokens += cached_tokens

    def set_capacity(self, worker: Hashable, capacity: int | None) -> None:
        """How many requests `worker` runs at once (its `max_running_requests`; None: unknown)."""
        with self._lock:
            s = self.stats.get(worker)
            if s is not None:
                s.capacity = capacity

    @staticmethod
    def output_estimate(output_tokens: int | None) -> int:
        """The output budget counted as pending work (see the module docstring)."""
        if output_tokens is None:
            return UNKNOWN_OUTPUT_TOKENS
        return max(0, min(int(output_tokens), MAX_OUTPUT_TOKENS))

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
    def _pick(self, ids: Sequence[int], cands: list[Hashable], out: int) -> Decision:
        """Choose among `cands` (non-empty, in registration order) for a prompt with `out`
        output tokens expected; called under the lock. `Decision.work` is filled by `route`."""

    def _in_turn(self, tied: list[Hashable]) -> Hashable:
        w = tied[self._turn % len(tied)]
        self._turn += 1
        return w

    def _least_loaded(self, cands: list[Hashable]) -> list[Hashable]:
        """The candidates with the least pending work, then the fewest requests."""
        low = min((self.stats[w].pending, self.stats[w].load) for w in cands)
        return [w for w in cands if (self.stats[w].pending, self.stats[w].load) == low]


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def _pick(self, ids: Sequence[int], cands: list[Hashable], out: int) -> Decision:
        return Decision(self._in_turn(cands), 0, "round_robin")


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def _pick(self, ids: Sequence[int], cands: list[Hashable], out: int) -> Decision:
        return Decision(self._in_turn(self._least_loaded(cands)), 0, "least_load")


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, workers: Iterable[Hashable] = (), *, cache_threshold: float = 0.5,
                 balance_factor: float = 4.0, max_tree_tokens: int = DEFAULT_TREE_TOKENS):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_factor < 0:
            raise ValueError(f"balance_factor must be >= 0, got {balance_factor}")
        self.cache_threshold = cache_threshold
        self.balance_factor = balance_factor
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[Hashable, ApproxPrefixTree] = {}
        super().__init__(workers)

    def _added(self, worker: Hashable) -> None:
        self.trees[worker] = ApproxPrefixTree(self.max_tree_tokens)

    def _removed(self, worker: Hashable) -> None:
        self.trees.pop(worker, None)

    def evicted(self, worker: Hashable, prefixes: Iterable[Sequence[int]]) -> None:
        with self._lock:
            tree = self.trees.get(worker)
            if tree is not None:
                for p in prefixes:
                    tree.drop_extensions(p)

    def forget(self, worker: Hashable) -> None:
        with self._lock:
            tree = self.trees.get(worker)
            if tree is not None:
                tree.clear()

    def tree_tokens(self, worker: Hashable) -> int:
        with self._lock:
            tree = self.trees.get(worker)
            return len(tree) if tree is not None else 0

    def _full(self, w: Hashable) -> bool:
        """A new request would wait for a row on `w` (its capacity is known and reached)."""
        s = self.stats[w]
        return s.capacity is not None and s.load >= s.capacity

    def should_spill(self, best: Hashable, other: Hashable, best_len: int,
                     other_len: int) -> bool:
        """Whether a request matching `best_len` tokens on `best` and `other_len` on `other`
        goes to `other`: `best` is full and `other` is not, or `other`'s pending work is
        smaller by more than `balance_factor` x the tokens it would recompute. With factor 1
        the request would finish sooner there if work ran first come first served; the
        default 4 asks for more, because a batch shares its steps (waiting costs less than the
        pending tokens) and a recomputed prefix is work added for good (4 kept the most hits
        at the best balance on the simulated closed-loop workloads of tests/test_routing.py,
        against 1 and 2). A worker with nothing in flight also takes the request when `best`
        runs at least `IDLE_SPILL_LOAD`: its idle core is lost throughput."""
        if best == other:
            return False
        if self._full(best) and not self._full(other):
            return True
        if self.stats[other].load == 0 and self.stats[best].load >= IDLE_SPILL_LOAD:
            return True  # an idle worker's core is lost throughput: one recompute is cheaper
        gap = self.stats[best].pending - self.stats[other].pending
        return gap > 0 and gap > self.balance_factor * (best_len - other_len)

    def _pick(self, ids: Sequence[int], cands: list[Hashable], out: int) -> Decision:
        match = {w: self.trees[w].match_len(ids) for w in cands}
        best_len = max(match.values())
        reason = "miss"
        if best_len > 0 and best_len >= self.cache_threshold * len(ids):
            best = self._in_turn(self._least_loaded([w for w in cands if match[w] == best_len]))
            # The least busy worker that is not full, where the prefix is longest among those.
            open_ = [w for w in cands if not self._full(w)] or cands
            light = self._least_loaded(open_)
            top = max(match[w] for w in light)
            other = next(w for w in light if match[w] == top)
            if not self.should_spill(best, other, best_len, match[other]):
                self.trees[best].insert(ids)
                return Decision(best, best_len, "cache")
            reason = "balance"
            tied = [w for w in light if match[w] == top]
        else:
            # A miss starts a new prefix group: among the workers whose pending work is within
            # this request's own work of the least, the smallest tree (groups spread evenly
            # instead of following momentary load), then in turn.
            open_ = [w for w in cands if not self._full(w)] or cands
            low = min(self.stats[w].pending for w in open_)
            tied = [w for w in open_ if self.stats[w].pending <= low + len(ids) + out]
        # Among equally loaded workers: the smallest tree (a new prefix group goes where the
        # least is cached, not where a short shared head happens to match), then in turn.
        small = min(len(self.trees[w]) for w in tied)
        w = self._in_turn([w for w in tied if len(self.trees[w]) == small])
        self.trees[w].insert(ids)
        return Decision(w, match[w], reason)


def make_policy(name: str, workers: Iterable[Hashable] = (), *, cache_threshold: float = 0.5,
                balance_factor: float = 4.0,
                max_tree_tokens: int = DEFAULT_TREE_TOKENS) -> RoutingPolicy:
    """The policy called `name` (one of `POLICIES`); the cache-aware knobs apply to it only."""
    if name == "cache_aware":
        return CacheAwarePolicy(workers, cache_threshold=cache_threshold,
                                balance_factor=balance_factor, max_tree_tokens=max_tree_tokens)
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
                       balance_factor=args.routing_balance_factor,
                       max_tree_tokens=args.routing_max_tree_tokens or tree_tokens)
