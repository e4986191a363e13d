"""N-gram speculative decoding (`radixrt.sched.speculative`, `--speculative-algorithm ngram`).

The n-gram index on its own, then the scheduler on the tiny random Llama in fp32: with drafts a
greedy request takes fewer steps and produces exactly the tokens of a run without them (the
tiny model repeats itself, so its drafts are often accepted), beside requests that may not draft
(logprobs, penalties); at `max_new_tokens`, a stop token inside the accepted drafts, under
memory pressure with retractions. Pools and tree are checked after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from test_scheduler import Run, assert_clean, greedy, prompt

from radixrt.config import ServerArgs
from radixrt.core.messages import FINISH_LENGTH, FINISH_STOP, GenerateReq
from radixrt.core.sampling_params import SamplingParams
from radixrt.model.runner import ModelRunner
from radixrt.sched.req import Req
from radixrt.sched.scheduler import Scheduler
from radixrt.sched.speculative import NgramIndex, NgramSpeculator


# -- the index -----------------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_latest_longest_match() -> None:
    idx = NgramIndex(2, 3)
    #      0  1  2  3  4  5  6  7  8  9 10
    ids = [1, 2, 3, 9, 1, 2, 4, 5, 7, 2, 3]
    # suffix (2, 3): only at 1..3 before -> what followed: 9, 1, 2
    assert idx.propose(ids, 3) == [9, 1, 2]
    # (1, 2) occurs at 0 and 4: the latest (4) wins -> 4, 5
    ids2 = [*ids, 1, 2]
    assert idx.propose(ids2, 2) == [4, 5]
    # (3, 1, 2) has no earlier occurrence, (1, 2) does (above); no match of 2+ tokens: nothing
    assert idx.propose([*ids2, 8], 4) == []
    # k caps the draft; the draft may run into the text's own end (a fresh sequence, a fresh
    # index: an index belongs to one growing sequence)
    assert NgramIndex(2, 3).propose([5, 6, 5, 6], 8) == [5, 6]
    assert NgramIndex(2, 4).propose([4], 3) == []


def test_ngram_index_prefers_a_longer_match() -> None:
    # (3, 4) last occurred followed by 8; (2, 3, 4) occurred followed by 5
    ids = [2, 3, 4, 5, 0, 3, 4, 8, 0, 2, 3, 4]
    assert NgramIndex(2, 3).propose(ids, 1) == [5]
    assert NgramIndex(2, 2).propose(ids, 1) == [8]


def _decoding(n: int) -> list[Req]:
    reqs = []
    for i in range(n):
        r = Req(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2], greedy(50))
        r.output_ids = [3]
        r.kv_len = r.seq_len() - 1  # one pending token each
        reqs.append(r)
    return reqs


def test_speculator_budget_and_acceptance_odds() -> None:
    spec = NgramSpeculator(4, 2, 3, max_rows=6, max_context_len=1000)
    reqs = _decoding(3)
    spec.propose(reqs)
    # no cost fit yet: drafts up to the limits; 3 pending rows, the rest of the 6-row budget
    # to the first
    assert [len(r.draft_ids) for r in reqs] == [3, 0, 0]
    assert reqs[0].draft_ids == [1, 2, 3]
    # argmax after the pending token and each draft: two drafts agree, the third not
    assert spec.accept(reqs[0], [1, 2, 7, 9]) == [1, 2, 7]
    assert (spec.drafted_tokens, spec.accepted_tokens) == (3, 2)
    assert (reqs[0].spec_acc, reqs[0].spec_rej) == (2, 1)
    assert NgramSpeculator.odds(reqs[0]) == pytest.approx(3 / 5)
    reqs[0].draft_ids = [5, 5]
    assert spec.accept(reqs[0], [6, 0, 0]) == [6]
    assert NgramSpeculator.odds(reqs[0]) < 0.5
    # sampled and penalized requests draft; logprobs, grammars and prompt scores do not
    for sp in (SamplingParams(max_new_tokens=9, temperature=0.7),
               greedy(9, repetition_penalty=1.2, logit_bias={3: 2.0}, min_new_tokens=4)):
        assert NgramSpeculator.eligible(Req("x", [1], sp))
    assert not NgramSpeculator.eligible(Req("x", [1], greedy(9, logprobs=True)))
    assert not NgramSpeculator.eligible(Req("x", [1], greedy(9, logprob_start_len=0)))


def test_draft_count_weighs_acceptance_against_the_measured_row_cost() -> None:
    """Steps measured at 4 ms + 0.5 ms a row: one row alone, a draft accepted half the time is
    worth 2.25 ms, the second 1.1 ms, the third 0.56 (>= 0.5), the fourth 0.28 (not); at 4
    rows a token is worth 1.5 ms: one draft (0.75), not two (0.38). A request whose drafts
    were mostly accepted gets the most; one whose drafts were rejected none, until its record
    fades."""
    spec = NgramSpeculator(4, 2, 3, max_rows=16, max_context_len=1000)
    for rows in (1, 2, 4, 8) * 3:
        spec.observe_step(rows, 0.004 + 0.0005 * rows)
    a, c = spec.cost.fit()  # type: ignore[misc]
    assert a == pytest.approx(0.004) and c == pytest.approx(0.0005)
    fresh, good, bad = _decoding(3)
    good.spec_acc, good.spec_rej = 9.0, 1.0
    bad.spec_acc, bad.spec_rej = 0.0, 10.0
    assert [spec.worth(r, 1) for r in (fresh, good, bad)] == [3, 4, 0]
    assert [spec.worth(r, 4) for r in (fresh, good, bad)] == [1, 4, 0]
    spec.propose([bad])
    assert bad.draft_ids == [] and bad.spec_rej < 10.0  # fading towards the prior
    for _ in range(30):
        spec.propose([bad])
    assert bad.draft_ids  # tried again


def test_default_row_budget_lets_eight_requests_draft() -> None:
    """With the default `speculative_max_rows`, a step of 8 decoding requests whose drafts were
    mostly accepted still drafts (steps at 3.7 ms + 0.6 ms a row, as measured on Zen 4: at 8
    rows a token is worth 1.06 ms, a 90% draft 0.95 > 0.6), and the step stays within the
    budget; a budget of 8 would have left such a step nothing."""
    args = ServerArgs()
    spec = NgramSpeculator(args.speculative_num_draft_tokens, 2, 3,
                           max_rows=args.speculative_max_rows, max_context_len=1000)
    for rows in (8, 12, 16, 24) * 3:
        spec.observe_step(rows, 0.0037 + 0.0006 * rows)
    reqs = _decoding(8)
    for r in reqs:
        r.spec_acc, r.spec_rej = 9.0, 1.0
    spec.propose(reqs)
    drafts = [len(r.draft_ids) for r in reqs]
    assert all(d > 0 for d in drafts)
    assert 8 + sum(drafts) <= args.speculative_max_rows
    tight = NgramSpeculator(4, 2, 3, max_rows=8, max_context_len=1000)
    tight.cost = spec.cost
    tight.propose(reqs)
    assert all(r.draft_ids == [] for r in reqs)


def test_server_args_check_the_speculative_fields() -> None:
    for kw, name in (({"speculative_algorithm": "eagle"}, "speculative_algorithm"),
                     ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
                     ({"speculative_ngram_min": 3, "speculative_ngram_max": 2},
                      "speculative_ngram_min"),
                     ({"speculative_max_rows": 1}, "speculative_max_rows")):
        with pytest.raises(ValueError, match=name):
            ServerArgs(**kw)  # type: ignore[arg-type]


# -- the scheduler -------------------------------------------------------------------------------
@pytest.fixture
def make(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Scheduler]:
    """Schedulers over the tiny Llama in fp32 (as test_scheduler's), one thread. The cost
    model never fits here: how many drafts a request gets would depend on the step times this
    machine measures, so every eligible request drafts up to the limits (what the tests below
    check is that drafts change no token, whatever their number)."""
    monkeypatch.setattr("radixrt.sched.step_cost.StepCostModel.fit", lambda self: None)

    def build(**kw: object) -> Scheduler:
        kw.setdefault("max_total_tokens", 1024)
        args = ServerArgs(model_path=str(tiny_llama_dir), num_threads=1, dtype="float32",
                          **kw)  # type: ignore[arg-type]
        return Scheduler(args, ModelRunner(args))

    return build


def _run(make: Callable[..., Scheduler], jobs: dict[str, tuple[list[int], SamplingParams]],
         **kw: object) -> tuple[Run, Scheduler]:
    sched = make(**kw)
    for rid, (ids, sp) in jobs.items():
        sched.handle(GenerateReq(rid, ids, sp))
    run = Run().drive(sched)
    return run, sched


def _repetitive_jobs(n: int, max_new: int = 40) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(11)
    jobs = {}
    for i in range(n):
        unit = prompt(rng, 6)
        jobs[f"r{i}"] = (prompt(rng, 5) + unit * 4, greedy(max_new))
    return jobs


SPEC = {"speculative_algorithm": "ngram"}


@pytest.mark.parametrize("batch", [1, 3])
def test_drafts_give_the_same_tokens_in_fewer_steps(make: Callable[..., Scheduler],
                                                    batch: int) -> None:
    jobs = _repetitive_jobs(batch)
    ref, _ = _run(make, jobs)
    run, sched = _run(make, jobs, **SPEC)
    assert run.tokens == ref.tokens
    for rid in jobs:
        assert run.finals[rid].finish_reason == FINISH_LENGTH
        assert len(run.tokens[rid]) == 40
    s = sched.stats()
    assert s["spec_accepted_tokens_total"] > 0
    assert s["spec_accepted_tokens_total"] <= s["spec_draft_tokens_total"]
    assert s["generated_tokens_total"] == 40 * batch
    # every accepted draft saved that request a step
    assert run.steps < ref.steps
    assert_clean(sched)


def test_sampled_penalized_and_logprobs_requests_beside_drafts(
        make: Callable[..., Scheduler]) -> None:
    """Every request but the one reporting logprobs drafts: a greedy one, one with a repetition
    penalty, `logit_bias` and `min_new_tokens`, and a seeded sampled one (each draft row
    sampled with the noise, counts and bans of its position) all give the tokens of a run
    without drafts; the logprobs request keeps its tokens and logprobs; an unseeded sampled
    request runs to its length."""
    jobs = _repetitive_jobs(5)
    jobs["r1"] = (jobs["r1"][0], greedy(40, logprobs=True, top_logprobs=2))
    jobs["r2"] = (jobs["r2"][0], greedy(40, repetition_penalty=1.3, logit_bias={7: 3.0},
                                        min_new_tokens=6))
    jobs["r3"] = (jobs["r3"][0], SamplingParams(max_new_tokens=40, temperature=0.1, top_k=20,
                                                seed=5, ignore_eos=True))
    jobs["r4"] = (jobs["r4"][0], SamplingParams(max_new_tokens=40, temperature=0.9,
                                                ignore_eos=True))
    ref, _ = _run(make, jobs)
    drafted: dict[str, int] = {}
    real = NgramSpeculator.accept

    def spy(self: NgramSpeculator, req: Req, picked: list[int]) -> list[int]:
        drafted[req.rid] = drafted.get(req.rid, 0) + len(req.draft_ids)
        return real(self, req, picked)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NgramSpeculator, "accept", spy)
        run, sched = _run(make, jobs, speculative_max_rows=24, **SPEC)
    assert {"r0", "r2", "r3"} <= set(drafted) and "r1" not in drafted
    for rid in ("r0", "r1", "r2", "r3"):
        assert run.tokens[rid] == ref.tokens[rid], rid
    assert len(run.tokens["r4"]) == 40
    lp = run.finals["r1"].logprobs
    ref_lp = ref.finals["r1"].logprobs
    assert lp is not None and ref_lp is not None
    assert lp.top_ids == ref_lp.top_ids
    assert lp.token_logprobs == pytest.approx(ref_lp.token_logprobs, abs=1e-4)
    assert sched.stats()["spec_accepted_tokens_total"] > 0
    assert_clean(sched)


def test_a_stop_token_inside_accepted_drafts_ends_the_request(
        make: Callable[..., Scheduler]) -> None:
    """The request stops at its stop token even when that token arrives as an accepted draft
    with more drafts after it: the same tokens as without drafts, the KV of the drafts after it
    dropped (invariants after every step)."""
    jobs = _repetitive_jobs(1, max_new=60)
    ref, _ = _run(make, jobs)
    toks = ref.tokens["r0"]
    stop = toks[len(toks) // 2]  # a token of the repeating part: drafted, not only sampled
    first = toks.index(stop)
    ids, _ = jobs["r0"]
    jobs = {"r0": (ids, greedy(60, stop_token_ids=[stop]))}
    ref, _ = _run(make, jobs)
    run, sched = _run(make, jobs, **SPEC)
    assert run.tokens == ref.tokens
    assert run.tokens["r0"] == toks[: first + 1]
    assert run.finals["r0"].finish_reason == FINISH_STOP
    assert_clean(sched)


@pytest.mark.parametrize("max_new", [2, 5, 7])
def test_drafts_never_pass_max_new_tokens(make: Callable[..., Scheduler],
                                          max_new: int) -> None:
    jobs = _repetitive_jobs(2, max_new=max_new)
    ref, _ = _run(make, jobs)
    run, sched = _run(make, jobs, **SPEC)
    assert run.tokens == ref.tokens
    assert all(len(t) == max_new for t in run.tokens.values())
    assert_clean(sched)


def test_drafts_under_memory_pressure(make: Callable[..., Scheduler]) -> None:
    """A pool too small for every request's drafts: drafts are dropped when the step cannot
    hold them, requests retracted as without speculation; the tokens stay the reference's."""
    jobs = _repetitive_jobs(6, max_new=48)
    ref, _ = _run(make, jobs)
    run, sched = _run(make, jobs, max_total_tokens=200, **SPEC)
    assert run.tokens == ref.tokens
    assert sched.stats()["retractions_total"] > 0
    assert_clean(sched)


def test_metrics_name_the_speculative_counters(make: Callable[..., Scheduler]) -> None:
    run, sched = _run(make, _repetitive_jobs(1), **SPEC)
    s = sched.stats()
    assert s["spec_verify_steps_total"] > 0
    assert 0 < s["spec_accept_rate"] <= 1
    _, plain = _run(make, _repetitive_jobs(1))
    assert "spec_draft_tokens_total" not in plain.stats()
