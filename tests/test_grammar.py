"""Grammar-constrained decoding: the llguidance backend, the cached asynchronous compiler, the
sampler's masks, and the scheduler's per-request grammar state (tiny random Llama with a
trained byte-level BPE tokenizer: a random model, so only the grammar makes outputs valid).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from radixrt.config import ServerArgs
from radixrt.core.errors import InvalidRequestError
from radixrt.core.messages import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, AbortReq, GenerateReq
from radixrt.core.sampling_params import SamplingParams
from radixrt.grammar import (
    GrammarBackend,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    LLGuidanceBackend,
    check_grammar,
    check_params,
)
from radixrt.model.runner import ModelRunner
from radixrt.model.tokenizer import load_tokenizer
from radixrt.sampling.batch_info import SamplingBatchInfo
from radixrt.sampling.sampler import Sampler
from radixrt.sampling.vocab_mask import apply_vocab_mask, unpack_bitmask
from radixrt.sched.scheduler import Scheduler
from tokenizer_proc.input_processor import to_params

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe) [0-9]{1,3}"
GBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def backend(tok: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])


def allowed(backend: GrammarBackend, m: GrammarMatcher) -> torch.Tensor:
    mask = backend.new_bitmask(1)
    m.fill_bitmask(mask, 0)
    return unpack_bitmask(mask, backend.vocab_size)[0]


def random_walk(backend: GrammarBackend, m: GrammarMatcher, eos: int, gen: torch.Generator,
                limit: int = 200) -> tuple[list[int], bool]:
    """Sample uniformly among allowed tokens until the grammar terminates or EOS is drawn;
    (tokens without EOS, finished)."""
    out: list[int] = []
    for _ in range(limit):
        ok = allowed(backend, m)
        assert ok.any(), "a live matcher always allows some token"
        choices = ok.nonzero().view(-1)
        t = int(choices[torch.randint(len(choices), (1,), generator=gen)])
        if t == eos:
            return out, True
        assert m.accept_token(t)
        out.append(t)
        if m.is_terminated():
            return out, True
    return out, False


# -- backend -------------------------------------------------------------------------------------
def test_json_mask_follows_a_valid_instance_and_ends(backend: LLGuidanceBackend, tok: Any) -> None:
    compiled = backend.compile("json_schema", json.dumps(PERSON))
    m = backend.matcher(compiled)
    text = json.dumps({"name": "fox", "age": 7, "pet": "dog", "tags": [True]},
                      separators=(",", ":"))
    ids = tok.encode(text, add_special_tokens=False)
    first = allowed(backend, m)
    assert first[ids[0]] and not first[tok.encode("x", add_special_tokens=False)[0]]
    assert not first[tok.eos_token_id]  # nothing generated yet: the grammar may not end
    for t in ids:
        assert allowed(backend, m)[t], tok.decode([t])
        assert not m.is_terminated()
        assert m.accept_token(t)
    assert m.is_terminated()
    ok = allowed(backend, m)
    assert ok.nonzero().view(-1).tolist() == [tok.eos_token_id]
    # A fresh matcher from the same compiled grammar starts over (copies share nothing).
    assert not backend.matcher(compiled).accept_token(tok.encode("x", add_special_tokens=False)[0])


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_produce_valid_outputs(backend: LLGuidanceBackend, tok: Any,
                                            seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    eos = tok.eos_token_id
    cases = [("json_schema", json.dumps(PERSON)), ("regex", REGEX), ("ebnf", GBNF),
             ("ebnf", 'start: "<" /[0-9]{2}/ ">"')]
    for kind, src in cases:
        ids, done = random_walk(backend, backend.matcher(backend.compile(kind, src)), eos, gen)
        assert done, (kind, tok.decode(ids))
        text = tok.decode(ids)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif src is GBNF:
            assert re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)", text), text
        else:
            assert re.fullmatch(r"<[0-9]{2}>", text), text


@pytest.mark.parametrize("kind,src,needle", [
    ("json_schema", '{"type": "frobnicate"}', "frobnicate"),
    ("json_schema", '{"not": {"type": "string"}}', "not"),  # unimplemented: an error, not ignored
    ("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}', "nope"),
    ("regex", "(unclosed", "unclosed"),
    ("ebnf", "root ::= missing_rule", "missing_rule"),
])
def test_bad_grammars_name_their_field(backend: LLGuidanceBackend, kind: str, src: str,
                                       needle: str) -> None:
    with pytest.raises(GrammarError) as e:
        check_grammar(kind, src)
    assert e.value.field == kind and needle in str(e.value)
    with pytest.raises(GrammarError) as e2:
        backend.compile(kind, src)
    assert e2.value.field == kind


def test_sampling_params_grammar_fields() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(regex="a", ebnf='root ::= "a"').validate()
    assert e.value.field == "ebnf"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(json_schema="{not json").validate()
    assert e.value.field == "json_schema"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(json_schema="[1, 2]").validate()
    assert e.value.field == "json_schema"
    sp = SamplingParams(json_schema='{"type": "object"}')
    sp.validate()
    assert sp.grammar_key == ("json_schema", '{"type": "object"}')
    assert SamplingParams().grammar_key is None
    check_params(sp)
    with pytest.raises(GrammarError):
        check_params(SamplingParams(regex="[z-a]"))
    # The Engine's entry point checks that the grammar compiles, whichever form it is given in.
    assert to_params({"regex": "a+"}).regex == "a+"
    for bad in ({"ebnf": "root ::= nowhere"}, SamplingParams(json_schema='{"type": "nope"}')):
        with pytest.raises(GrammarError):
            to_params(bad)


# -- compiler ------------------------------------------------------------------------------------
class CountingBackend(GrammarBackend):
    """Wraps a real backend; counts compiles and can hold them until `release` is set."""

    def __init__(self, inner: GrammarBackend, gate: threading.Event | None = None):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.gate = gate
        self.compiled: list[tuple[str, str]] = []
        self.threads: set[str] = set()

    def compile(self, kind: str, source: str) -> object:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(60)
        self.compiled.append((kind, source))
        return self.inner.compile(kind, source)

    def matcher(self, compiled: object) -> GrammarMatcher:
        return self.inner.matcher(compiled)


def test_compiler_caches_by_key_off_thread(backend: LLGuidanceBackend) -> None:
    gate = threading.Event()
    counting = CountingBackend(backend, gate)
    built = []

    def make() -> GrammarBackend:
        built.append(threading.current_thread().name)
        return counting

    comp = GrammarCompiler(make, max_cached=2)
    try:
        key = ("regex", "a+b")
        f1, f2 = comp.submit(key), comp.submit(key)
        assert f1 is f2 and not f1.done()  # compiling, not blocking the caller
        gate.set()
        assert f1.result(30) is not None
        assert counting.compiled == [key] and comp.compiles == 1
        assert built and built[0] != threading.current_thread().name
        assert all(t.startswith("grammar") for t in counting.threads)
        bad = comp.submit(("regex", "(x"))
        with pytest.raises(GrammarError):
            bad.result(30)
        assert comp.submit(("regex", "(x")) is bad  # failures are cached too
        comp.submit(("regex", "c")).result(30)  # evicts the oldest (max_cached=2)
        assert comp.submit(key) is not f1 and comp.compiles == 4
        assert len(built) == 1
    finally:
        comp.shutdown()


# -- sampler masks -------------------------------------------------------------------------------
def test_unpack_and_apply_mask_against_naive() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 77, 3
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, 3), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    got = unpack_bitmask(bitmask, vocab)
    for r in range(rows):
        for t in range(vocab):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            assert bool(got[r, t]) == bool((word >> (t % 32)) & 1)
    logits = torch.randn(5, vocab, generator=gen)
    idx = torch.tensor([4, 0, 2])
    out = apply_vocab_mask(logits, idx, bitmask)
    for j, r in enumerate(idx.tolist()):
        assert torch.equal(out[r][got[j]], logits[r][got[j]])
        assert torch.isneginf(out[r][~got[j]]).all()
    for r in (1, 3):
        assert torch.equal(out[r], logits[r])
    every = apply_vocab_mask(logits[:3], None, bitmask)  # rows None: row i <- bitmask i
    assert torch.equal(every, torch.where(got, logits[:3], float("-inf")))


def test_sampler_masks_only_constrained_rows_and_grammar_beats_bans() -> None:
    vocab, eos = 64, 5
    logits = torch.zeros(3, vocab)
    logits[:, 9] = 10.0  # the unconstrained favourite
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # row 0: only token 3
    bitmask[1, 0] = 1 << eos  # row 2: only EOS, which min_new_tokens bans
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=0, min_new_tokens=4, max_new_tokens=8)]
    info = SamplingBatchInfo.build(params, [[1]] * 3, [[]] * 3, vocab, "cpu", (eos,),
                                   ([0, 2], bitmask))
    assert not info.is_fast_path
    ids = Sampler().sample(logits, info).next_token_ids
    assert ids == [3, 9, eos]


# -- scheduler -----------------------------------------------------------------------------------
@pytest.fixture
def make_sched(tiny_llama_dir: Path) -> Callable[..., Scheduler]:
    def make(grammar_backend: Callable[[], GrammarBackend] | None = None,
             **kw: object) -> Scheduler:
        kw.setdefault("max_total_tokens", 1024)
        args = ServerArgs(model_path=str(tiny_llama_dir), num_threads=1, dtype="float32",
                          **kw)  # type: ignore[arg-type]
        return Scheduler(args, ModelRunner(args), grammar_backend)

    return make


def drive(sched: Scheduler, limit: int = 3000) -> dict[str, Any]:
    """Step until nothing is live; {rid: (tokens, final out)}; invariants after every step."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, Any] = {}
    for _ in range(limit):
        if not (sched.has_work or sched.grammar_wait):
            break
        if not sched.has_work:
            time.sleep(0.002)
        out = sched.step()
        sched.check_invariants()
        for o in out.outs if out else []:
            tokens.setdefault(o.rid, []).extend(o.new_ids)
            if o.finish_reason is not None:
                finals[o.rid] = o
    else:
        raise AssertionError("scheduler does not converge")
    return {rid: (tokens.get(rid, []), finals[rid]) for rid in finals}


def clean(sched: Scheduler) -> None:
    sched.check_invariants()
    assert not sched.live_reqs() and sched.cache.protected_size() == 0
    assert sched.req_pool.available_size() == sched.req_pool.size
    assert sched.kv_pool.available_size() + sched.cache.evictable_size() == sched.kv_pool.size


SHARED = [(7 * i) % 380 + 3 for i in range(48)]  # a 48-token prompt head several requests share


def constrained(kind: str = "json_schema", src: str | None = None, **kw: Any) -> SamplingParams:
    src = json.dumps(PERSON) if src is None else src
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 96), temperature=kw.pop(
        "temperature", 0.0), **{kind: src}, **kw)


def check_text(tok: Any, kind: str, ids: list[int]) -> str:
    text = tok.decode(ids, skip_special_tokens=True)
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    else:
        assert re.fullmatch(REGEX, text), text
    return text


def test_constrained_and_free_requests_share_batches_and_cache(
        make_sched: Callable[..., Scheduler], tok: Any) -> None:
    free = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = make_sched()
    alone.handle(GenerateReq("f", [*SHARED, 11, 12], free))
    ref = drive(alone)["f"][0]

    sched = make_sched()
    sched.handle(GenerateReq("warm", [*SHARED, 1], constrained()))
    drive(sched)  # the shared head is now in the radix tree, and the grammar compiled
    jobs = {"j0": constrained(), "j1": constrained(temperature=0.9, seed=3),
            "r0": constrained("regex", REGEX), "r1": constrained("regex", REGEX, seed=5,
                                                                 temperature=1.0),
            "f": free}
    for i, (rid, sp) in enumerate(jobs.items()):
        sched.handle(GenerateReq(rid, [*SHARED, 11, 12] if rid == "f" else [*SHARED, 20 + i],
                                 sp))
    res = drive(sched)
    assert res["f"][0] == ref  # unconstrained output unchanged by its constrained neighbours
    for rid in ("j0", "j1", "r0", "r1"):
        ids, fin = res[rid]
        assert fin.finish_reason == FINISH_STOP, (rid, tok.decode(ids))
        check_text(tok, "json_schema" if rid[0] == "j" else "regex", ids)
    for rid in jobs:  # everyone hit the shared head cached by the warm-up request
        assert res[rid][1].cached_tokens >= len(SHARED), rid
    assert sched.grammars.compiles == 2  # one per distinct grammar, the warm-up's reused
    # llguidance forced tokens (the schema's `{"name":"` at least) and they were fast-forwarded
    assert sched.stats()["grammar_forced_tokens_total"] >= 3
    clean(sched)


def test_grammar_end_ignore_eos_length_and_stop_ids(make_sched: Callable[..., Scheduler],
                                                    tok: Any) -> None:
    sched = make_sched()
    sched.handle(GenerateReq("cut", [*SHARED, 1], constrained(max_new_tokens=3)))
    sched.handle(GenerateReq("ign", [*SHARED, 2], constrained("regex", REGEX, ignore_eos=True)))
    res = drive(sched)
    ids, fin = res["cut"]
    assert fin.finish_reason == FINISH_LENGTH and len(ids) == 3
    assert json.dumps({"name": ""})[:1] == tok.decode(ids)[:1]  # a JSON prefix, cut
    ids, fin = res["ign"]
    assert fin.finish_reason == FINISH_STOP
    check_text(tok, "regex", [t for t in ids if t != tok.eos_token_id])
    clean(sched)


def test_compile_does_not_block_other_requests(make_sched: Callable[..., Scheduler],
                                               backend: LLGuidanceBackend, tok: Any) -> None:
    gate = threading.Event()
    sched = make_sched(grammar_backend=lambda: CountingBackend(backend, gate))
    sched.handle(GenerateReq("g", [*SHARED, 1], constrained()))
    sched.handle(GenerateReq("f", [*SHARED, 2], SamplingParams(max_new_tokens=6,
                                                                temperature=0, ignore_eos=True)))
    finished: dict[str, Any] = {}
    for _ in range(50):
        out = sched.step()
        for o in out.outs if out else []:
            if o.finish_reason:
                finished[o.rid] = o
        if "f" in finished:
            break
    assert "f" in finished and finished["f"].finish_reason == FINISH_LENGTH
    assert [r.rid for r in sched.grammar_wait] == ["g"] and sched.stats()["num_waiting"] == 1
    gate.set()
    res = drive(sched)
    assert res["g"][1].finish_reason == FINISH_STOP
    check_text(tok, "json_schema", res["g"][0])
    clean(sched)


class BrokenBackend(CountingBackend):
    def compile(self, kind: str, source: str) -> object:
        raise RuntimeError("backend exploded")


def test_failed_compile_and_aborts_free_everything(make_sched: Callable[..., Scheduler],
                                                   backend: LLGuidanceBackend) -> None:
    sched = make_sched(grammar_backend=lambda: BrokenBackend(backend))
    sched.handle(GenerateReq("bad", [*SHARED, 1], constrained("regex", "x+")))
    sched.handle(GenerateReq("bad2", [*SHARED, 3], constrained("regex", "x+")))  # same future
    sched.handle(GenerateReq("ok", [*SHARED, 2], SamplingParams(max_new_tokens=3)))
    res = drive(sched)
    for rid in ("bad", "bad2"):  # both: retiring the first must not skip the next in line
        assert res[rid][1].finish_reason == FINISH_ABORT
        assert "backend exploded" in res[rid][1].error and res[rid][0] == []
    assert res["ok"][1].finish_reason in (FINISH_LENGTH, FINISH_STOP)
    assert sched.stats()["num_finished_requests_total"] == 3
    clean(sched)

    # Abort while compiling and while decoding: the request leaves, its matcher is dropped.
    gate = threading.Event()
    sched = make_sched(grammar_backend=lambda: CountingBackend(backend, gate))
    sched.handle(GenerateReq("compiling", [*SHARED, 1], constrained("regex", "a[0-9]+")))
    sched.step()
    req = sched.grammar_wait[0]
    sched.handle(AbortReq("compiling"))
    assert not sched.grammar_wait and req.grammar_future is None
    gate.set()
    sched.handle(GenerateReq("decoding", [*SHARED, 2], constrained(max_new_tokens=200)))
    finals = {}
    while not sched.running:
        time.sleep(0.002)
        out = sched.step()
        finals.update({o.rid: o for o in (out.outs if out else []) if o.finish_reason})
    req = sched.running[0]
    assert req.grammar is not None
    sched.handle(AbortReq("decoding"))
    assert req.grammar is None
    finals.update({rid: fin for rid, (_, fin) in drive(sched).items()})
    assert finals["compiling"].finish_reason == FINISH_ABORT
    assert finals["decoding"].finish_reason == FINISH_ABORT
    clean(sched)


def test_retraction_keeps_the_matcher_in_step(make_sched: Callable[..., Scheduler],
                                              tok: Any) -> None:
    """Under a pool so small that requests are retracted mid-output, the matchers stay in
    step with output_ids: same (greedy) outputs as a roomy run, all valid."""
    jobs = {f"r{i}": [*SHARED[: 10 + i], 30 + i] for i in range(5)}

    def run(**kw: Any) -> tuple[dict[str, Any], Scheduler]:
        sched = make_sched(**kw)
        for rid, ids in jobs.items():
            sched.handle(GenerateReq(rid, ids, constrained()))
        return drive(sched), sched

    ref, _ = run()
    res, sched = run(max_total_tokens=96, init_new_token_ratio=0.1, min_new_token_ratio=0.05)
    assert sched.counters.retractions > 0
    for rid in jobs:
        assert res[rid][0] == ref[rid][0]
        assert res[rid][1].finish_reason == FINISH_STOP
        check_text(tok, "json_schema", res[rid][0])
    clean(sched)


# -- fast-forward: tokens the grammar forces ------------------------------------------------------
class SegmentMatcher(GrammarMatcher):
    """A fake grammar of segments: a list of token ids is forced (only the next one allowed,
    and `forced_tokens` returns the rest of the list), an int n allows any n tokens; after the
    last segment only EOS (the request ends)."""

    def __init__(self, segments: list[list[int] | int], vocab: int, eos: int):
        self.seq: list[int | None] = []  # None: free position
        for seg in segments:
            self.seq.extend([None] * seg if isinstance(seg, int) else seg)
        self.pos, self.vocab, self.eos = 0, vocab, eos

    def accept_token(self, token: int) -> bool:
        if self.pos >= len(self.seq):
            return token == self.eos
        want = self.seq[self.pos]
        self.pos += 1
        return want is None or token == want

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        if self.pos >= len(self.seq):
            allowed = [self.eos]
        elif self.seq[self.pos] is None:
            allowed = [t for t in range(self.vocab) if t != self.eos]
        else:
            allowed = [self.seq[self.pos]]
        for t in allowed:
            word = int(bitmask[row, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def is_terminated(self) -> bool:
        return False  # ends on EOS

    def forced_tokens(self) -> list[int]:
        out = []
        for t in self.seq[self.pos:]:
            if t is None:
                break
            out.append(t)
        return out


class SegmentBackend(GrammarBackend):
    def __init__(self, segments: list[list[int] | int], vocab: int, eos: int):
        self.segments, self.vocab_size, self.eos = segments, vocab, eos

    def compile(self, kind: str, source: str) -> object:
        return self.segments

    def matcher(self, compiled: object) -> GrammarMatcher:
        return SegmentMatcher(compiled, self.vocab_size, self.eos)  # type: ignore[arg-type]


@pytest.mark.parametrize("mid", [[40, 41, 42, 43, 44, 45, 46], [40, 41]])
def test_forced_tokens_run_in_one_extend_with_the_same_output(
        make_sched: Callable[..., Scheduler], tok: Any, mid: list[int]) -> None:
    """A grammar forcing 9 tokens at its start and 7 (or 2) in the middle: with fast-forward
    they are appended at once and computed in one extend each (beside a decoding free
    request, and a constrained twin that asks for logprobs, which is not fast-forwarded): the
    same greedy tokens as sampling each under its mask (fp32), the request done in fewer
    steps, counted, every pool clean. A run in the middle shorter than the step's 3 rows is
    sampled as usual; `disable_grammar_fast_forward` forces none."""
    eos = tok.eos_token_id
    segments: list[list[int] | int] = [[11, 12, 13, 14, 15, 16, 17, 18, 19], 5, mid, 6]
    n_mid = len(mid)
    free = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    results = {}
    for off in (False, True):
        sched = make_sched(grammar_backend=lambda: SegmentBackend(segments, 400, eos),
                           disable_grammar_fast_forward=off)
        sched.handle(GenerateReq("f", [*SHARED, 5], free))
        tokens: dict[str, list[int]] = {}
        for _ in range(3):  # the free request decodes before the constrained ones arrive
            out = sched.step()
            for o in out.outs if out else []:
                tokens.setdefault(o.rid, []).extend(o.new_ids)
        sched.handle(GenerateReq("g", [*SHARED, 6], constrained("regex", "seg")))
        done_at: dict[str, int] = {}
        for step in range(200):
            if step == 2:  # the twin arrives while "g" decodes
                sched.handle(GenerateReq("lp", [*SHARED, 6], constrained("regex", "seg",
                                                                         logprobs=True)))
            if not (sched.has_work or sched.grammar_wait):
                break
            out = sched.step()
            sched.check_invariants()
            for o in out.outs if out else []:
                tokens.setdefault(o.rid, []).extend(o.new_ids)
                if o.finish_reason is not None:
                    assert o.finish_reason == (FINISH_LENGTH if o.rid == "f" else FINISH_STOP)
                    done_at[o.rid] = step
        ids = tokens["g"]
        assert ids[:9] == segments[0] and ids[14:14 + n_mid] == mid and ids[-1] == eos
        assert len(ids) == 9 + 5 + n_mid + 6 + 1 and tokens["lp"] == ids
        stats = sched.stats()
        assert stats["generated_tokens_total"] == sum(len(t) for t in tokens.values())
        results[off] = (tokens, done_at["g"], stats["grammar_forced_tokens_total"])
        clean(sched)
    (on, on_steps, on_forced), (off, off_steps, off_forced) = results[False], results[True]
    assert on == off  # fast-forward changes no token (the forced tokens' KV alike)
    fast_mid = n_mid if n_mid >= 3 else 0  # 3 rows in the step: 2 forced are sampled
    assert on_forced == 9 + fast_mid and off_forced == 0  # only "g": "lp" reports logprobs
    assert on_steps <= off_steps - 8 - max(0, fast_mid - 1)  # each run in one extend


def test_fast_forward_asks_the_grammar_only_where_a_run_could_pass(
        make_sched: Callable[..., Scheduler], tok: Any) -> None:
    """`OutputProcessor.fast_forward`: a rule above MAX_MID_RUN tokens does not call the
    matcher at all (steps of many rows pay nothing); within it, a run shorter than the rule is
    left to sampling, a long enough one is appended and accepted by the matcher."""
    from radixrt.sched.output_processor import MAX_MID_RUN
    from radixrt.sched.req import Req

    calls = []

    class Counting(SegmentMatcher):
        def forced_tokens(self) -> list[int]:
            calls.append(self.pos)
            return super().forced_tokens()

    sched = make_sched()
    req = Req("x", [*SHARED, 1], constrained("regex", "seg"))
    req.grammar = Counting([[5, 6, 7, 8], 3], 400, tok.eos_token_id)
    out = sched.outputs
    assert out.fast_forward(req, MAX_MID_RUN + 1) == 0 and calls == []
    assert out.fast_forward(req, 5) == 0 and calls == [0] and req.output_ids == []
    assert out.fast_forward(req, 4) == 4 and req.output_ids == [5, 6, 7, 8]
    assert req.grammar.pos == 4 and out.forced_tokens == 4 and req.pending() == 4 + len(
        req.origin_input_ids)


def test_forced_runs_survive_retraction(make_sched: Callable[..., Scheduler], tok: Any) -> None:
    """Fast-forwarded requests under a pool so small that they are retracted (some while
    holding forced tokens without KV): the same greedy tokens as a roomy run with
    fast-forward off, and every pool clean after."""
    eos = tok.eos_token_id
    segments: list[list[int] | int] = [[11, 12, 13, 14, 15, 16], 4, [40, 41, 42, 43, 44, 45,
                                                                    46, 47], 5, [60, 61, 62], 3]
    jobs = {f"r{i}": [*SHARED[: 10 + i], 30 + i] for i in range(4)}
    pending_seen = []

    def run(**kw: Any) -> tuple[dict[str, Any], Scheduler]:
        sched = make_sched(grammar_backend=lambda: SegmentBackend(segments, 400, eos), **kw)
        for rid, ids in jobs.items():
            sched.handle(GenerateReq(rid, ids, constrained("regex", "seg")))
        retract = sched._retract

        def spy(need: int) -> None:
            pending_seen.extend(r.pending() for r in sched.running)
            retract(need)

        sched._retract = spy  # type: ignore[method-assign]
        return drive(sched), sched

    ref, _ = run(disable_grammar_fast_forward=True)
    res, sched = run(max_total_tokens=80, init_new_token_ratio=0.1, min_new_token_ratio=0.05)
    assert sched.counters.retractions > 0 and sched.outputs.forced_tokens > 0
    for rid in jobs:
        assert res[rid][0] == ref[rid][0], rid
        assert res[rid][1].finish_reason == FINISH_STOP
    clean(sched)
    assert any(p > 1 for p in pending_seen)  # retracted while holding forced tokens
