"""End to end through the three processes with the default SmolLM2 (GGUF, fp32): greedy tokens
identical to Hugging Face `generate`, prefix hits reported, and identical outputs whatever the
cache / chunking / memory-pressure configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt import Engine, SamplingParams
from radixrt.sched.schedule_policy import IN_BATCH_SHARE_MIN_TOKENS

SYSTEM = (
    "You are the support assistant of Northwind Cycles, a bicycle shop. Follow these rules. "
    "Answer briefly and politely. Prices: tune-up 60 dollars, flat repair 15 dollars, brake "
    "adjustment 25 dollars, chain replacement 35 dollars, wheel truing 30 dollars. Opening hours: "
    "Monday to Saturday from nine to six, closed on Sunday and public holidays. The shop is at 12 "
    "Harbour Street, next to the ferry terminal. Rentals cost 20 dollars a day and need an ID. "
    "Never promise same-day repairs in spring, the busiest season. If a question is not about "
    "bicycles, say that you can only help with bicycles. Do not invent prices that are not listed."
)
QUESTIONS = [
    "How much is a tune-up?",
    "Are you open on Sunday?",
    "Where is the shop?",
    "Can I rent a bike without an ID?",
]
MAX_NEW = 24


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def engine():
    with Engine(max_total_tokens=20000, dtype="float32") as eng:
        # The scheduler process timed a warm-up prefill before it reported ready: a fresh server
        # paces its first prompts (`Scheduler.warm_up`); the warm-up left no trace behind.
        fresh = eng.stats()
        assert fresh["prefill_tokens_per_s"] is not None
        assert fresh["forward_steps_total"] == 0 and fresh["free_tokens"] == 20000
        yield eng


@pytest.fixture(scope="module")
def prompt_ids(engine: Engine) -> list[list[int]]:
    return [engine.apply_chat_template(c) for c in conversations()]


@pytest.fixture(scope="module")
def hf_reference(prompt_ids: list[list[int]], smollm2_hf_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                               do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    return outs


def check_clean(engine: Engine) -> None:
    """Invariants hold, and after a flush every slot and row is free."""
    engine.wait_idle()
    engine.check_invariants()
    assert engine.flush_cache()
    s = engine.stats()
    assert s["free_tokens"] == s["max_total_tokens"]
    engine.check_invariants()


GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)


def test_greedy_matches_hf_and_prefix_is_cached(engine, prompt_ids, hf_reference):
    engine.flush_cache()
    outs = engine.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    for out, ref in zip(outs, hf_reference, strict=True):
        assert out.token_ids == ref
        assert out.text == engine.tokenizer.decode(ref, skip_special_tokens=True)
        assert out.finish_reason in ("stop", "length")
        assert out.completion_tokens == len(ref)
    common = 0
    while all(p[common] == prompt_ids[0][common] for p in prompt_ids):
        common += 1
    assert common > 150
    # The first request computes the shared prefix; the others are held back and hit it. The
    # pacer may cut the first prompt into chunks (it measured its rate at start-up); the others
    # then wait while at least IN_BATCH_SHARE_MIN_TOKENS shared tokens are still uncached.
    least = common - IN_BATCH_SHARE_MIN_TOKENS
    assert outs[0].cached_tokens == 0
    for out in outs[1:]:
        assert out.cached_tokens >= least
    s = engine.stats()
    assert s["cached_tokens_total"] >= 3 * least
    check_clean(engine)


def test_chat_api_and_single_prompt(engine, hf_reference):
    out = engine.chat(conversations()[0], GREEDY)
    assert out.token_ids == hf_reference[0]
    text_out = engine.generate("The capital of France is", SamplingParams(max_new_tokens=4,
                                                                          temperature=0))
    assert text_out.prompt_tokens > 0 and 1 <= text_out.completion_tokens <= 4
    check_clean(engine)


@pytest.mark.parametrize("kwargs", [
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 16, "schedule_policy": "fcfs"},
    {"schedule_policy": "dfs-weight", "max_prefill_tokens": 200},
])
def test_outputs_identical_across_configurations(kwargs, prompt_ids, hf_reference):
    with Engine(max_total_tokens=20000, dtype="float32", **kwargs) as eng:
        outs = eng.generate(input_ids=prompt_ids, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == hf_reference
        if kwargs.get("disable_radix_cache"):
            assert all(o.cached_tokens == 0 for o in outs)
        check_clean(eng)


def test_eviction_and_retraction_under_memory_pressure(engine, prompt_ids):
    params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    # Reference: plenty of memory.
    engine.flush_cache()
    ref = [o.token_ids for o in engine.generate(input_ids=prompt_ids, sampling_params=params)]
    check_clean(engine)
    shared = len(prompt_ids[0])
    total = shared + 48 + 40  # one whole request fits; four in flight cannot
    with Engine(max_total_tokens=total, max_context_len=total, dtype="float32") as eng:
        outs = eng.generate(input_ids=prompt_ids, sampling_params=params)
        assert [o.token_ids for o in outs] == ref
        assert all(o.finish_reason == "length" for o in outs)
        s = eng.stats()
        assert s["retractions_total"] > 0
        assert s["evicted_tokens_total"] > 0
        check_clean(eng)
