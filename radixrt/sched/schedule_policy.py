"""Which waiting requests run next: queue ordering (`SchedulePolicy`) and budgets (`PrefillAdder`)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from radixrt.config import ServerArgs
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.token_trie import TokenTrie
from radixrt.sched.kv_owner import KVOwner
from radixrt.sched.req import Req
from radixrt.sched.step_cost import MixedStepCost

# See `ServerArgs.clip_max_new_tokens_estimation`.
DEFAULT_CLIP_MAX_NEW_TOKENS = ServerArgs.clip_max_new_tokens_estimation

# A waiting request that shares at least this many not-yet-cached tokens with one admitted
# earlier in the same step waits one step, so it hits the cache instead of recomputing them.
IN_BATCH_SHARE_MIN_TOKENS = 32


class SchedulePolicy:
    """Orders the waiting queue.

    - `lpm`: longest cached prefix first (falls back to FCFS when the queue is longer than
      `lpm_fallback_queue_len`, to keep matching cheap);
    - `fcfs`: arrival order;
    - `dfs-weight`: depth-first over the radix tree, heavier subtrees first, so requests sharing
      a prefix run together.
    Requests waiting longer than `starvation_timeout_s` go first, in arrival order, whatever the
    policy. With the radix cache, `order` also returns the requests to hold back one step
    because an earlier request in the queue will cache their shared, uncached prefix.
    """

    def __init__(self, policy: str, cache: BasePrefixCache, enabled_cache: bool,
                 lpm_fallback_queue_len: int, starvation_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.cache = cache
        self.enabled_cache = enabled_cache
        self.lpm_fallback_queue_len = lpm_fallback_queue_len
        self.starvation_timeout_s = starvation_timeout_s
        self.clock = clock

    def order(self, waiting: list[Req],
              in_flight: tuple[Req, ...] = ()) -> tuple[list[Req], set[str]]:
        """`in_flight`: requests mid-prefill (a chunked one) whose prompts are not cached yet
        but will be; waiting requests sharing them are held back too."""
        if not waiting:
            return [], set()
        now = self.clock()
        starved = [r for r in waiting if now - r.arrival_time >= self.starvation_timeout_s]
        starved_ids = {id(r) for r in starved}
        rest = [r for r in waiting if id(r) not in starved_ids]
        policy = self.policy
        if policy == "lpm" and len(waiting) > self.lpm_fallback_queue_len:
            policy = "fcfs"
        if not self.enabled_cache:
            policy = "fcfs"
        starved.sort(key=lambda r: r.arrival_time)
        if policy == "fcfs":
            return starved + sorted(rest, key=lambda r: r.arrival_time), set()
        last_nodes = {}
        for r in waiting:
            m = self.cache.match_prefix(r.all_ids()[:-1])
            r.match_len = int(m.indices.numel())
            last_nodes[id(r)] = m.last_node
        if policy == "lpm":
            ordered = sorted(rest, key=lambda r: (-r.match_len, r.arrival_time))
        else:
            ordered = self._dfs_weight(rest, last_nodes)
        # Starved requests go first but still share: the first of a group computes the prefix.
        final = starved + ordered
        return final, self._in_batch_deferrals(final, in_flight)

    def _dfs_weight(self, reqs: list[Req], last_nodes: dict[int, object]) -> list[Req]:
        by_node: dict[object, list[Req]] = defaultdict(list)
        weight: dict[object, int] = defaultdict(int)
        children: dict[object, list[object]] = defaultdict(list)
        roots: list[object] = []
        for r in reqs:
            node = last_nodes[id(r)]
            by_node[node].append(r)
        for node in list(by_node):
            cur = node
            while cur is not None:
                weight[cur] += len(by_node.get(node, ()))
                parent = self.cache.parent(cur)
                if parent is not None and cur not in children[parent]:
                    children[parent].append(cur)
                if parent is None and cur not in roots:
                    roots.append(cur)
                cur = parent
        out: list[Req] = []
        stack = sorted(roots, key=lambda n: weight[n])
        while stack:
            node = stack.pop()
            out.extend(sorted(by_node.get(node, ()), key=lambda r: r.arrival_time))
            stack.extend(sorted(children[node], key=lambda n: weight[n]))
        return out

    @staticmethod
    def _in_batch_deferrals(ordered: list[Req], in_flight: tuple[Req, ...] = ()) -> set[str]:
        """Requests whose uncached part overlaps an earlier or in-flight request's by ≥ the
        threshold."""
        pending = TokenTrie()  # the prompts planned so far
        for r in in_flight:
            pending.insert(r.all_ids())
        deferred: set[str] = set()
        for r in ordered:
            ids = r.all_ids()
            shared = pending.match_len(ids)
            if shared - r.match_len >= IN_BATCH_SHARE_MIN_TOKENS:
                deferred.add(r.rid)
            else:
                pending.insert(ids)
        return deferred


class PrefillPacer:
    """The pacing budget of `PrefillAdder`: how many prompt tokens one prefill step computes.

    A request that arrives while a step runs waits for that step to end; with long steps (2048
    tokens take ~1.8 s on 2 CPU cores) that wait dominates time to first token when requests
    arrive in waves. A step that prefills also carries the running requests' decode rows
    (mixed), D seconds of it. Its prefill gets P = max(target_s - D, DECODE_SHARE x D) seconds:
    about `target_s` in all while the decode rows are cheap, and DECODE_SHARE times their cost
    when they are not, so that a step of many decode rows still moves the queue (64 rows on 2
    Zen 1 cores take ~0.3 s: 128-token steps there cut `random`'s throughput at 64 concurrent by
    14% against 256-token ones, stop 48). The cap is P / b tokens, clamped to [`floor`
    (`MIN_TOKENS`), `ceiling` (`chunked_prefill_size`)], with b (seconds per prefill token) and D
    (rows x seconds per decode row) from `MixedStepCost` over the steps run: plain decode steps,
    and prefill steps that computed at least half the cap in force or half the floor, whichever
    is less (shorter ones are dominated by fixed costs and would overstate b; against the cap
    alone, a fresh server whose prompts are all shorter than half the ceiling never measured b
    and never paced, stop 49). Until a prefill step was seen, and with `target_s == 0`, the cap
    is `ceiling`; a fast machine (GPU) measures a b whose cap exceeds the ceiling: the ceiling
    alone applies.
    """

    MIN_TOKENS = 128
    DECODE_SHARE = 3.0

    def __init__(self, target_s: float, ceiling: int, floor: int = MIN_TOKENS):
        self.target_s = target_s
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.cost = MixedStepCost()

    @property
    def rate(self) -> float | None:
        """Prefill tokens per second of prefill time, once measured."""
        b = self.cost.seconds_per_token()
        return None if b is None else 1.0 / b

    def step_cost(self) -> tuple[float, float] | None:
        """(b, c): seconds per prefill token and per decode row, None before a prefill step was
        measured and with pacing off; while the two are not told apart, c is taken as b (a
        decode row costs about one prefill token)."""
        return self.budget(0)[1]

    def budget(self, decode_rows: int = 0) -> tuple[int, tuple[float, float] | None]:
        """(`cap(decode_rows)`, `step_cost()`) from one fit: what a step's admission needs."""
        if self.target_s <= 0:
            return self.ceiling, None
        fit = self.cost.fit()
        b = self.cost.seconds_per_token(fit)
        if b is None:
            return self.ceiling, None
        d = 0.0 if fit is None or decode_rows <= 0 else fit[1] * decode_rows
        p = max(self.target_s - d, self.DECODE_SHARE * d)
        cap = max(self.floor, min(self.ceiling, int(p / b)))
        return cap, (fit if fit is not None else (b, b))

    def decode_seconds(self, rows: int) -> float:
        """D for `rows` decode rows (0 until the rows' cost is told apart)."""
        fit = self.cost.fit()
        return 0.0 if fit is None or rows <= 0 else fit[1] * rows

    def cap(self, decode_rows: int = 0) -> int:
        return self.budget(decode_rows)[0]

    def observe(self, tokens: int, seconds: float, decode_rows: int = 0) -> None:
        """A step computed `tokens` prefill tokens and `decode_rows` decode rows in `seconds`."""
        if self.target_s <= 0 or seconds <= 0:
            return
        if tokens > 0 and 2 * tokens < min(self.cap(decode_rows), self.floor):
            return
        if tokens > 0 or decode_rows > 0:
            self.cost.observe(tokens, decode_rows, seconds)


def decode_estimate(req: Req, clip: int) -> int:
    """Decode tokens `req` may still need, for budgeting: its remaining tokens, clipped."""
    return min(req.remaining_new_tokens(), clip)


class PrefillAdder:
    """Admits requests into one extend batch within these budgets.

    - tokens computed this step ≤ `max_prefill_tokens`; a request longer than the remaining
      `chunk_budget` (`chunked_prefill_size`, or less when `PrefillPacer` paces steps) is cut
      into chunks (at most one chunked request per step);
    - a step that already finishes a prompt and has used at least `START_CHUNK_BELOW` of its
      budget does not begin a prompt it cannot finish when that pays: the chunk would delay
      the k finished prompts' first tokens by its time (n tokens x b), while leaving it out
      costs one more step for the request and the `behind` requests queued after it (that
      step's decode rows, D = c x rows, plus about one row's fixed cost). So the chunk is left
      out when k n b > (1 + behind) c (rows + 1), with b and c from the pacer's fit (`step_cost`;
      without one, as when pacing is off, steps are filled). Four ~75-token agent calls under a
      128-token budget get their first tokens after 1, 2, 3 and 4 calls' compute instead of
      1.7, 3.4, 3.4 and 4.4; 56 queued 45-token prompts behind 30 decode rows keep their full
      steps;
    - running + admitted requests ≤ `max_running_requests` (and free request rows);
    - KV: new tokens + the decode tokens every running and admitted request is still expected to
      need (`min(remaining, clip_max_new_tokens) × new_token_ratio`) ≤ free + evictable slots.
      The clip keeps a request without `max_tokens` (remaining ≈ the whole context) from
      reserving thousands of slots it will most likely never use; if it does, decode retracts.
    Admission locks the request's matched prefix at once (through the `KVOwner`), so later
    evictions cannot drop it.
    """

    START_CHUNK_BELOW = 0.5

    def __init__(self, kv: KVOwner, free_rows: int, running: list[Req], max_running: int,
                 max_prefill_tokens: int, chunk_budget: int, new_token_ratio: float,
                 clip_max_new_tokens: int = DEFAULT_CLIP_MAX_NEW_TOKENS,
                 step_cost: tuple[float, float] | None = None, decode_rows: int = 0):
        """`step_cost`: (b, c), seconds per prefill token and per decode row, measured (the
        pacer's); `decode_rows`: the rows this step carries besides its prefill."""
        self.kv = kv
        self.step_cost = step_cost
        self.decode_rows = decode_rows
        self.clip = clip_max_new_tokens
        self.rows_left = min(free_rows, max_running - len(running))
        self.tokens_left = max_prefill_tokens
        self.chunk_budget = chunk_budget
        self.step_budget = min(max_prefill_tokens, chunk_budget)
        self.finishing = 0  # admitted prompts that complete this step
        self.ratio = new_token_ratio
        self.reserved = sum(self._decode_reserve(r) for r in running)
        self.admitted: list[Req] = []
        self.has_chunked = False

    def _decode_reserve(self, req: Req) -> int:
        return int(decode_estimate(req, self.clip) * self.ratio)

    def _kv_room(self) -> int:
        return self.kv.room() - self.reserved

    def add_chunked(self, req: Req) -> bool:
        """Continue a request whose prompt is mid-chunk (it already holds a row and locks)."""
        todo = req.seq_len() - req.kv_len
        n = min(todo, self.chunk_budget, self.tokens_left)
        if n <= 0 or n > self._kv_room():
            return False
        self._take(req, n, final=n == todo)
        return True

    def add(self, req: Req, behind: int = 0) -> bool:
        """Try to admit a waiting request, `behind` others queued after it; False means stop
        admitting this step."""
        if self.rows_left <= 0 or self.tokens_left <= 0 or self.chunk_budget <= 0:
            return False
        ids = req.all_ids()
        match = self.kv.match(ids[:-1])
        prefix_len = int(match.indices.numel())
        if req.scoring is not None:  # prompt scores: only exact K/V, up to the first unscored
            usable = req.scoring.take_from_tree(self.kv.cache.prefix_scores(match.last_node))
            if usable < prefix_len:
                match = self.kv.match(ids[:usable])
                prefix_len = usable
        todo = len(ids) - prefix_len
        self.kv.admit(req, match)  # lock first: a locked prefix is no longer evictable room
        n = min(todo, self.chunk_budget, self.tokens_left)
        final = n == todo
        reserve = self._decode_reserve(req) if final else 0
        # Nothing running and nothing admitted: admit if the tokens alone fit, so a single
        # request with a pessimistic reserve can still make progress.
        alone = not self.admitted and self.reserved == 0
        if (not final and (self.has_chunked or self._keep_step_whole(n, behind))
                or n + (0 if alone else reserve) > self._kv_room()):
            self.kv.release(req)
            return False
        if req.cached_tokens is None:
            req.cached_tokens = min(prefix_len, len(req.origin_input_ids))
        self.rows_left -= 1
        self._take(req, n, final)
        return True

    def _keep_step_whole(self, n: int, behind: int) -> bool:
        """Whether an n-token chunk that starts a new prompt is refused (see the class
        docstring)."""
        used = self.step_budget - min(self.chunk_budget, self.tokens_left)
        if (self.step_cost is None or not self.finishing
                or used < self.START_CHUNK_BELOW * self.step_budget):
            return False
        b, c = self.step_cost
        return self.finishing * n * b > (1 + behind) * c * (self.decode_rows + 1)

    def _take(self, req: Req, n: int, final: bool) -> None:
        req.extend_len = n
        self.finishing += final
        self.tokens_left -= n
        self.chunk_budget -= n
        self.reserved += n + (self._decode_reserve(req) if final else 0)
        self.has_chunked = self.has_chunked or not final
        self.admitted.append(req)
