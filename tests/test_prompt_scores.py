"""Prompt scores (`logprob_start_len`): right against HF, served from the radix tree on a hit,
the same whatever the request order or cache setting, and leak-free."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixrt.config import ServerArgs
from radixrt.core.logprobs import TokenScores
from radixrt.core.messages import FINISH_LENGTH, GenerateReq
from radixrt.core.sampling_params import SamplingParams
from radixrt.mem.radix_cache import RadixCache
from radixrt.model.runner import ModelRunner
from radixrt.sched.prompt_scores import PromptScoring
from radixrt.sched.scheduler import Scheduler

VOCAB_LO, VOCAB_HI = 3, 390  # the tiny model's 400-token vocabulary, specials left out


@pytest.fixture
def make_sched(tiny_llama_dir: Path) -> Callable[..., Scheduler]:
    def make(**kw: object) -> Scheduler:
        kw.setdefault("max_total_tokens", 2048)
        args = ServerArgs(model_path=str(tiny_llama_dir), num_threads=1, dtype="float32",
                          **kw)  # type: ignore[arg-type]
        return Scheduler(args, ModelRunner(args))

    return make


def scoring(max_new: int = 1, start: int = 0, top: int = 1) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, logprob_start_len=start,
                          top_logprobs=top, logprobs=top > 0)


def run(sched: Scheduler, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, object]:
    """Submit all, drive to completion; rid -> the out carrying prompt_logprobs, plus finals."""
    for rid, ids, sp in reqs:
        sched.handle(GenerateReq(rid, ids, sp))
    prompt: dict[str, object] = {}
    finals: dict[str, object] = {}
    steps = 0
    while sched.has_work:
        steps += 1
        assert steps < 2000
        out = sched.step()
        for o in out.outs if out else []:
            if o.prompt_logprobs is not None:
                assert o.rid not in prompt, "prompt scores sent twice"
                prompt[o.rid] = o.prompt_logprobs
            if o.finish_reason is not None:
                finals[o.rid] = o
    sched.check_invariants()
    return {"prompt": prompt, "finals": finals}


def hf_scores(tiny_llama_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lsm = torch.log_softmax(logits, -1)
    return lsm[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def test_prompt_scores_match_hf(make_sched, tiny_llama_dir: Path) -> None:
    rng = random.Random(0)
    ids = rand_ids(rng, 40)
    res = run(make_sched(), [("a", ids, scoring(max_new=0, top=2))])
    lp = res["prompt"]["a"]
    fin = res["finals"]["a"]
    assert fin.finish_reason == FINISH_LENGTH and fin.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_ids[0] == []
    ref = hf_scores(tiny_llama_dir, ids)
    ours = torch.tensor(lp.token_logprobs[1:])
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    for j in range(1, len(ids)):
        assert len(lp.top_ids[j]) == 2 and lp.top_logprobs[j][0] >= lp.top_logprobs[j][1]
        assert lp.token_logprobs[j] <= lp.top_logprobs[j][0] + 1e-6
        if lp.top_ids[j][0] == ids[j]:  # the chosen token is the argmax: the same float
            assert lp.token_logprobs[j] == lp.top_logprobs[j][0]


def test_logprob_start_len_reports_from_there(make_sched) -> None:
    rng = random.Random(1)
    ids = rand_ids(rng, 30)
    res = run(make_sched(), [("full", ids, scoring(start=0)), ("tail", ids, scoring(start=17))])
    full, tail = res["prompt"]["full"], res["prompt"]["tail"]
    assert len(full.token_logprobs) == 30 and len(tail.token_logprobs) == 13
    assert tail.token_logprobs == full.token_logprobs[17:]
    assert res["finals"]["tail"].completion_tokens == 1


def test_cached_prefix_serves_scores_without_recompute(make_sched) -> None:
    """The second request over the same few-shot block reads the block's scores from the tree:
    it computes only its own tail (plus the one position before it) and reports the hit."""
    rng = random.Random(2)
    shared = rand_ids(rng, 64)
    a, b = shared + rand_ids(rng, 6), shared + rand_ids(rng, 5)
    sched = make_sched()
    computed: list[int] = []
    orig = sched.builder.build_extend

    def spy(reqs):
        fb = orig(reqs)
        computed.append(fb.num_tokens)
        return fb

    sched.builder.build_extend = spy  # type: ignore[method-assign]
    first = run(sched, [("a", a, scoring())])
    computed.clear()
    second = run(sched, [("b", b, scoring())])
    assert computed == [len(b) - 64 + 1], computed  # the shared block minus its last position
    assert second["finals"]["b"].cached_tokens == 63
    assert second["prompt"]["b"].token_logprobs[:64] == first["prompt"]["a"].token_logprobs[:64]
    # A plain request cached a prefix without scores: a scoring request recomputes it.
    sched2 = make_sched()
    run(sched2, [("plain", a, SamplingParams(max_new_tokens=1, temperature=0.0))])
    computed2: list[int] = []
    orig2 = sched2.builder.build_extend
    sched2.builder.build_extend = lambda reqs: (  # type: ignore[method-assign]
        computed2.append(sum(r.extend_len for r in reqs)), orig2(reqs))[1]
    res = run(sched2, [("b", b, scoring())])
    assert computed2 == [len(b)]
    assert res["prompt"]["b"].token_logprobs[:64] == first["prompt"]["a"].token_logprobs[:64]
    # ... once: its exact K/V replaced the plain copy (nobody read it), so the next one hits.
    computed2.clear()
    c = shared + rand_ids(rng, 7)
    res_c = run(sched2, [("c", c, scoring())])
    assert computed2 == [len(c) - 64 + 1], computed2
    assert res_c["finals"]["c"].cached_tokens == 63
    assert res_c["prompt"]["c"].token_logprobs[:64] == first["prompt"]["a"].token_logprobs[:64]


def _workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Few-shot style: one shared block, several documents, several choices each."""
    rng = random.Random(seed)
    block = rand_ids(rng, 48)
    reqs = []
    for d in range(3):
        doc = rand_ids(rng, rng.randrange(5, 12))
        for c in range(3):
            reqs.append((f"d{d}c{c}", block + doc + rand_ids(rng, rng.randrange(1, 4)), scoring()))
    return reqs


@pytest.mark.parametrize("seed", [0, 1])
def test_scores_identical_in_any_order_and_with_cache_off(make_sched, seed: int) -> None:
    reqs = _workload(seed)
    results = []
    orders = [reqs, reqs[::-1], random.Random(seed).sample(reqs, len(reqs))]
    for order in orders:  # one scheduler per order, requests all queued at once
        results.append(run(make_sched(), order)["prompt"])
    one_by_one = make_sched()  # warm cache, requests arriving one at a time
    results.append({rid: run(one_by_one, [(rid, ids, sp)])["prompt"][rid]
                    for rid, ids, sp in reqs})
    results.append(run(make_sched(disable_radix_cache=True), reqs)["prompt"])
    results.append(run(make_sched(chunked_prefill_size=16), reqs)["prompt"])
    base = results[0]
    for other in results[1:]:
        for rid, _, _ in reqs:
            a, b = base[rid].token_logprobs, other[rid].token_logprobs
            assert a[0] is None and b[0] is None
            assert [x for x in a[1:]] == [x for x in b[1:]], rid  # bit for bit
            assert base[rid].top_ids == other[rid].top_ids


def test_scoring_and_plain_requests_share_batches_and_cache(make_sched) -> None:
    rng = random.Random(3)
    shared = rand_ids(rng, 40)
    reqs = [("s1", shared + rand_ids(rng, 4), scoring(max_new=3)),
            ("p1", shared + rand_ids(rng, 4), SamplingParams(max_new_tokens=3, temperature=0.0)),
            ("s2", shared + rand_ids(rng, 4), scoring(max_new=0))]
    sched = make_sched()
    res = run(sched, reqs)
    assert set(res["prompt"]) == {"s1", "s2"}
    assert res["finals"]["p1"].completion_tokens == 3
    assert res["finals"]["s2"].completion_tokens == 0
    assert sched.stats()["cached_tokens_total"] > 0
    for rid in ("s1", "s2"):
        assert all(x is not None and math.isfinite(x) for x in res["prompt"][rid].token_logprobs[1:])


def test_tree_scores_survive_split_and_fill_only_unknown() -> None:
    cache = RadixCache()
    key = list(range(10, 20))
    s = TokenScores.unknown(10)
    s.logprob[2:6] = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    s.top_id[2:6] = torch.tensor([7, 8, 9, 10])
    s.top_logprob[2:6] = torch.tensor([-0.5, -0.6, -0.7, -0.8])
    cache.insert(key, torch.arange(1, 11), s)
    m = cache.match_prefix(key[:4])  # splits the node
    got = cache.prefix_scores(m.last_node)
    assert len(got) == 4 and got.logprob[2:4].tolist() == [-1.0, -2.0]
    assert torch.isnan(got.logprob[:2]).all()
    later = TokenScores.unknown(10)
    later.logprob[:] = -9.0
    cache.insert(key, torch.arange(11, 21), later)  # fills unknowns, keeps the known ones
    full = cache.prefix_scores(cache.match_prefix(key).last_node)
    assert full.logprob.tolist() == [-9.0, -9.0, -1.0, -2.0, -3.0, -4.0] + [-9.0] * 4
    cache.check_invariants()


def test_usable_prefix_rule() -> None:
    sc = PromptScoring(num_prompt=10, start=3, top_k=1)
    assert sc.usable_prefix(0) == 0
    assert sc.usable_prefix(3) == 2  # position 3 is wanted and unknown: compute position 2
    assert sc.usable_prefix(2) == 2  # wanted positions all lie beyond the prefix
    tree = TokenScores.unknown(6)
    tree.logprob[3:6] = -1.0
    tree.exact[:] = True
    assert sc.take_from_tree(tree) == 5  # 3..5 known, 6 is not: recompute position 5  # 3..5 known, 6 is not: recompute position 5
    assert sc.targets(5, 5) == [6, 7, 8, 9]
    assert list(itertools.islice(sc.targets(0, 10), 3)) == [6, 7, 8]


def test_adopt_exact_never_touches_locked_nodes() -> None:
    cache = RadixCache()
    key = list(range(100, 108))
    cache.insert(key, torch.arange(1, 9))  # inexact K/V (plain traffic)
    m = cache.match_prefix(key[:4])
    cache.inc_lock_ref(m.last_node)  # a live request reads the first four slots
    exact = torch.ones(8, dtype=torch.bool)
    replaced = cache.adopt_exact(key, torch.arange(21, 29), exact)
    assert replaced.tolist() == [5, 6, 7, 8]  # only the unlocked tail is upgraded
    full = cache.match_prefix(key)
    assert full.indices.tolist() == [1, 2, 3, 4, 25, 26, 27, 28]
    assert cache.prefix_scores(full.last_node).exact.tolist() == [False] * 4 + [True] * 4
    cache.dec_lock_ref(m.last_node)
    cache.check_invariants()
