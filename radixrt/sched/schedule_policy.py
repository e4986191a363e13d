"""Which waiting requests run next: queue ordering (`SchedulePolicy`) and budgets (`PrefillAdder`)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable

from radixrt.config import ServerArgs
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.token_trie import TokenTrie
from radixrt.sched.kv_owner import KVOwner
from radixrt.sched.req import Req
from radixrt.sched.step_cost import MixedStepCost, StepFit

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

    `Req.match_len` (the pacer's backlog counts each waiting prompt past it) is fresh every
    step under `lpm` and `dfs-weight`; under `fcfs` with the cache on, each prompt is matched
    once when it (re)enters the queue, so a long queue costs one match per request, not one
    per request per step.
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
            if self.enabled_cache:
                for r in waiting:
                    if not r.matched:
                        self._match(r)
            return starved + sorted(rest, key=lambda r: r.arrival_time), set()
        last_nodes = {id(r): self._match(r) for r in waiting}
        if policy == "lpm":
            ordered = sorted(rest, key=lambda r: (-r.match_len, r.arrival_time))
        else:
            ordered = self._dfs_weight(rest, last_nodes)
        # Starved requests go first but still share: the first of a group computes the prefix.
        final = starved + ordered
        return final, self._in_batch_deferrals(final, in_flight)

    def _match(self, r: Req) -> object:
        """Set `r.match_len` to its prompt's cached prefix now; returns the match's last node."""
        m = self.cache.match_prefix(r.all_ids()[:-1])
        r.match_len, r.matched = int(m.indices.numel()), True
        return m.last_node

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


# The prior of what one (query, key) pair of a prefill's attention costs relative to its FLOPs'
# share (`attention_pair_weight`): the attention kernels run at a lower FLOP rate than the
# matmuls. Fitted over a long-context run's prefill and mixed steps on Zen 4 (2 cores, bf16):
# 1.41; a weight of 1.5 predicted the steps' times to 3.4% (median) against 20% with tokens
# alone, and 1.0 or 2.0 to 4.7-5.8%. Each server measures its own from its steps
# (`PrefillPacer.pair_weight`).
ATTENTION_PAIR_COST = 1.5


def prefill_work(tokens: int, prefix: int, pair_weight: float) -> float:
    """What a prefill chunk of `tokens` tokens after `prefix` cached ones costs, in tokens
    without context: its matmuls (one per token) plus `pair_weight` per (query, key) pair of
    its causal attention, each token attending to the prefix and the chunk up to itself."""
    return tokens + pair_weight * tokens * (prefix + (tokens + 1) / 2)


def tokens_within(work: float, prefix: int, pair_weight: float) -> int:
    """The most tokens after `prefix` cached ones whose `prefill_work` is at most `work` (0 if
    none)."""
    if work < 1:
        return 0
    if pair_weight <= 0:
        return int(work)
    # prefill_work(n) = (w / 2) n^2 + (1 + w (prefix + 1/2)) n, increasing in n
    lin = 1 + pair_weight * (prefix + 0.5)
    n = int((-lin + (lin * lin + 2 * pair_weight * work) ** 0.5) / pair_weight)
    while n > 0 and prefill_work(n, prefix, pair_weight) > work:
        n -= 1
    while prefill_work(n + 1, prefix, pair_weight) <= work:
        n += 1
    return n


class PrefillPacer:
    """The pacing budget of `PrefillAdder`: how much prompt work one prefill step computes.

    A request that arrives while a step runs waits for that step to end; with long steps (2048
    tokens take ~1.8 s on 2 CPU cores) that wait dominates time to first token when requests
    arrive in waves, and the running requests' next tokens wait as long. A step that prefills
    also carries the running requests' decode rows (mixed), D seconds of it. Its prefill gets
    P = max(target_s - D, DECODE_SHARE x D) seconds: about `target_s` in all while the decode
    rows are cheap, and DECODE_SHARE times their cost when they are not, so that a step of many
    decode rows still moves the queue (64 rows on 2 Zen 1 cores take ~0.3 s: 128-token steps
    there cut `random`'s throughput at 64 concurrent by 14% against 256-token ones, stop 48).

    Prefill is counted in `prefill_work` units (a token's matmuls, plus its attention over the
    keys before it at `pair_weight` per key), so a chunk deep in a long prompt gets fewer tokens
    than one at its start: counted in tokens, chunks of a 4096-token document at 3-4k cached
    keys ran 570-650 ms against a 250 ms target (stop 63). The weight starts at `prior_weight`
    and is measured from then on: `MixedStepCost` fits seconds per token (b), per unit of
    attention at the prior weight (a) and per decode row (c) over the steps run, and the weight
    is the prior times a / b (attention runs at a different speed against the matmuls on every
    CPU). The cap is P / b units, at least `floor` (`MIN_TOKENS`), D being rows x c. The steps
    fitted are plain decode steps, and prefill steps that computed at least half the floor
    (shorter ones are dominated by fixed costs and would overstate b; stop 49: against the cap
    alone, a fresh server whose prompts were all short never measured b and never paced). The
    tokens of a step also stay within `ceiling` (`chunked_prefill_size`, the adder's chunk
    budget). Until a prefill step was seen, and with `target_s == 0`, the cap is unbounded
    (`math.inf`): the ceiling alone applies, as it does when a fast machine (GPU) measures a b
    whose cap exceeds it.

    A backlog holds the decode rows back (`backlogged`, `max_stall_s`): while W prompts wait
    whose prefill needs Q seconds in all, past the cached prefix the policy last matched, and
    both W x D and Q / W exceed P, the scheduler runs steps that prefill P alone, the running
    rows waiting up to `max_stall_s` for their next token. With mixed steps alone, a burst of
    unrelated prompts drains at the prefill's share of each step, and in a closed loop that
    keeps every client's request in flight (64 clients on 2 cores) a request arriving behind
    one waited ~20 s for its first token while the rows admitted before it decoded at full
    speed. Throughput and end-to-end latency stay about the same; time moves from before the
    first token to between tokens. W x D (each waiting prompt worth the decode rows' time)
    keeps mixed steps where the rows cost the queue little; Q / W (each waiting prompt needs
    more than a step's prefill) keeps them for cheap prompts, follow-up turns over a cached
    conversation: held, rows admitted together finish together and a closed loop's next turns
    arrive as one burst (multi-turn's and agent's TTFT p50 at 64 concurrent doubled, stop 74).
    """

    MIN_TOKENS = 128
    DECODE_SHARE = 3.0

    def __init__(self, target_s: float, ceiling: int, floor: int = MIN_TOKENS,
                 prior_weight: float = 0.0, max_stall_s: float = 0.0):
        """`max_stall_s`: the longest a backlog holds the decode rows back (at most `target_s`:
        never)."""
        self.target_s = target_s
        self.max_stall_s = max_stall_s
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.prior_weight = prior_weight
        self.cost = MixedStepCost()
        self._fit: StepFit | None = None
        self._fit_valid = False

    def _current(self) -> StepFit | None:
        """The cost fit, None before a prefill step was measured and with pacing off."""
        if self.target_s <= 0:
            return None
        if not self._fit_valid:
            self._fit, self._fit_valid = self.cost.fit(), True
        return self._fit

    @property
    def pair_weight(self) -> float:
        """`prefill_work`'s weight of one (query, key) pair: the prior until a prefill step was
        measured, then the prior times the fitted a / b."""
        fit = self._current()
        return self.prior_weight if fit is None else self.prior_weight * fit.a / fit.b

    @property
    def rate(self) -> float | None:
        """Prefill work units (tokens without context) per second of prefill time, once
        measured."""
        fit = self._current()
        return None if fit is None else 1.0 / fit.b

    def step_cost(self) -> tuple[float, float] | None:
        """(b, c): seconds per prefill work unit and per decode row, None before a prefill step
        was measured and with pacing off; while the two are not told apart, c is taken as b (a
        decode row costs about one prefill token)."""
        return self.budget(0)[1]

    def budget(self, decode_rows: int = 0) -> tuple[float, tuple[float, float] | None]:
        """(`cap(decode_rows)`, `step_cost()`) from one fit: what a step's admission needs."""
        fit = self._current()
        if fit is None:
            return math.inf, None
        return max(float(self.floor), self.prefill_seconds(decode_rows) / fit.b), (fit.b, fit.c)

    def prefill_seconds(self, decode_rows: int = 0) -> float:
        """P, the prefill seconds of a step carrying `decode_rows` decode rows."""
        d = self.decode_seconds(decode_rows)
        return max(self.target_s - d, self.DECODE_SHARE * d)

    def backlogged(self, decode_rows: int, waiting: int, queue_work: float) -> bool:
        """Whether `waiting` prompts of `queue_work` work units in all are a backlog worth
        holding `decode_rows` decode rows back for: W x D and Q / W both above P (see the class
        docstring); False before the rows' cost is measured and with `max_stall_s` at most the
        target."""
        fit = self._current()
        d = self.decode_seconds(decode_rows)
        if fit is None or d <= 0 or self.max_stall_s <= self.target_s:
            return False
        p = self.prefill_seconds(decode_rows)
        return waiting > 0 and min(waiting * d, queue_work * fit.b / waiting) > p

    def decode_seconds(self, rows: int) -> float:
        """D for `rows` decode rows (0 until the rows' cost is told apart)."""
        fit = self._current()
        return 0.0 if fit is None or not fit.rows_told or rows <= 0 else fit.c * rows

    def cap(self, decode_rows: int = 0) -> float:
        """The work budget of a step carrying `decode_rows` decode rows (`math.inf`: none)."""
        return self.budget(decode_rows)[0]

    def token_cap(self, decode_rows: int = 0, prefix: int = 0) -> int:
        """The most tokens one prompt after `prefix` cached tokens gets in such a step."""
        cap = self.cap(decode_rows)
        if math.isinf(cap):
            return self.ceiling
        return min(self.ceiling, max(1, tokens_within(cap, prefix, self.pair_weight)))

    def work(self, extends: list[tuple[int, int]]) -> float:
        """`prefill_work` of a step's (new tokens, cached prefix) rows at the current weight."""
        if not extends:
            return 0.0  # a decode step: no fit needed
        w = self.pair_weight
        return sum(prefill_work(n, p, w) for n, p in extends)

    def observe(self, extends: list[tuple[int, int]], seconds: float,
                decode_rows: int = 0) -> None:
        """A step computed the prefill rows `extends` ((new tokens, cached prefix) each) and
        `decode_rows` decode rows in `seconds`."""
        if self.target_s <= 0 or seconds <= 0:
            return
        work = self.work(extends)
        if work > 0 and 2 * work < self.floor:
            return
        if work > 0 or decode_rows > 0:
            tokens = sum(n for n, _ in extends)
            attention = sum(prefill_work(n, p, self.prior_weight) - n for n, p in extends)
            self.cost.observe(tokens, decode_rows, seconds, attention=attention)
            self._fit_valid = False


def decode_estimate(req: Req, clip: int) -> int:
    """Decode tokens `req` may still need, for budgeting: its remaining tokens, clipped."""
    return min(req.remaining_new_tokens(), clip)


class PrefillAdder:
    """Admits requests into one extend batch within these budgets.

    - tokens computed this step ≤ `max_prefill_tokens`, and ≤ `chunk_budget`
      (`chunked_prefill_size`); their `prefill_work` ≤ `work_budget` (`PrefillPacer`'s cap, at
      `pair_weight` per attention pair): a request that does not fit is cut into chunks (at most
      one chunked request per step), so a chunk over a long cached prefix takes fewer tokens;
    - a step that already finishes a prompt and has used at least `START_CHUNK_BELOW` of its
      budget does not begin a prompt it cannot finish when that pays: the chunk would delay
      the k finished prompts' first tokens by its time (its work x b), while leaving it out
      costs one more step for the request and the `behind` requests queued after it (that
      step's decode rows, D = c x rows, plus about one row's fixed cost). So the chunk is left
      out when k w b > (1 + behind) c (rows + 1), w its work, with b and c from the pacer's
      fit (`step_cost`; without one, as when pacing is off, steps are filled). Four ~75-token agent calls under a
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
                 step_cost: tuple[float, float] | None = None, decode_rows: int = 0,
                 work_budget: float = math.inf, pair_weight: float = 0.0):
        """`step_cost`: (b, c), seconds per prefill work unit and per decode row, measured (the
        pacer's); `decode_rows`: the rows this step carries besides its prefill."""
        self.kv = kv
        self.step_cost = step_cost
        self.decode_rows = decode_rows
        self.clip = clip_max_new_tokens
        self.rows_left = min(free_rows, max_running - len(running))
        self.tokens_left = max_prefill_tokens
        self.chunk_budget = chunk_budget
        self.step_budget = min(max_prefill_tokens, chunk_budget)
        self.work_budget = work_budget
        self.work_left = work_budget
        self.pair_weight = pair_weight
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
        n = self._chunk_tokens(todo, req.kv_len)
        if n <= 0 or n > self._kv_room():
            return False
        self._take(req, n, req.kv_len, final=n == todo)
        return True

    def _chunk_tokens(self, todo: int, prefix: int) -> int:
        """Tokens of a `todo`-token prompt after `prefix` cached ones that fit the budgets; the
        step's first request gets at least one."""
        n = min(todo, self.chunk_budget, self.tokens_left)
        if not math.isinf(self.work_left):
            fit = tokens_within(self.work_left, prefix, self.pair_weight)
            n = min(n, fit if self.admitted else max(fit, 1))
        return n

    def add(self, req: Req, behind: int = 0) -> bool:
        """Try to admit a waiting request, `behind` others queued after it; False means stop
        admitting this step."""
        if (self.rows_left <= 0 or self.tokens_left <= 0 or self.chunk_budget <= 0
                or (self.admitted and self.work_left < 1)):
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
        n = self._chunk_tokens(todo, prefix_len)
        final = n == todo
        reserve = self._decode_reserve(req) if final else 0
        # Nothing running and nothing admitted: admit if the tokens alone fit, so a single
        # request with a pessimistic reserve can still make progress.
        alone = not self.admitted and self.reserved == 0
        if (n <= 0 or not final and (self.has_chunked
                                     or self._keep_step_whole(n, prefix_len, behind))
                or n + (0 if alone else reserve) > self._kv_room()):
            self.kv.release(req)
            return False
        if req.cached_tokens is None:
            req.cached_tokens = min(prefix_len, len(req.origin_input_ids))
        self.rows_left -= 1
        self._take(req, n, prefix_len, final)
        return True

    def _used(self) -> float:
        """The share of the step's budget taken so far: tokens or work, whichever binds more."""
        used = 1 - min(self.chunk_budget, self.tokens_left) / self.step_budget
        if not math.isinf(self.work_budget):
            used = max(used, 1 - self.work_left / self.work_budget)
        return used

    def _keep_step_whole(self, n: int, prefix: int, behind: int) -> bool:
        """Whether an n-token chunk after `prefix` cached tokens that starts a new prompt is
        refused (see the class docstring)."""
        if (self.step_cost is None or not self.finishing
                or self._used() < self.START_CHUNK_BELOW):
            return False
        b, c = self.step_cost
        chunk_s = prefill_work(n, prefix, self.pair_weight) * b
        return self.finishing * chunk_s > (1 + behind) * c * (self.decode_rows + 1)

    def _take(self, req: Req, n: int, prefix: int, final: bool) -> None:
        req.extend_len = n
        self.finishing += final
        self.tokens_left -= n
        self.chunk_budget -= n
        self.work_left -= prefill_work(n, prefix, self.pair_weight)
        self.reserved += n + (self._decode_reserve(req) if final else 0)
        self.has_chunked = self.has_chunked or not final
        self.admitted.append(req)
