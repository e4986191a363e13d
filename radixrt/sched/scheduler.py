"""The scheduler process: one loop of receive → schedule → run → process results.

Decisions live in `schedule_policy` (ordering, budgets), every KV move in `kv_owner`, batch
metadata in `batch`, result handling in `output_processor`; this module only sequences them and
keeps counters.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from radixrt.config import ServerArgs
from radixrt.core import ipc
from radixrt.core.errors import InvalidRequestError, InvariantError
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.messages import (
    FINISH_ABORT,
    AbortReq,
    CacheEvicted,
    CheckInvariantsReq,
    ControlReply,
    FlushCacheReq,
    GenerateReq,
    ReadyMsg,
    StatsReq,
    TokenBatchOut,
)
from radixrt.core.validation import check_context_length
from radixrt.grammar import GrammarBackend, GrammarCompiler, LLGuidanceBackend
from radixrt.mem.base_prefix_cache import BasePrefixCache
from radixrt.mem.chunk_cache import NoPrefixCache
from radixrt.mem.huge_pages import huge_page_info
from radixrt.mem.radix_cache import RadixCache
from radixrt.model.model_config import attention_pair_weight
from radixrt.model.runner import ModelRunner
from radixrt.model.tokenizer import load_tokenizer
from radixrt.sampling.batch_info import SamplingBatchInfo, SeenIds
from radixrt.sampling.sampler import Sampler
from radixrt.sched.batch import BatchBuilder
from radixrt.sched.kv_owner import KVOwner
from radixrt.sched.output_processor import OutputProcessor
from radixrt.sched.prompt_scores import record_scores
from radixrt.sched.req import Req
from radixrt.sched.schedule_policy import (
    ATTENTION_PAIR_COST,
    PrefillAdder,
    PrefillPacer,
    SchedulePolicy,
    decode_estimate,
)
from radixrt.sched.speculative import NgramSpeculator

logger = logging.getLogger(__name__)

# After a retraction, assume every running request will still decode this many more tokens.
RETRACT_DECODE_STEPS = 20
# Idle poll timeout while requests only wait for their grammars (the loop checks the
# compiler's futures this often instead of sleeping the usual second).
GRAMMAR_POLL_MS = 5
IDLE_POLL_MS = 1000


@dataclass
class Counters:
    """Monotonic totals since start-up (never reset, not even by `flush_cache`)."""

    requests: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    forward_steps: int = 0
    # Evicted tokens are counted where eviction happens: `KVOwner.evicted_tokens`.


# Dummy prompt tokens of `Scheduler.warm_up` (a 256-token prefill: ~0.12 s on 2 Zen 4 cores).
WARMUP_PREFILL_TOKENS = 256


def _finite_or_none(x: float) -> float | None:
    """`x`, or None where it is infinite (stats travel as JSON)."""
    return None if math.isinf(x) else x


class Scheduler:
    """`grammar_backend`: builds the grammar backend (default: llguidance over the served
    tokenizer); called once, on the grammar compiler's thread, when the first constrained
    request arrives."""

    def __init__(self, args: ServerArgs, runner: ModelRunner,
                 grammar_backend: Callable[[], GrammarBackend] | None = None):
        self.args = args
        self.runner = runner
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.token_to_kv_pool
        self.counters = Counters()
        cache_cls = NoPrefixCache if args.disable_radix_cache else RadixCache
        self.cache: BasePrefixCache = cache_cls()
        self.kv = KVOwner(self.req_pool, self.kv_pool, self.cache)
        self.policy = SchedulePolicy(
            args.schedule_policy, self.cache, not args.disable_radix_cache,
            args.lpm_fallback_queue_len, args.starvation_timeout_s)
        self.builder = BatchBuilder(self.kv, runner.device)
        cfg = runner.model_config
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.max_context_len = runner.sizes.max_context_len
        self.outputs = OutputProcessor(self.kv, self.eos_token_ids, self.max_context_len,
                                       args.stream_interval,
                                       not args.disable_grammar_fast_forward)
        self.sampler = Sampler(seed=args.random_seed)
        self.speculator: NgramSpeculator | None = None
        if args.speculative_algorithm == "ngram":
            self.speculator = NgramSpeculator(
                args.speculative_num_draft_tokens, args.speculative_ngram_min,
                args.speculative_ngram_max, args.speculative_max_rows, self.max_context_len)
        self.vocab_size = cfg.vocab_size
        self.grammars = GrammarCompiler(grammar_backend or self._default_grammar_backend)
        self.waiting: list[Req] = []
        # Constrained requests whose grammar is still compiling: not schedulable yet, hold
        # no KV; they join `waiting` (or finish with the compile error) in `_admit_grammars`.
        self.grammar_wait: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = args.init_new_token_ratio
        self.pacer = PrefillPacer(args.prefill_step_target_ms / 1000, args.chunked_prefill_size,
                                  prior_weight=ATTENTION_PAIR_COST * attention_pair_weight(cfg),
                                  max_stall_s=args.decode_stall_max_ms / 1000)
        self.finished_this_step: list[Req] = []
        # When a step last carried decode rows (perf_counter): a backlog holds them back for at
        # most `decode_stall_max_ms` after it (`_holds_decode`).
        self._decode_t = 0.0
        self.step_times = {"schedule": 0.0, "build": 0.0, "forward": 0.0, "grammar": 0.0,
                           "sample": 0.0, "process": 0.0}
        # Decode steps alone (build to processed results): their count, rows and time, so a
        # mean Engine decode step can be set beside a bare ModelRunner step.
        self.decode_totals = {"steps": 0, "rows": 0, "time_s": 0.0}
        # Extend steps that also carried the running requests' decode tokens (`_can_mix`).
        self.mixed_totals = {"steps": 0, "decode_rows": 0}
        # Prefill steps that held the running requests back for a backlog, and the rows held.
        self.held_totals = {"steps": 0, "decode_rows": 0}
        # Prefixes evicted since the last `take_evicted` (for the router's view of this cache).
        self.evicted_prefixes: list[list[int]] = []
        if isinstance(self.cache, RadixCache):
            self.cache.on_evict = self.evicted_prefixes.append

    def _default_grammar_backend(self) -> GrammarBackend:
        tok = load_tokenizer(self.runner.model_path, self.args.tokenizer_path)
        return LLGuidanceBackend(tok, self.vocab_size, self.eos_token_ids)

    def take_evicted(self) -> list[list[int]]:
        out = list(self.evicted_prefixes)
        self.evicted_prefixes.clear()
        return out

    # -- inputs -------------------------------------------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        req = Req(msg.rid, list(msg.input_ids), msg.sampling, msg.stream)
        try:
            check_context_length(len(req.origin_input_ids), self.max_context_len,
                                 prompt_field="input_ids")
        except InvalidRequestError as e:
            req.finish_reason = FINISH_ABORT
            req.error = str(e)
            self.finished_this_step.append(req)
            return
        self.counters.requests += 1
        key = req.sampling.grammar_key
        if key is None:
            self.waiting.append(req)
        else:
            req.grammar_future = self.grammars.submit(key)
            self.grammar_wait.append(req)

    def _admit_grammars(self) -> None:
        """Move constrained requests whose grammar is ready to `waiting` (arrival order kept
        by the policy); a grammar that failed to compile finishes its request with the error."""
        if not self.grammar_wait:
            return
        still = []
        for req in list(self.grammar_wait):  # a copy: _retire removes from the list
            fut = req.grammar_future
            assert fut is not None
            if not fut.done():
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.grammar = self.grammars.matcher(fut.result())
            except Exception as e:  # GrammarError, or a backend that failed to build
                req.finish_reason = FINISH_ABORT
                req.error = f"grammar: {e}"
                self._retire(req)
                continue
            # What the grammar forces at its start joins the prompt's prefill.
            self.counters.generated_tokens += self.outputs.fast_forward(req)
            if req.finished:  # the grammar alone filled the output (a const, a tiny budget)
                self._retire(req)
                continue
            self.waiting.append(req)
        self.grammar_wait = still

    def abort(self, rid: str, reason: str = FINISH_ABORT, message: str = "") -> None:
        for req in [*self.grammar_wait, *self.waiting, *self.running,
                    *([self.chunked_req] if self.chunked_req else [])]:
            if req.rid == rid:
                self._finish(req, reason, message)
                return

    def _finish(self, req: Req, reason: str, message: str = "") -> None:
        """End a request outside the normal result path (abort, failed batch)."""
        if req.finish_reason is None:
            req.finish_reason = reason
        req.error = req.error or message
        self._retire(req)

    def _retire(self, req: Req) -> None:
        """A finished request leaves every queue and gives up its KV and grammar state; counted
        exactly once."""
        if req in self.grammar_wait:
            self.grammar_wait.remove(req)
        req.grammar_future = None
        req.grammar = None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        self.kv.release(req)
        if not req.finish_counted:
            req.finish_counted = True
            self.counters.finished_requests += 1
            self.finished_this_step.append(req)

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> TokenBatchOut | None:
        """Run one prefill or decode batch if there is work; returns what to send downstream."""
        t0 = time.perf_counter()
        self._admit_grammars()
        batch, hold = self._schedule_extend()
        mode = "extend"
        if batch is not None and self._can_mix(batch):
            if hold:  # the rows could ride along but wait for the backlog
                self.held_totals["steps"] += 1
                self.held_totals["decode_rows"] += len(self.running)
            else:
                mode = "mixed"
        elif batch is None and self.running:
            batch = self._schedule_decode()
            mode = "decode"
        self.step_times["schedule"] += time.perf_counter() - t0
        if batch:
            if mode == "mixed":
                batch = [*batch, *self.running]
            try:
                self._run(batch, mode)
            except Exception as e:  # keep serving: fail this batch's requests, free their KV
                logger.error("batch failed: %s\n%s", e, traceback.format_exc())
                self._fail_batch(batch, f"internal error: {e}")
            if mode != "extend":
                self._decode_t = time.perf_counter()
        done = self.finished_this_step
        self.finished_this_step = []
        touched = batch or []
        out = self.outputs.collect(list({id(r): r for r in [*touched, *done]}.values()))
        return out if out.outs else None

    def _schedule_extend(self) -> tuple[list[Req] | None, bool]:
        """The requests this step prefills (None: none), and whether it holds the running
        requests' decode back for a backlog (`_holds_decode`)."""
        if not self.waiting and self.chunked_req is None:
            return None, False
        rows = self._mixed_rows()
        # a chunked request's prompt is cached only after this step
        in_flight: tuple[Req, ...] = () if self.chunked_req is None else (self.chunked_req,)
        ordered, deferred = self.policy.order(self.waiting, in_flight)
        # a step holding the rows back prefills what a mixed one would, without their time
        hold = rows > 0 and self._holds_decode(rows)
        cap, step_cost = self.pacer.budget(rows)
        adder = PrefillAdder(
            self.kv, self.req_pool.available_size(), self.running,
            self.args.max_running_requests, self.args.max_prefill_tokens,
            self.args.chunked_prefill_size, self.new_token_ratio,
            self.args.clip_max_new_tokens_estimation, step_cost,
            0 if hold else rows, work_budget=cap,
            pair_weight=self.pacer.pair_weight)
        if self.chunked_req is not None:
            if not adder.add_chunked(self.chunked_req):
                return None, False
            self.chunked_req = None
        for i, req in enumerate(ordered):
            if req.rid in deferred:
                continue
            if not adder.add(req, behind=len(ordered) - i - 1):
                break
        if not adder.admitted:
            return None, False
        admitted = {id(r) for r in adder.admitted}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for req in adder.admitted:
            if not req.counted:  # first admission: count the prompt once, retractions aside
                req.counted = True
                self.counters.prompt_tokens += len(req.origin_input_ids)
                self.counters.cached_tokens += req.cached_tokens or 0
        return adder.admitted, hold

    def _holds_decode(self, rows: int) -> bool:
        """Whether this step prefills alone, holding the `rows` running requests back: the
        queue is a backlog (`PrefillPacer.backlogged`) and the step's prefill still ends within
        `decode_stall_max_ms` of the last step that decoded."""
        stalled = time.perf_counter() - self._decode_t + self.pacer.prefill_seconds(rows)
        return stalled <= self.pacer.max_stall_s and self.pacer.backlogged(rows, *self._backlog())

    def _backlog(self) -> tuple[int, float]:
        """(prompts, work) waiting for prefill, the one mid-chunk included: each prompt's tokens
        past the cached prefix the policy last matched (every step under lpm and dfs-weight,
        once per queue entry under fcfs; the whole prompt without a cache), for
        `PrefillPacer.backlogged`."""
        todo = [(r.seq_len() - r.match_len, r.match_len) for r in self.waiting]
        if self.chunked_req is not None:
            todo.append((self.chunked_req.seq_len() - self.chunked_req.kv_len,
                         self.chunked_req.kv_len))
        return len(todo), self.pacer.work(todo)

    def _mixed_rows(self) -> int:
        """Decode rows a prefill step would carry (for the pacer's budget): the running
        requests, unless steps are not mixed."""
        return 0 if self.args.disable_mixed_chunk else len(self.running)

    def _can_mix(self, extend: list[Req]) -> bool:
        """Whether this extend step also carries the running requests' decode tokens: not when
        disabled, when a row scores its prompt (that step runs batch-invariant), or when the
        pool cannot hold the extend tokens plus one slot per running request without
        retracting (the plain decode step that follows handles that)."""
        if self.args.disable_mixed_chunk or not self.running:
            return False
        if any(r.scoring is not None for r in (*extend, *self.running)):
            return False
        need = sum(r.extend_len for r in extend) + sum(r.pending() for r in self.running)
        return self.kv.room() >= need

    def _schedule_decode(self) -> list[Req]:
        """The running requests, after retraction if the pool cannot hold their pending tokens;
        with speculation on, each with its drafts (dropped when the pool cannot hold them)."""
        if self.speculator is not None:
            self.speculator.propose(self.running)
            if self.kv.room() < sum(r.pending() + len(r.draft_ids) for r in self.running):
                for req in self.running:
                    req.draft_ids = []
        need = sum(r.pending() for r in self.running)
        if self.kv.room() < need:
            self._retract(need)
        self.new_token_ratio = max(self.args.min_new_token_ratio,
                                   self.new_token_ratio - self.args.new_token_ratio_decay)
        return list(self.running)

    def _retract(self, need: int) -> None:
        """Send the newest running requests back to the waiting queue until `need` slots (each
        remaining request's `pending()` tokens) can be had. Their KV goes to the tree, so
        re-admission hits it. A mid-prefill `chunked_req` holds KV too: it goes back last,
        before the oldest request."""
        victims = sorted(self.running, key=lambda r: r.arrival_time)
        while victims and self.kv.room() < need:
            if len(victims) > 1:
                req = victims.pop()
                self.running.remove(req)
                need -= req.pending()
            elif self.chunked_req is not None:
                req, self.chunked_req = self.chunked_req, None  # else: no slot, ever (deadlock)
            else:
                break  # the oldest request alone always fits: the pool holds a whole context
            self.kv.release(req)
            req.draft_ids = []
            req.num_retractions += 1
            req.matched = False
            self.counters.retractions += 1
            self.waiting.insert(0, req)
        clip = self.args.clip_max_new_tokens_estimation
        remaining = sum(decode_estimate(r, clip) for r in self.running)
        decoded = sum(len(r.output_ids) for r in self.running)
        total = max(1, remaining + decoded)
        est = (decoded + RETRACT_DECODE_STEPS * len(self.running)) / total
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, est))
        logger.info("retracted requests; %d running, new_token_ratio=%.2f",
                    len(self.running), self.new_token_ratio)

    def _run(self, reqs: list[Req], mode: str) -> None:
        t0 = time.perf_counter()
        n_ext = len(reqs) - len(self.running) if mode == "mixed" else len(reqs)
        if mode == "extend":
            fb = self.builder.build_extend(reqs)
        elif mode == "mixed":
            fb = self.builder.build_mixed(reqs[:n_ext], reqs[n_ext:])
        else:
            fb = self.builder.build_decode(reqs)
        t1 = time.perf_counter()
        # The step's sampling settings first: a step whose rows are all greedy takes the argmax
        # the LM head picks as it computes the logits, then perhaps without them
        # (ModelRunner.forward_greedy).
        vocab_mask = self._grammar_masks(reqs)
        tg = time.perf_counter()
        picks = self._pick_rows(reqs) if mode == "decode" else None
        info = self._sampling_info(reqs, picks, vocab_mask)
        ti = time.perf_counter()
        greedy_ids = None
        logits: torch.Tensor | None
        if fb.score_rows is not None:
            top_k = max((sc.top_k for sc, _ in self.builder.scored), default=0)
            logits, scores = self.runner.forward_scored(fb, top_k)
            record_scores(self.builder.scored, scores)
        elif info.is_fast_path:
            logits, greedy_ids = self.runner.forward_greedy(fb)
        else:
            logits = self.runner.forward(fb)
        t2 = time.perf_counter()
        if picks is not None:
            rows_t = torch.tensor(picks, dtype=torch.int64)
            if logits is not None:
                logits = logits.index_select(0, rows_t.to(logits.device))
            if greedy_ids is not None:
                greedy_ids = greedy_ids.index_select(0, rows_t.to(greedy_ids.device))
        sample = self.sampler.sample(logits, info, greedy_ids)
        t3 = time.perf_counter()
        before = sum(len(r.output_ids) for r in reqs)
        ids, lps = sample.next_token_ids, sample.logprobs
        verified = None
        if picks is not None:
            ids, lps, verified = self._verify(reqs, ids, lps)
        if mode == "decode":
            self.outputs.process_decode(reqs, ids, lps, verified=verified)
        else:
            ext = reqs[:n_ext]
            chunked = self.outputs.process_extend(ext, ids[:n_ext], lps[:n_ext], len(reqs))
            if mode == "mixed":  # the rest are the running requests, in place
                self.outputs.process_decode(reqs[n_ext:], ids[n_ext:], lps[n_ext:],
                                            len(reqs))
                self.mixed_totals["steps"] += 1
                self.mixed_totals["decode_rows"] += len(reqs) - n_ext
            for req in ext:
                if req in chunked:
                    self.chunked_req = req
                elif not req.finished:
                    self.running.append(req)
        self.counters.generated_tokens += sum(len(r.output_ids) for r in reqs) - before
        self.kv.end_step()
        for req in reqs:
            if req.finished:
                self._retire(req)
        self.counters.forward_steps += 1
        t4 = time.perf_counter()
        self.step_times["build"] += t1 - t0
        self.step_times["forward"] += t2 - ti
        self.step_times["grammar"] += tg - t1
        self.step_times["sample"] += (ti - tg) + (t3 - t2)
        self.step_times["process"] += t4 - t3
        n_dec = len(reqs) if mode == "decode" else len(reqs) - n_ext
        extends = [] if mode == "decode" else list(
            zip(fb.extend_lens_cpu[:n_ext], fb.prefix_lens_cpu[:n_ext], strict=True))
        self.pacer.observe(extends, t4 - t0, n_dec)
        if logger.isEnabledFor(logging.DEBUG):
            n_pre = 0 if mode == "decode" else n_ext
            logger.debug("step %s: %d prefill rows / %d tokens on %d cached, %d decode rows, "
                         "%d waiting; %.1f ms (forward %.1f); prefill cap %d, pair weight "
                         "%.2fx the prior", mode, n_pre, fb.num_tokens - n_dec,
                         sum(fb.prefix_lens_cpu[:n_pre]), n_dec, len(self.waiting),
                         (t4 - t0) * 1e3, (t2 - ti) * 1e3,
                         self.pacer.token_cap(self._mixed_rows()),
                         self.pacer.pair_weight / self.pacer.prior_weight
                         if self.pacer.prior_weight > 0 else 1.0)
        if mode == "decode":
            if self.speculator is not None:
                self.speculator.observe_step(fb.batch_size, t4 - t0)
            self.decode_totals["steps"] += 1
            self.decode_totals["rows"] += len(reqs)
            self.decode_totals["time_s"] += t4 - t0

    def _pick_rows(self, reqs: list[Req]) -> list[int] | None:
        """The decode step's rows to sample, when some request has several rows (else None:
        row i is request i): per request its last pending token's row (`BatchBuilder.
        sample_rows`), then, with drafts, the row of each draft (the token after it)."""
        first = self.builder.sample_rows
        if first is None:
            return None
        picks: list[int] = []
        for req, row in zip(reqs, first, strict=True):
            picks.extend(range(row, row + 1 + len(req.draft_ids)))
        return picks

    def _sampling_info(self, reqs: list[Req], picks: list[int] | None,
                       vocab_mask: tuple[list[int], torch.Tensor] | None) -> SamplingBatchInfo:
        """The step's sampling settings, one row per request, or per pick row (`_pick_rows`):
        a drafting request's j-th row samples the token after its drafts[:j], so it sees
        output_ids + drafts[:j] (its penalties' counts, `min_new_tokens` progress and seeded
        noise are those of that position, exactly what one token a step would give it)."""
        params = [r.sampling for r in reqs]
        prompts = [r.origin_input_ids for r in reqs]
        outputs = [r.output_ids for r in reqs]
        if picks is None:
            seen = [self._seen_ids(r) for r in reqs]
        else:
            params, prompts, outputs, first, seen = [], [], [], [], []
            for req in reqs:
                first.append(len(params))
                for j in range(1 + len(req.draft_ids)):
                    params.append(req.sampling)
                    prompts.append(req.origin_input_ids)
                    outputs.append([*req.output_ids, *req.draft_ids[:j]] if j
                                   else req.output_ids)
                    seen.append(self._seen_ids(req, req.draft_ids[:j]))
            if vocab_mask is not None:  # grammar rows never draft: one pick row each
                vocab_mask = ([first[i] for i in vocab_mask[0]], vocab_mask[1])
        return SamplingBatchInfo.build(params, prompts, outputs, self.vocab_size,
                                       self.runner.device, self.eos_token_ids, vocab_mask,
                                       seen_ids=seen)

    def _seen_ids(self, req: Req, drafts: list[int] | None = None) -> torch.Tensor | None:
        """A repetition-penalty request's distinct prompt + output ids (+ `drafts`), kept on
        the request across steps (`SeenIds`); None for other requests."""
        if req.sampling.repetition_penalty == 1.0:
            return None
        if req.seen_ids is None:
            req.seen_ids = SeenIds(req.origin_input_ids, self.vocab_size)
        return req.seen_ids.ids(req.output_ids, drafts or ())

    def _verify(self, reqs: list[Req], ids: list[int], lps: list[TokenLogprobs | None]
                ) -> tuple[list[int], list[TokenLogprobs | None], list[list[int] | None]]:
        """Per request, from the samples of its pick rows: its own token and logprobs (its
        first pick row), and for a drafting request the tokens its drafts earn
        (`NgramSpeculator.accept`: drafts while each equals the sample before it)."""
        out_ids: list[int] = []
        out_lps: list[TokenLogprobs | None] = []
        verified: list[list[int] | None] = []
        at = 0
        for req in reqs:
            n = 1 + len(req.draft_ids)
            out_ids.append(ids[at])
            out_lps.append(lps[at])
            if req.draft_ids:
                assert self.speculator is not None
                verified.append(self.speculator.accept(req, ids[at : at + n]))
            else:
                verified.append(None)
            at += n
        return out_ids, out_lps, verified

    def _grammar_masks(self, reqs: list[Req]) -> tuple[list[int], torch.Tensor] | None:
        """(constrained rows, their token bitmask) for this step, None if no row is. Rows of
        a chunked prefill that does not reach the prompt's end sample nothing: skipped."""
        rows = [i for i, r in enumerate(reqs)
                if r.grammar is not None and r.kv_len + r.extend_len >= r.seq_len()]
        if not rows:
            return None
        backend = self.grammars.backend
        bitmask = backend.new_bitmask(len(rows))
        backend.fill_bitmasks([reqs[i].grammar for i in rows], bitmask)  # type: ignore[misc]
        return rows, bitmask

    def _fail_batch(self, reqs: list[Req], message: str) -> None:
        """A step raised, at whatever point: free the step's slots no request committed, hand
        each request's committed KV to the cache and finish it with an error. A request that
        already finished normally in this step keeps its result and is not counted again."""
        self.kv.abort_step()
        for req in reqs:
            if req.finish_counted:
                continue
            req.finish_reason = None
            self._finish(req, FINISH_ABORT, message)

    # -- control ------------------------------------------------------------------------------------
    def live_reqs(self) -> list[Req]:
        reqs = [*self.running, *self.waiting, *self.grammar_wait]
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return reqs

    def warm_up(self, tokens: int = WARMUP_PREFILL_TOKENS, runs: int = 4) -> float | None:
        """Time `runs` fresh prefills of `tokens` dummy tokens before the first request and let
        the pacer observe the median of all but the first (which pays one-time costs), so a
        fresh server paces its first prompts: unmeasured, its first step took up to
        `chunked_prefill_size` tokens (a 2048-token prompt: one 1.37 s step on 2 Zen 4 cores,
        every request arriving meanwhile waiting for it). The median, because one reading on a
        shared host can run 1.5x slow (stop 74: one start capped its steps at 148 tokens, the
        next at 234, and a 3 s few-shot run followed). The row and slots are taken from the
        free lists and given back; nothing is cached or counted. Returns the observed seconds,
        None when nothing ran (pacing off, no room)."""
        n = min(tokens, self.max_context_len - 1, self.kv_pool.available_size())
        if self.pacer.target_s <= 0 or 2 * n < self.pacer.floor:
            return None
        row = self.req_pool.alloc()
        if row is None:
            return None
        slots = self.kv_pool.alloc(n)
        if slots is None:
            self.req_pool.free(row)
            return None
        times: list[float] = []
        try:
            self.req_pool.write([row], [0], [n], slots)
            ids = [(7919 * i + 13) % self.vocab_size for i in range(n)]
            for _ in range(max(1, runs)):
                t0 = time.perf_counter()
                fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [row], [0], [n],
                                        self.req_pool.req_to_token, self.runner.device)
                self.runner.forward_greedy(fb)
                times.append(time.perf_counter() - t0)
        finally:
            self.kv_pool.free(slots)
            self.req_pool.free(row)
        seconds = statistics.median(times[1:] or times)
        self.pacer.observe([(n, 0)], seconds)
        return seconds

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless every slot and row is owned exactly once."""
        self.kv.check(self.live_reqs())

    def flush_cache(self) -> tuple[bool, str]:
        if self.live_reqs():
            return False, "cannot flush the cache while requests are running or waiting"
        self.kv.reset()
        self.evicted_prefixes.append([])  # everything is gone
        return True, ""

    def stats(self) -> dict[str, object]:
        c = self.counters
        tuner = getattr(self.runner.model, "decode_path_tuner", None)
        return {
            "num_requests_total": c.requests,
            "num_finished_requests_total": c.finished_requests,
            "prompt_tokens_total": c.prompt_tokens,
            "cached_tokens_total": c.cached_tokens,
            "generated_tokens_total": c.generated_tokens,
            "retractions_total": c.retractions,
            "evicted_tokens_total": self.kv.evicted_tokens,
            "forward_steps_total": c.forward_steps,
            "cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "num_running": len(self.running) + (self.chunked_req is not None),
            "num_waiting": len(self.waiting) + len(self.grammar_wait),
            "num_grammar_compiling": len(self.grammar_wait),
            "grammars_compiled_total": self.grammars.compiles,
            "grammar_forced_tokens_total": self.outputs.forced_tokens,
            "max_total_tokens": self.kv_pool.size,
            "free_tokens": self.kv_pool.available_size(),
            "used_tokens": self.kv_pool.size - self.kv_pool.available_size(),
            "token_usage": 1 - self.kv_pool.available_size() / self.kv_pool.size,
            "cached_evictable_tokens": self.cache.evictable_size(),
            "cached_locked_tokens": self.cache.protected_size(),
            "new_token_ratio": self.new_token_ratio,
            "prefill_token_cap": self.pacer.token_cap(self._mixed_rows()),
            "prefill_work_cap": _finite_or_none(self.pacer.cap(self._mixed_rows())),
            "prefill_tokens_per_s": self.pacer.rate,
            # The measured weight of one attention pair in prefill work (the prior until then)
            # and the prior's.
            "prefill_pair_weight": self.pacer.pair_weight,
            "prefill_pair_weight_prior": self.pacer.prior_weight,
            "step_time_s": dict(self.step_times),
            "decode_totals": dict(self.decode_totals),
            "mixed_totals": dict(self.mixed_totals),
            "held_totals": dict(self.held_totals),
            # Per range of decode rows, the path the decode-path tuner took and why (empty
            # when it is off: `DecodePathTuner.describe`).
            "decode_paths": tuner.describe() if tuner is not None else {},
            **(self.speculator.stats() if self.speculator is not None else {}),
        }

    def answer(self, msg: object, replica: int = 0) -> list[object]:
        """`handle(msg)`, then what goes back to the tokenizer, in order. The eviction notices
        a control caused (a flush) travel ahead of its reply on the one socket, so the routing
        trees are emptied by the time the caller learns the flush is done: requests routed
        right after it are not erased from the trees under them."""
        reply = self.handle(msg)
        if reply is None:
            return []
        notice = [CacheEvicted(replica, self.take_evicted())] if self.evicted_prefixes else []
        return [*notice, reply]

    def handle(self, msg: object) -> ControlReply | None:
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.reason, msg.message)
        elif isinstance(msg, FlushCacheReq):
            ok, err = self.flush_cache()
            return ControlReply(msg.req_id, ok, error=err)
        elif isinstance(msg, StatsReq):
            return ControlReply(msg.req_id, True, data=self.stats())
        elif isinstance(msg, CheckInvariantsReq):
            try:
                self.check_invariants()
                return ControlReply(msg.req_id, True)
            except InvariantError as e:
                return ControlReply(msg.req_id, False, error=f"invariant violated: {e}")
        else:
            logger.warning("scheduler: unknown message %r", type(msg).__name__)
        return None

    @property
    def has_work(self) -> bool:
        """Something to step now (requests waiting only for their grammar are not)."""
        return bool(self.waiting or self.running or self.chunked_req or self.finished_this_step)

    @property
    def idle_poll_ms(self) -> int:
        """How long the loop may block on its socket when there is no work."""
        return GRAMMAR_POLL_MS if self.grammar_wait else IDLE_POLL_MS


def run_scheduler(args: ServerArgs, paths: ipc.IpcPaths, parent_pid: int,
                  replica: int = 0) -> None:
    """Process entry point. Sends a `ReadyMsg` to the tokenizer once the model is loaded;
    `replica` (of `--dp`) tags its `CacheEvicted` reports."""
    ipc.exit_with_parent(parent_pid, cleanup_dir=paths.directory)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s scheduler pid={os.getpid()}] %(message)s")
    torch.set_num_threads(args.resolved_threads())
    ctx = zmq.Context()
    recv = ipc.pull_socket(ctx, paths.scheduler)
    to_detok = ipc.push_socket(ctx, paths.detokenizer)
    to_tok = ipc.push_socket(ctx, paths.tokenizer)
    try:
        runner = ModelRunner(args)
        sched = Scheduler(args, runner)
        if runner.device.type == "cpu":
            warm = sched.warm_up()
            if warm is not None:
                logger.info("prefill pacer warm-up: %d tokens in %.1f ms, first prefill steps "
                            "capped at %d tokens", WARMUP_PREFILL_TOKENS, warm * 1e3,
                            sched.pacer.token_cap())
    except Exception as e:
        ipc.send(to_tok, ReadyMsg(False, error=f"{type(e).__name__}: {e}"))
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        time.sleep(0.5)
        return
    info = {
        "max_total_tokens": runner.sizes.max_total_tokens,
        "max_running_requests": runner.sizes.max_running_requests,
        "max_context_len": runner.sizes.max_context_len,
        "vocab_size": runner.model_config.vocab_size,
        "eos_token_ids": list(runner.model_config.eos_token_ids),
        "model_path": runner.model_path,
        "device": str(runner.device),
        "dtype": str(runner.dtype),
        # How `dtype="auto"` chose on CPU (choice, fp32/bf16 probe times); None otherwise.
        "dtype_probe": runner.dtype_probe.as_info() if runner.dtype_probe else None,
        # The resolved `quantization` mode and the kernel timings behind it (None untimed).
        "quantization": runner.describe_quantization(),
        "quant_probe": runner.quant_probe.as_info() if runner.quant_probe else None,
        # What `kv_cache_dtype` resolved to: the pool's storage dtype ("int8": codes + scales).
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "thread_wait": args.thread_wait,
        # How much of the model and pools sits on transparent huge pages (ServerArgs.
        # disable_huge_pages), measured after they were allocated.
        "huge_pages": {"enabled": not args.disable_huge_pages, **huge_page_info()},
    }
    logger.info("huge pages: %s", info["huge_pages"])
    ipc.send(to_tok, ReadyMsg(True, info=info))
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    last_log = time.monotonic()
    while True:
        if not sched.has_work:
            poller.poll(timeout=sched.idle_poll_ms)
        for msg in ipc.recv_all(recv):
            for back in sched.answer(msg, replica):
                ipc.send(to_tok, back)
        out = sched.step()
        if out is not None:
            ipc.send(to_detok, out)
        if sched.evicted_prefixes:
            ipc.send(to_tok, CacheEvicted(replica, sched.take_evicted()))
        now = time.monotonic()
        if now - last_log >= args.stats_interval_s and (sched.running or sched.waiting
                                                         or sched.grammar_wait):
            s = sched.stats()
            logger.info("running=%d waiting=%d token_usage=%.2f cache_hit_rate=%.3f "
                        "new_token_ratio=%.2f", s["num_running"], s["num_waiting"],
                        s["token_usage"], s["cache_hit_rate"], s["new_token_ratio"])
            last_log = now
