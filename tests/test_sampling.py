"""Sampling parameters and the batched sampler (CPU; fast)."""

from __future__ import annotations

import math
import pickle
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.core.errors import InvalidRequestError
from radixrt.core.sampling_params import SamplingParams
from radixrt.sampling import sampler as sampler_mod
from radixrt.sampling.batch_info import SamplingBatchInfo, SeenIds, step_seed
from radixrt.sampling.sampler import Sampler, apply_penalties, filter_logits, pick_by_uniform

NEG_INF = float("-inf")


def build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: tuple[int, ...] = (),
) -> SamplingBatchInfo:
    n = len(params)
    return SamplingBatchInfo.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab,
        "cpu",
        eos_token_ids=eos,
    )


def sample(
    params: list[SamplingParams],
    logits: torch.Tensor,
    sampler: Sampler | None = None,
    **kw: object,
) -> list[int]:
    info = build(params, logits.shape[1], **kw)  # type: ignore[arg-type]
    return (sampler or Sampler()).sample(logits, info).next_token_ids


# --------------------------------------------------------------------------- params


def test_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == ()
    p.validate()
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    q = SamplingParams(temperature=0.5, stop=["x"], seed=7)
    assert pickle.loads(pickle.dumps(q)) == q
    assert SamplingParams.from_dict(q.to_dict()) == q


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", True),
        ("max_new_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", False),
        ("min_p", 1.1),
        ("min_p", -0.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("presence_penalty", "1"),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("seed", 1.0),
        ("seed", True),
        ("seed", "42"),
        ("stop", [""]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("min_new_tokens", -1),
        ("min_new_tokens", 500),
        ("ignore_eos", 1),
        ("logprobs", "yes"),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {5: -100.5}),
        ("logit_bias", {"-3": 1}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {5: "big"}),
        ("logit_bias", {5: float("inf")}),
        ("logit_bias", {5: True}),
        ("logit_bias", [5, 1]),
    ],
)
def test_validate_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_validate_message_and_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(InvalidRequestError, match=r"top_p: must be in \(0, 1\], got 1.5") as ei:
        SamplingParams(top_p=1.5).validate()
    assert ei.value.field == "top_p"
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=3).validate()
    SamplingParams(logprobs=True, top_logprobs=20, top_k=0, seed=-5, temperature=0).validate()


def test_from_dict_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="bogus.*nope|nope.*bogus"):
        SamplingParams.from_dict({"temperature": 0.5, "nope": 1, "bogus": 2})
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
    p = SamplingParams.from_dict({"temperature": 0, "stop": "x", "max_new_tokens": 5})
    assert p.is_greedy and p.stop == ("x",) and p.max_new_tokens == 5


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_fast_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=0.9, top_k=1)] * 3
    info = build(params, 50)
    assert info.is_fast_path
    out = Sampler().sample(logits, info)
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_fast_path_takes_the_picked_greedy_ids_and_only_there() -> None:
    """`greedy_ids` (the LM head's own argmax) is the sample of an all-greedy step; a step with
    a sampled or logprobs row ignores it; a wrong shape is refused naming it."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    picked = torch.tensor([5, 6, 7, 8])  # forged, so that taking them shows
    info = build([SamplingParams(temperature=0)] * 4, 30)
    assert info.temperatures is None and info.top_ks is None  # nothing sampled: not built
    assert Sampler().sample(logits, info, picked).next_token_ids == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="greedy_ids"):
        Sampler().sample(logits, info, picked[:3])
    for other in (SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0.7)):
        info = build([SamplingParams(temperature=0)] * 3 + [other], 30)
        ids = Sampler().sample(logits, info, picked).next_token_ids
        assert ids[:3] == logits[:3].argmax(-1).tolist()


def test_a_greedy_step_without_logits_takes_the_picked_ids_only_there() -> None:
    """No logits (an LM head that picked the ids without writing them): an all-greedy step
    samples the ids; any other step, or no ids, is refused rather than guessed."""
    picked = torch.tensor([3, 1])
    info = build([SamplingParams(temperature=0)] * 2, 30)
    assert Sampler().sample(None, info, picked).next_token_ids == [3, 1]
    with pytest.raises(ValueError, match="greedy_ids must be"):
        Sampler().sample(None, info, picked[:1])
    with pytest.raises(ValueError, match="logits are required"):
        Sampler().sample(None, info)
    for other in (SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0.7)):
        info = build([SamplingParams(temperature=0), other], 30)
        with pytest.raises(ValueError, match="logits are required"):
            Sampler().sample(None, info, picked)


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    params = [SamplingParams(temperature=0 if i % 2 else 1.3, top_p=0.9) for i in range(8)]
    info = build(params, 40)
    assert not info.is_fast_path
    ids = Sampler().sample(logits, info).next_token_ids
    argmax = logits.argmax(-1).tolist()
    assert all(ids[i] == argmax[i] for i in range(1, 8, 2))


def test_shape_and_length_checks() -> None:
    with pytest.raises(ValueError):
        SamplingBatchInfo.build([SamplingParams()], [[], []], [[]], 10, "cpu")
    info = build([SamplingParams()], 10)
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(1, 11), info)


# --------------------------------------------------------------------------- seeds


def test_seeded_same_tokens_across_calls_and_batches() -> None:
    vocab = 64
    torch.manual_seed(2)
    row = torch.randn(vocab)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    prompt, outs = [1, 2, 3], [5, 6]

    alone = sample([seeded], row[None].clone(), Sampler(seed=0), prompts=[prompt], outputs=[outs])
    for sampler_seed in (0, 1, 99):
        again = sample(
            [seeded],
            row[None].clone(),
            Sampler(seed=sampler_seed),
            prompts=[prompt],
            outputs=[outs],
        )
        assert again == alone
    # Same request inside different batches, at different positions, next to other settings.
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.5, seed=77, frequency_penalty=0.5),
        SamplingParams(min_p=0.2, logprobs=True, top_logprobs=2),
    ]
    for pos in range(len(others) + 1):
        params = others[:pos] + [seeded] + others[pos:]
        logits = torch.randn(len(params), vocab)
        logits[pos] = row
        prompts = [[7, 8]] * len(params)
        outputs = [[9]] * len(params)
        prompts[pos], outputs[pos] = prompt, outs
        ids = sample(params, logits, Sampler(seed=pos), prompts=prompts, outputs=outputs)
        assert ids[pos] == alone[0]


def test_seeded_sequence_reproducible_and_seeds_differ() -> None:
    vocab = 200
    logits = torch.zeros(1, vocab)  # uniform: every step is a fresh draw

    def run(seed: int, steps: int = 30) -> list[int]:
        sampler, out = Sampler(), []
        params = [SamplingParams(seed=seed)]
        for _ in range(steps):
            out += sample(params, logits, sampler, outputs=[list(out)])
        return out

    a, b = run(5), run(5)
    assert a == b
    assert run(6) != a
    assert len(set(a)) > 15  # steps get different randomness, not one repeated draw
    firsts = [run(s, steps=1)[0] for s in range(100)]
    assert len(set(firsts)) > 50
    assert step_seed(5, 0) != step_seed(5, 1) != step_seed(6, 0)


def test_unseeded_rows_follow_sampler_seed_and_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, -1).contiguous()
    params = [SamplingParams()] * n
    a = sample(params, logits, Sampler(seed=3))
    assert a == sample(params, logits, Sampler(seed=3))
    assert a != sample(params, logits, Sampler(seed=4))
    freq = torch.bincount(torch.tensor(a), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    ids = [sample([SamplingParams(seed=s)], probs.log()[None])[0] for s in range(1500)]
    freq = torch.bincount(torch.tensor(ids), minlength=3).float() / len(ids)
    assert torch.allclose(freq, probs, atol=0.04)


def test_temperature_effect() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 3000

    def top_share(t: float) -> float:
        ids = sample([SamplingParams(temperature=t)] * n, logits.expand(n, -1).contiguous())
        return Counter(ids)[0] / n

    cold, warm, hot = top_share(0.3), top_share(1.0), top_share(3.0)
    assert cold > 0.95 and cold > warm > hot
    expected = torch.softmax(logits, -1)[0].item()
    assert abs(warm - expected) < 0.03
    scaled = filter_logits(logits[None], torch.tensor([0.5]))
    assert torch.allclose(scaled, logits[None] / 0.5)


# --------------------------------------------------------------------------- filters


def test_filters_on_crafted_logits() -> None:
    # Token order shuffled; probabilities 0.4, 0.3, 0.2, 0.05, 0.05.
    probs = torch.tensor([0.05, 0.3, 0.05, 0.4, 0.2])
    logits = probs.log()[None]
    one = torch.ones(1)

    def kept(**kw: object) -> set[int]:
        f = {k: torch.tensor([v]) for k, v in kw.items()}
        out = filter_logits(logits, one, f.get("k"), f.get("p"), f.get("m"))
        return set(torch.nonzero(out[0] > NEG_INF).view(-1).tolist())

    assert kept(k=2) == {3, 1}
    assert kept(k=5) == {0, 1, 2, 3, 4}
    assert kept(p=0.6) == {3, 1}
    assert kept(p=0.75) == {3, 1, 4}
    assert kept(p=0.1) == {3}
    assert kept(p=1.0) == {0, 1, 2, 3, 4}
    assert kept(m=0.5) == {3, 1, 4}
    assert kept(m=0.6) == {3, 1}
    assert kept(m=1.0) == {3}
    assert kept(m=0.0) == {0, 1, 2, 3, 4}
    # top-p applies to the top-k renormalized distribution: 0.44, 0.33 | 0.22
    assert kept(k=3, p=0.5) == {3, 1}
    # And the sampler never emits anything else.
    n = 2000
    for params, allowed in [
        (SamplingParams(top_k=2), {3, 1}),
        (SamplingParams(top_p=0.75), {3, 1, 4}),
        (SamplingParams(min_p=0.6, temperature=2.0), {3, 1, 4}),  # min-p after temperature
        (SamplingParams(min_p=0.8, temperature=2.0), {3, 1}),
        (SamplingParams(top_k=3, top_p=0.5), {3, 1}),
    ]:
        ids = sample([params] * n, logits.expand(n, -1).contiguous())
        assert set(ids) == allowed, params
    # Seeded rows (own noise per row) obey the same masks.
    seeded = [SamplingParams(top_k=3, top_p=0.5, seed=s) for s in range(300)]
    assert set(sample(seeded, logits.expand(300, -1).contiguous())) == {3, 1}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 80),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(-1, 90),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    use_seed=st.booleans(),
)
def test_filters_never_emit_masked(
    seed: int,
    vocab: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    use_seed: bool,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=gen) * 4
    row[torch.rand(vocab, generator=gen) < 0.1] = NEG_INF  # some tokens already impossible
    row[0] = 1.0  # at least one finite logit
    p = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed if use_seed else None,
    )
    p.validate()
    if p.is_greedy:
        return
    filtered = filter_logits(
        row[None],
        torch.tensor([temperature]),
        torch.tensor([min(top_k, vocab) if top_k > 0 else vocab]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )[0]
    keep = filtered > NEG_INF
    assert keep.any()
    # Properties in the original probability order (ties broken arbitrarily; allow slack).
    probs = torch.softmax(row.double() / temperature, -1)
    kept_probs = probs[keep]
    dropped = probs[~keep & (row > NEG_INF)]
    if top_k > 0:
        assert int(keep.sum()) <= top_k
    if dropped.numel():
        # Kept tokens form a top prefix: nothing dropped beats something kept.
        assert dropped.max() <= kept_probs.min() + 1e-9
    assert kept_probs.min() >= min_p * probs.max() - 1e-6
    if top_p < 1.0:
        # Without the last kept token, the (top-k renormalized) mass is below top_p.
        k = min(top_k, vocab) if top_k > 0 else vocab
        topk_mass = probs.sort(descending=True).values[:k].sum()
        assert (kept_probs.sum() - kept_probs.min()) / topk_mass < top_p + 1e-5
    n = 64
    ids = sample([p] * n, row.expand(n, -1).contiguous(), Sampler(seed=seed))
    assert all(keep[i] for i in ids)


def test_top_window_equals_the_full_sort_at_vocabulary_size() -> None:
    """At a 49k vocabulary top-k / top-p look at the 256 largest logits first: the kept sets
    equal the full sort's for peaked rows (top-p reached inside the window), a flat row (past
    it: the full sort decides), a top-k above the window, and rows without filters beside
    them (kept whole)."""
    vocab = 49152
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=gen) * 6
    flat = torch.randn(vocab, generator=gen) * 0.1
    cases = [  # (row, top_k, top_p)
        (peaked, vocab, 0.9), (peaked, 40, 1.0), (peaked, 40, 0.5), (peaked, 1000, 0.95),
        (peaked, vocab, 1.0), (flat, vocab, 0.9), (flat, 300, 0.8),
    ]
    x = torch.stack([c[0] for c in cases])
    ks = torch.tensor([c[1] for c in cases])
    ps = torch.tensor([c[2] for c in cases])
    ones = torch.ones(len(cases))
    got = filter_logits(x, ones, ks, ps)
    ref = sampler_mod._top_k_top_p_sorted(x, ks, ps)
    assert torch.equal(got > NEG_INF, ref > NEG_INF)
    assert torch.equal(got[ref > NEG_INF], x[ref > NEG_INF])
    assert bool((got[4] == x[4]).all())  # no filter: the row as it was
    # without the flat row, no row reaches past the window: the windowed path itself
    sub = [0, 1, 2, 3, 4]
    got = filter_logits(x[sub], ones[sub], ks[sub], ps[sub])
    assert torch.equal(got > NEG_INF, ref[sub] > NEG_INF)
    assert int((got[0] > NEG_INF).sum()) < sampler_mod.TOP_WINDOW


def test_pick_by_uniform_inverts_the_cdf_and_never_picks_a_masked_token() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])
    scores = probs.log()
    for u, want in ((0.0, 1), (0.2499, 1), (0.25, 3), (0.7499, 3), (0.75, 4), (0.999999, 4)):
        assert pick_by_uniform(scores, torch.tensor([u])).tolist() == [want], u
    # a target rounding would put at the total (u = 1 is outside U[0, 1)) takes the last token
    # with mass, not the masked one after it
    assert pick_by_uniform(scores, torch.tensor([1.0])).tolist() == [4]
    many = torch.rand(20000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids = pick_by_uniform(scores.expand(20000, -1), many)
    freq = torch.bincount(ids, minlength=6).double() / 20000
    assert torch.allclose(freq, probs[0].double(), atol=0.015)


# --------------------------------------------------------------------------- the CPU op


@pytest.fixture
def sample_rows_op():
    from radixrt.attention import cpu_kernels

    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    return torch.ops.radixrt.sample_rows


def _op_args(n: int, vocab: int, k=None, p=None, m=None):
    return (torch.full((n,), vocab) if k is None else k, torch.ones(n) if p is None else p,
            torch.zeros(n) if m is None else m)


def test_sample_rows_makes_the_torch_paths_cut_and_draw(sample_rows_op) -> None:
    """At the vocabulary's size, peaked and flat rows, every filter alone and together, one
    batch of mixed settings: for uniforms in the middle of each kept token's CDF interval (the
    torch path's), the op picks the same token; tokens the torch path drops are never picked."""
    vocab = 49152
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(vocab, generator=gen) * 6
    flat = torch.randn(vocab, generator=gen) * 0.3
    # one heavy token over a long tail holding a third of the mass: top-p 0.9 reaches into the
    # tail, past the op's first gathering thresholds
    spike = torch.randn(vocab, generator=gen) * 0.1 - 11.5
    spike[123] = 0.0
    cases = [  # (row, temperature, top_k, top_p, min_p)
        (peaked, 0.7, vocab, 1.0, 0.0), (peaked, 1.3, vocab, 0.9, 0.0), (peaked, 0.7, 50, 1.0, 0.0),
        (peaked, 0.7, vocab, 1.0, 0.05), (peaked, 1.0, 40, 0.95, 0.05), (peaked, 0.5, 3, 0.2, 0.0),
        (flat, 1.0, vocab, 0.9, 0.0), (flat, 1.0, 500, 0.5, 0.0), (flat, 2.0, vocab, 1.0, 0.0),
        (peaked, 1.0, 1, 1.0, 0.0), (peaked, 1.0, vocab, 0.0, 0.0), (spike, 1.0, vocab, 0.9, 0.0),
    ]
    x = torch.stack([c[0] for c in cases])
    t = torch.tensor([c[1] for c in cases])
    k = torch.tensor([c[2] for c in cases])
    p = torch.tensor([c[3] for c in cases])
    m = torch.tensor([c[4] for c in cases])
    x[0, 7] = NEG_INF  # masked tokens stay out
    filtered = filter_logits(x, t, k, p, m)
    probs = filtered.double().softmax(-1)
    cdf = probs.cumsum(-1)
    for draw in range(24):
        us = []
        for r in range(len(cases)):
            # intervals wide enough to aim at (float rounding moves their ends by ~1e-7)
            kept = torch.nonzero(probs[r] >= min(1e-3, float(probs[r].max()) / 2)).view(-1)
            tok = int(kept[draw % len(kept)])
            us.append(float(cdf[r, tok] - probs[r, tok] / 2))
        u = torch.tensor(us, dtype=torch.float64)
        want = pick_by_uniform(filtered, u)
        assert sample_rows_op(x, t, k, p, m, u).tolist() == want.tolist(), draw
    allowed = filtered > NEG_INF
    many = 300
    for r in range(len(cases)):
        u = torch.rand(many, generator=gen, dtype=torch.float64)
        args = [v[r : r + 1].expand(many, *v.shape[1:]).contiguous() for v in (x, t, k, p, m)]
        ids = sample_rows_op(*args, u)
        assert bool(allowed[r, ids].all()), r
    assert int((filtered[9] > NEG_INF).sum()) == 1 and int((filtered[10] > NEG_INF).sum()) == 1
    assert int((filtered[11] > NEG_INF).sum()) > 1000  # the spike's top-p reached the tail


def test_sample_rows_ties_edges_and_frequencies(sample_rows_op) -> None:
    """Ties at a cut keep the lowest indices; top-p keeps the prefix whose mass before each
    token is at most p; u at the top takes the last kept token; frequencies follow the kept
    distribution; bad arguments raise naming the field."""
    row = torch.full((1, 64), NEG_INF)
    row[0, [5, 9, 20, 33, 40]] = 1.0  # five equal heaviest tokens
    row[0, 50] = -1.0
    sweep = torch.linspace(0, 0.999999, 400, dtype=torch.float64)
    n = sweep.numel()
    rep = row.expand(n, -1).contiguous()
    one = torch.ones(n)
    k, p, m = _op_args(n, 64, k=torch.full((n,), 3))
    assert set(sample_rows_op(rep, one, k, p, m, sweep).tolist()) == {5, 9, 20}
    k, p, m = _op_args(n, 64, p=torch.full((n,), 0.4))  # each heavy token ~0.195 of the mass
    assert set(sample_rows_op(rep, one, k, p, m, sweep).tolist()) == {5, 9, 20}
    k, p, m = _op_args(n, 64, m=torch.full((n,), 0.5))  # min_p drops token 50 (e^-2 < 0.5)
    assert set(sample_rows_op(rep, one, k, p, m, sweep).tolist()) == {5, 9, 20, 33, 40}
    k, p, m = _op_args(1, 64)
    top = torch.tensor([1.0], dtype=torch.float64)
    assert sample_rows_op(row, torch.ones(1), k, p, m, top).tolist() == [50]
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])
    many = 20000
    u = torch.rand(many, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    k, p, m = _op_args(many, 6)
    ids = sample_rows_op(probs.log().expand(many, -1).contiguous(), torch.ones(many), k, p, m, u)
    freq = torch.bincount(ids, minlength=6).double() / many
    assert torch.allclose(freq, probs[0].double(), atol=0.015)
    k, p, m = _op_args(1, 64)
    with pytest.raises(RuntimeError, match="temperature"):
        sample_rows_op(row, torch.zeros(1), k, p, m, top)
    with pytest.raises(RuntimeError, match="top_ks"):
        sample_rows_op(row, torch.ones(1), k.int(), p, m, top)


def test_sampler_gives_the_torch_paths_tokens_with_the_op(sample_rows_op, monkeypatch) -> None:
    """Seeded requests of every setting, batched with greedy rows: the same tokens whether the
    sampler draws through the op or through the torch path."""
    vocab = 49152
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, vocab, generator=gen) * 5
    params = [SamplingParams(temperature=0.8, seed=11 + i, top_p=[1.0, 0.9][i % 2],
                             top_k=[-1, 40, -1][i % 3], min_p=[0.0, 0.0, 0.0, 0.05][i % 4])
              for i in range(10)] + [SamplingParams(temperature=0.0)] * 2
    info = build(params, vocab)
    with_op = Sampler(seed=0).sample(logits, info).next_token_ids
    monkeypatch.setattr(
        sampler_mod, "sample_filtered",
        lambda x, t, k, p, m, u: pick_by_uniform(filter_logits(x, t, k, p, m), u))
    assert Sampler(seed=0).sample(logits, info).next_token_ids == with_op
    assert with_op[10:] == logits[10:].argmax(-1).tolist()


def test_sampler_never_emits_neg_inf_tokens() -> None:
    vocab = 1000
    logits = torch.full((256, vocab), NEG_INF)
    logits[:, 123] = 0.0
    logits[:, 456] = -50.0
    ids = sample([SamplingParams(temperature=2.0)] * 256, logits)
    assert set(ids) <= {123, 456}


# --------------------------------------------------------------------------- penalties


def reference_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    out = logits.clone()
    for i, p in enumerate(params):
        for t in set(prompts[i]) | set(outputs[i]):
            x = out[i, t].item()
            out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(outputs[i]).items():
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_exact() -> None:
    vocab = 12
    torch.manual_seed(3)
    logits = torch.randn(4, vocab) * 3
    logits[0, 2] = 0.0
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
        SamplingParams(),
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 7], [1, 2]]
    outputs = [[3, 8, 8], [5, 5, 9, 5], [7, 10, 10], [3, 4]]
    info = build(params, vocab, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, info)
    want = reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])
    # Frequency/presence ignore the prompt: token 4 is only in row 1's prompt.
    assert got[1, 4] == logits[1, 4]
    # Spot-check the formulas by hand.
    assert got[1, 5] == pytest.approx(logits[1, 5].item() - 0.5 * 3 - 0.25)
    x = logits[0, 8].item()
    assert got[0, 8].item() == pytest.approx(x / 1.5 if x > 0 else x * 1.5)
    # The input is never mutated.
    assert not torch.equal(got, logits)


def test_sparse_penalties_match_the_dense_formulas() -> None:
    """Penalties touch only the (row, token) pairs in the prompts and outputs: at a larger
    vocabulary, with repeats, rows without penalties between, out-of-range ids and a
    non-contiguous logits tensor, the result equals the dense formulas and leaves the input."""
    vocab = 1000
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(vocab, 6, generator=gen) * 3).t()  # non-contiguous [6, vocab]
    before = logits.clone()
    ids = lambda n: torch.randint(0, 60, (n,), generator=gen).tolist()  # noqa: E731  repeats
    prompts = [ids(40) for _ in range(6)]
    outputs = [ids(25) + [vocab + 5, -3] for _ in range(6)]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(presence_penalty=1.5, temperature=0.0),
        SamplingParams(repetition_penalty=2.0, presence_penalty=-0.3),
    ]
    info = build(params, vocab, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits, info)
    clean = [[t for t in o if 0 <= t < vocab] for o in outputs]
    want = reference_penalties(logits, params, prompts, clean)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1]) and torch.equal(logits, before)


def test_penalties_skip_when_unused_and_ignore_out_of_range() -> None:
    info = build([SamplingParams(), SamplingParams(temperature=0)], 10)
    assert info.repetition is None and info.output_penalty is None
    assert info.banned is None
    logits = torch.randn(2, 10)
    assert apply_penalties(logits, info) is logits
    info = build([SamplingParams(presence_penalty=1.0)], 10, prompts=[[99]], outputs=[[3, 99, -1]])
    assert info.output_penalty is not None
    idx, amount = info.output_penalty
    assert idx.tolist() == [3] and amount.tolist() == [1.0]  # one presence, on token 3 of row 0


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample([p], logits, prompts=[[0]]) == [1]
    assert sample([p], logits) == [0]


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    vocab = 8
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 0.0, 0.0, 1.0]])
    p = SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=(3,))
    info = build([p], vocab, outputs=[[1, 1]], eos=(2,))
    assert info.banned is not None
    penalized = apply_penalties(logits, info)
    assert penalized[0, 2] == NEG_INF and penalized[0, 3] == NEG_INF
    assert Sampler().sample(logits, info).next_token_ids == [4]
    # Once min_new_tokens is reached, EOS is allowed again.
    assert sample([p], logits, outputs=[[1, 1, 1]], eos=(2,)) == [2]
    # Sampled rows never emit banned ids either.
    n = 500
    flat = torch.zeros(n, vocab)
    ids = sample([SamplingParams(min_new_tokens=1, stop_token_ids=[5])] * n, flat, eos=(2, 6))
    assert not {2, 5, 6} & set(ids)


def test_logit_bias_normalized_and_round_trips() -> None:
    p = SamplingParams(logit_bias={"7": 5, 3: -100.0, " 12 ": 0.5})  # type: ignore[dict-item]
    assert p.logit_bias == {7: 5.0, 3: -100.0, 12: 0.5}
    p.validate()
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert pickle.loads(pickle.dumps(p)) == p
    from radixrt.core.validation import check_vocab_fields

    check_vocab_fields(p, 13)
    with pytest.raises(InvalidRequestError, match=r"token id 12 is outside.*\[0, 12\)") as ei:
        check_vocab_fields(p, 12)
    assert ei.value.field == "logit_bias"


def test_logit_bias_steers_greedy_and_sampled_rows() -> None:
    vocab = 10
    torch.manual_seed(9)
    logits = torch.randn(3, vocab)
    top = logits.argmax(-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    params = [SamplingParams(temperature=0, logit_bias={4: 100}),
              SamplingParams(temperature=0, logit_bias={top[1]: -100}),
              SamplingParams(temperature=0)]
    info = build(params, vocab)
    assert not info.is_fast_path and info.logit_bias is not None
    got = apply_penalties(logits, info)
    want = logits.clone()
    want[0, 4] += 100
    want[1, top[1]] -= 100
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert Sampler().sample(logits, info, greedy_ids=torch.tensor(top)).next_token_ids == [
        4, second[1], top[2]]  # the LM head's picks are not taken: the biases count
    # the bias adds to the penalties (after them); ids outside the vocabulary are dropped
    both = build([SamplingParams(frequency_penalty=1.0, logit_bias={2: 3, 99: 5})], vocab,
                 outputs=[[2, 2]])
    row = apply_penalties(logits[:1], both)
    assert row[0, 2].item() == pytest.approx(logits[0, 2].item() - 2.0 + 3.0)
    # a sampled row never picks a token biased by -100 when others are near
    n = 400
    flat = torch.zeros(n, vocab)
    ids = sample([SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})] * n, flat)
    assert not {0, 1} & set(ids) and len(set(ids)) > 4
    # logprobs stay the raw logits'
    lp = Sampler().sample(logits[:1], build([SamplingParams(temperature=0, logprobs=True,
                                                            logit_bias={4: 100})], vocab))
    assert lp.next_token_ids == [4]
    assert lp.logprobs[0] is not None
    assert lp.logprobs[0].token_logprobs[0] == pytest.approx(
        torch.log_softmax(logits[0], -1)[4].item(), abs=1e-6)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits_and_sorted_alternatives() -> None:
    vocab = 30
    torch.manual_seed(4)
    logits = torch.randn(4, vocab) * 2
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=True),
        SamplingParams(top_k=3, logprobs=True, top_logprobs=20, seed=9),
    ]
    info = build(params, vocab, prompts=[[1, 2]] * 4, outputs=[[3]] * 4)
    out = Sampler().sample(logits, info)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        lp = out.logprobs[i]
        assert lp is not None and len(lp.token_logprobs) == 1
        assert lp.token_logprobs[0] == pytest.approx(ref[i, out.next_token_ids[i]].item(), abs=1e-5)
        k = params[i].top_logprobs
        assert len(lp.top_ids) == 1 and len(lp.top_ids[0]) == k and len(lp.top_logprobs[0]) == k
        vals = lp.top_logprobs[0]
        assert vals == sorted(vals, reverse=True)
        if k:
            want_ids = ref[i].topk(k).indices.tolist()
            assert lp.top_ids[0] == want_ids
            for t, v in zip(lp.top_ids[0], vals, strict=True):
                assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
            assert all(math.isfinite(v) and v <= 0 for v in vals)


def _argmax_op_or_skip() -> None:
    from radixrt.attention import cpu_kernels

    if not cpu_kernels.load_cpu_kernels() or not hasattr(torch.ops.radixrt, "argmax_rows"):
        pytest.skip("radixrt's CPU kernel library is unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (2, 16), (4, 17), (5, 33), (5, 64),
                                    (5, 113), (6, 200), (64, 49152), (300, 1000)])
def test_row_argmax_is_torchs_argmax(dtype: torch.dtype, rows: int, n: int) -> None:
    """The C++ op gives torch's index: ties (the first maximum wins, in a vector lane, across
    lanes and in the scalar tail), whole -inf rows, +inf, NaN (the first NaN); enough rows and
    columns to run on several threads."""
    from radixrt.sampling.sampler import row_argmax

    _argmax_op_or_skip()
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=g).to(dtype)
    if n >= 4:
        x[0, n // 3] = x[0, n - 1] = x[0, n // 2] = 50.0  # ties in different lanes and the tail
        x[rows - 1, :] = float("-inf")
    if rows >= 3 and n >= 3:
        x[1, 2] = float("inf")
        x[2, n - 1] = float("nan")
        x[2, 1] = 1e30
    if rows >= 5:
        x[4, n - 1] = float("nan")
        x[4, 0] = float("nan")
    assert torch.equal(torch.ops.radixrt.argmax_rows(x), x.argmax(-1))
    assert torch.equal(row_argmax(x), x.argmax(-1))


def test_row_argmax_ties_across_vector_chains() -> None:
    """The op reads vectors of 16 in four interleaved chains: a maximum tied at the same lane
    of different chains, of different rounds, or in the leftover vectors and the scalar tail
    still gives its first position."""
    _argmax_op_or_skip()
    n = 16 * 4 * 3 + 16 * 2 + 5  # three rounds of four vectors, two vectors left, a tail of 5
    ties = [(40, 3 * 16 + 8), (3 * 16 + 8, 40), (5, 64 + 5), (200, 100), (100, 200),
            (16 * 13 + 1, n - 1), (n - 2, 16 * 12 + 3), (0, n - 1)]
    x = torch.zeros(len(ties), n)
    for r, (a, b) in enumerate(ties):
        x[r, a] = x[r, b] = 7.0
    want = torch.tensor([min(a, b) for a, b in ties])
    assert torch.equal(torch.ops.radixrt.argmax_rows(x), want)
    assert torch.equal(x.argmax(-1), want)


def test_row_argmax_op_rejects_bad_input() -> None:
    _argmax_op_or_skip()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.radixrt.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="2-D"):
        torch.ops.radixrt.argmax_rows(torch.zeros(3))
    with pytest.raises(RuntimeError, match="must not be empty"):
        torch.ops.radixrt.argmax_rows(torch.zeros(2, 0))


def test_seen_ids_follow_the_prompt_and_a_growing_output() -> None:
    """`SeenIds` holds exactly the distinct in-vocabulary ids of the prompt and the output so
    far, each once, as the output grows (repeats, out-of-range ids); a call's extra tokens (a
    draft row's drafts) are in that call's ids only; an output shorter than before is refused."""
    vocab = 50
    rng = torch.Generator().manual_seed(5)
    prompt = torch.randint(-3, vocab + 3, (40,), generator=rng).tolist()
    seen = SeenIds(prompt, vocab)
    output: list[int] = []

    def expect(*lists: list[int]) -> list[int]:
        return sorted({t for lst in lists for t in lst if 0 <= t < vocab})

    for step in range(30):
        output.extend(torch.randint(-2, vocab + 2, (step % 3,), generator=rng).tolist())
        got = seen.ids(output).tolist()
        assert len(got) == len(set(got)) and sorted(got) == expect(prompt, output), step
        drafts = [vocab - 1 - step % 7, 0, vocab + 5]
        with_drafts = seen.ids(output, drafts).tolist()
        assert len(with_drafts) == len(set(with_drafts))
        assert sorted(with_drafts) == expect(prompt, output, drafts)
        assert sorted(seen.ids(output).tolist()) == expect(prompt, output)  # drafts not kept
    with pytest.raises(ValueError, match="output shrank"):
        seen.ids(output[:-1] if output else [])


def test_kept_seen_ids_penalize_like_converting_the_prompt() -> None:
    """Repetition-penalty rows built from `SeenIds` (some rows kept, one converted, rows without
    the penalty between them) penalize every logit bitwise as building from the id lists."""
    vocab, batch = 64, 5
    rng = torch.Generator().manual_seed(8)
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(),
              SamplingParams(repetition_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=2.0), SamplingParams(presence_penalty=1.0)]
    prompts = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in (30, 5, 12, 1, 9)]
    outputs = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in (7, 3, 0, 20, 4)]
    logits = torch.randn(batch, vocab, generator=rng)
    plain = SamplingBatchInfo.build(params, prompts, outputs, vocab, "cpu")
    seen = [SeenIds(prompts[0], vocab).ids(outputs[0]), None,
            SeenIds(prompts[2], vocab).ids(outputs[2]), None, None]  # row 3 converted
    kept = SamplingBatchInfo.build(params, prompts, outputs, vocab, "cpu", seen_ids=seen)
    assert plain.repetition is not None and kept.repetition is not None
    pairs = dict(zip(plain.repetition[0].tolist(), plain.repetition[1].tolist(), strict=True))
    assert dict(zip(kept.repetition[0].tolist(), kept.repetition[1].tolist(),
                    strict=True)) == pairs
    assert len(kept.repetition[0].unique()) == len(kept.repetition[0])
    assert torch.equal(apply_penalties(logits, kept), apply_penalties(logits, plain))


def test_min_new_tokens_bans_are_the_dense_mask_pairs() -> None:
    """The (row, id) ban pairs of rows short of `min_new_tokens` (EOS ids and their own stop ids;
    repeats and ids outside the vocabulary included) penalize like the dense [B, V] mask they
    replace: -inf exactly there, every other logit untouched (fp32 and bf16)."""
    vocab = 40
    params = [SamplingParams(min_new_tokens=5, stop_token_ids=(7, 2, 99)), SamplingParams(),
              SamplingParams(min_new_tokens=2), SamplingParams(min_new_tokens=9,
                                                               stop_token_ids=(39,)),
              SamplingParams(min_new_tokens=1, stop_token_ids=(-1, 0))]
    outputs = [[1] * 3, [], [4], [1] * 9, []]  # row 3 has reached its minimum
    info = build(params, vocab, outputs=outputs, eos=(2, 3))
    assert info.banned is not None
    dense = torch.zeros(len(params), vocab, dtype=torch.bool)
    for row, ids in ((0, (2, 3, 7)), (2, (2, 3)), (4, (2, 3, 0))):
        dense[row, list(ids)] = True
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(2)).to(dtype)
        got = apply_penalties(logits, info)
        assert got.dtype == dtype
        assert torch.equal(got, logits.masked_fill(dense, float("-inf")))
