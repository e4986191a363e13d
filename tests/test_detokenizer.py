"""Detokenizer: incremental decoding == full decode, stop strings, manager rules, process loop.

Tokenizers are built offline: a byte-level BPE trained with `tokenizers`, a SentencePiece BPE
with byte fallback (loaded through transformers' LlamaTokenizer), and the default model's real
tokenizer when `radixrt.model` can provide it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detok_proc import detokenizer as detok_mod
from detok_proc.detokenizer import (
    DetokenizerManager,
    IncrementalDecoder,
    StopMatcher,
    TokenizerTraits,
    run_detokenizer,
)
from radixrt.core.ipc import IpcPaths, pull_socket, push_socket, send
from radixrt.core.messages import (
    AbortReq,
    ReadyMsg,
    ReqTokenOut,
    TextBatchOut,
    TokenBatchOut,
    TokenLogprobs,
    Usage,
)

LINES = [
    "Hello world, this is a test of the tokenizer.",
    "Emoji: 😀 🎉 👍🏽 🇺🇸 and more 🚀🚀 👨‍👩‍👧",
    "CJK: 你好世界，日本語のテキスト、한국어 문장",
    "Accents: café naïve résumé Ångström São Paulo",
    "Long words: antidisestablishmentarianism supercalifragilisticexpialidocious",
    "Numbers 1234567890 and punctuation !?;:'\" () [] {}",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "don't won't it's they're we've I'm . , ! ?",
]
FRAGMENTS = [
    *LINES,
    "😀",
    "🎉🎉",
    "你好",
    "日本語",
    "é",
    "Ångström",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    " ",
    "  ",
    "\n",
    "a",
    " the",
    ".",
    "STOP",
    "<|end|>",
]

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


# --------------------------------------------------------------------------- tokenizers


def _train_bpe() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<pad>"],
        show_progress=False,
    )
    tok.train_from_iterator(LINES * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _train_sentencepiece(directory: Path) -> Any:
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES * 3),
        model_writer=buf,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=0.98,
        minloglevel=2,
    )
    (directory / "tokenizer.model").write_bytes(buf.getvalue())
    tok = LlamaTokenizer.from_pretrained(str(directory))
    assert len(tok) >= 256, "byte-fallback vocabulary did not load"
    return tok


@pytest.fixture(scope="module")
def bpe_tok() -> Any:
    return _train_bpe()


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _train_sentencepiece(tmp_path_factory.mktemp("sp_tok"))


@pytest.fixture(scope="module")
def real_tok() -> Any:
    try:
        from radixrt.model.loader import default_model_path
        from radixrt.model.tokenizer import load_tokenizer
    except ImportError as e:
        pytest.skip(f"radixrt.model tokenizer/loader not available yet: {e}")
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")
    return load_tokenizer(path)


@pytest.fixture(scope="module", params=["bpe", "sp", "real"])
def tok(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_tok")


# --------------------------------------------------------------------------- helpers


def _split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    chunks, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        chunks.append(ids[i : i + n])
        i, k = i + n, k + 1
    return chunks


def _stream(tok: Any, chunks: list[list[int]], skip: bool) -> tuple[str, str]:
    """(text streamed before flush, full text including flush)."""
    dec = IncrementalDecoder(tok, skip)
    streamed = "".join(dec.step(c) for c in chunks)
    return streamed, streamed + dec.flush()


@st.composite
def token_sequences(draw: st.DrawFn, tok: Any) -> list[int]:
    """Encoded text made of tricky fragments, random ids, or a mix, with special ids sprinkled."""
    specials = sorted(set(tok.all_special_ids))
    kind = draw(st.sampled_from(["text", "random", "mixed"]))
    ids: list[int] = []
    if kind in ("text", "mixed"):
        text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6)))
        ids += tok.encode(text, add_special_tokens=False)
    if kind in ("random", "mixed"):
        ids += draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=30))
    for _ in range(draw(st.integers(0, 2))):
        pos = draw(st.integers(0, len(ids)))
        ids.insert(pos, draw(st.sampled_from(specials)))
    return ids


# --------------------------------------------------------------------------- IncrementalDecoder


@SETTINGS
@given(data=st.data())
def test_incremental_equals_full_decode(tok: Any, data: st.DataObject) -> None:
    ids = data.draw(token_sequences(tok))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
    skip = data.draw(st.booleans())
    want = tok.decode(ids, skip_special_tokens=skip)
    streamed, full = _stream(tok, _split(ids, sizes), skip)
    assert want.startswith(streamed), "streamed text is not final"
    assert full == want


@pytest.mark.parametrize("skip", [True, False])
def test_every_text_one_token_at_a_time(tok: Any, skip: bool) -> None:
    for text in FRAGMENTS:
        ids = tok.encode(text, add_special_tokens=False)
        streamed, full = _stream(tok, [[i] for i in ids], skip)
        want = tok.decode(ids, skip_special_tokens=skip)
        assert full == want and want.startswith(streamed), text


def test_window_stays_small_and_text_streams(tok: Any) -> None:
    """Not O(n^2): the decoded window stays bounded over a long generation, and almost all text
    is emitted before flush."""
    ids = tok.encode(" ".join(LINES * 12), add_special_tokens=False)
    assert len(ids) > 1000
    dec = IncrementalDecoder(tok, True)
    parts, max_window = [], 0
    for i in ids:
        parts.append(dec.step([i]))
        max_window = max(max_window, dec.window)
    streamed = "".join(parts)
    want = tok.decode(ids, skip_special_tokens=True)
    assert streamed + dec.flush() == want
    assert max_window <= 16
    assert len(want) - len(streamed) <= 8


def test_multibyte_held_until_complete(bpe_tok: Any, sp_tok: Any) -> None:
    """No U+FFFD leaks out of a split emoji; it appears whole once the next token arrives (a
    run of byte-fallback tokens is only known complete when a non-byte token follows)."""
    for tok in (bpe_tok, sp_tok):
        ids = tok.encode("a😀b", add_special_tokens=False)
        dec = IncrementalDecoder(tok, True)
        out = [dec.step([i]) for i in ids]
        assert "".join(out) == "a😀b" and dec.flush() == ""
        assert all("\ufffd" not in o for o in out)
        assert "😀" in "".join(out[:-1]) + out[-1][:1]


def test_sentencepiece_leading_spaces(sp_tok: Any) -> None:
    ids = sp_tok.encode("Hello world this is", add_special_tokens=False)
    dec = IncrementalDecoder(sp_tok, True)
    out = [dec.step([i]) for i in ids]
    assert "".join(out) == "Hello world this is"
    assert dec.flush() == ""


def test_byte_fallback_run_can_change_earlier_text(sp_tok: Any) -> None:
    """A run of byte tokens decodes as one UTF-8 group: "A" alone, but "A" + <0xE2> is two
    U+FFFD. The decoder must not emit "A" while the run is open."""
    t = sp_tok.convert_tokens_to_ids
    a, e2, x82, xac = t("<0x41>"), t("<0xE2>"), t("<0x82>"), t("<0xAC>")
    assert sp_tok.decode([a, e2]) == "\ufffd\ufffd"
    dec = IncrementalDecoder(sp_tok, True)
    assert dec.step([a]) == ""
    assert dec.step([e2]) == ""
    assert dec.flush() == "\ufffd\ufffd"
    dec = IncrementalDecoder(sp_tok, True)
    assert "".join(dec.step([i]) for i in (a, e2, x82, xac)) == ""  # run still open
    assert dec.flush() == "A€"
    # A skipped special token does not close the run either.
    dec = IncrementalDecoder(sp_tok, True)
    got = dec.step([a]) + dec.step([sp_tok.eos_token_id]) + dec.step([e2]) + dec.flush()
    assert got == sp_tok.decode([a, sp_tok.eos_token_id, e2], skip_special_tokens=True)


def test_skipped_special_at_window_start(sp_tok: Any) -> None:
    """With <s> skipped, a window starting at <s> would strip the next token's space."""
    word = sp_tok.convert_tokens_to_ids("▁wor")
    ids = [word, sp_tok.bos_token_id, word, sp_tok.bos_token_id, sp_tok.bos_token_id, word]
    for skip in (True, False):
        _, full = _stream(sp_tok, [[i] for i in ids], skip)
        assert full == sp_tok.decode(ids, skip_special_tokens=skip)


def test_clean_up_tokenization_spaces() -> None:
    """A WordPiece tokenizer with clean_up_tokenization_spaces: " ." becomes "." only once the
    "." arrives, so a trailing space must be held back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    w = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    w.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    w.decoder = decoders.WordPiece()
    w.train_from_iterator(
        LINES * 3,
        trainers.WordPieceTrainer(
            vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=w, clean_up_tokenization_spaces=True, unk_token="[UNK]"
    )
    assert TokenizerTraits.of(tok).cleanup
    for text in ["don't do it , ok . really ! yes ?", "we 've they 're I 'm", *LINES]:
        ids = tok.encode(text, add_special_tokens=False)
        streamed, full = _stream(tok, [[i] for i in ids], True)
        want = tok.decode(ids, skip_special_tokens=True)
        assert full == want and want.startswith(streamed), text


# --------------------------------------------------------------------------- StopMatcher


def _run_matcher(stops: tuple[str, ...], deltas: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out, hit = [], False
    for d in deltas:
        text, hit = m.feed(d)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return out, hit


def _reference(stops: tuple[str, ...], text: str) -> tuple[str, bool]:
    """Cut at the stop occurrence that is complete first (longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


def test_stop_split_across_many_deltas() -> None:
    out, hit = _run_matcher(("<|end|>",), ["Hello", " <", "|", "en", "d", "|", ">", " tail"])
    assert hit and "".join(out) == "Hello "
    assert out[:2] == ["Hello", " "]  # "<" held back, not emitted


def test_stop_multiple_and_first_completed_wins() -> None:
    out, hit = _run_matcher(("world", "lo w"), ["Hello world"])
    assert hit and "".join(out) == "Hel"
    # Generation would have stopped at "ba" (stop "a"), before "baa" could complete; the answer
    # must not depend on how the text was split into deltas.
    for deltas in (["baa"], ["b", "a", "a"]):
        assert _run_matcher(("a", "baa"), deltas) == (
            ["b"] if len(deltas) == 1 else ["", "b"],
            True,
        )
    out, hit = _run_matcher(("xyz", "END"), ["abc E", "ND xyz"])
    assert hit and "".join(out) == "abc "


def test_stop_at_very_start() -> None:
    assert _run_matcher(("STOP",), ["STOP and more"]) == ([""], True)
    assert _run_matcher(("STOP",), ["S", "T", "O", "P"]) == (["", "", "", ""], True)


def test_stop_overlapping_prefixes() -> None:
    out, hit = _run_matcher(("ab", "abc"), ["xa", "bc"])
    assert hit and "".join(out) == "x"
    out, hit = _run_matcher(("abc",), ["xa", "b", "d"])
    assert not hit and out == ["x", "", "abd", ""]
    out, hit = _run_matcher(("aab",), ["a", "a", "a", "b"])
    assert hit and "".join(out) == "a"


def test_stop_no_hit_flushes_held_text() -> None:
    out, hit = _run_matcher(("STOP",), ["one ST", "O"])
    assert not hit and out == ["one ", "", "STO"]
    m = StopMatcher(())
    assert m.feed("anything") == ("anything", False) and m.flush() == ""


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
    text=st.text("abcd", max_size=30),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
def test_stop_matches_reference(stops: list[str], text: str, sizes: list[int]) -> None:
    deltas, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        deltas.append(text[i : i + n])
        i, k = i + n, k + 1
    out, hit = _run_matcher(tuple(stops), deltas)
    assert ("".join(out), hit) == _reference(tuple(stops), text)


# --------------------------------------------------------------------------- manager


def _out(rid: str, ids: list[int], n: int, finish: str | None = None, **kw: Any) -> ReqTokenOut:
    return ReqTokenOut(
        rid=rid,
        new_ids=ids,
        finish_reason=finish,
        usage=Usage(prompt_tokens=7, cached_tokens=3, completion_tokens=n),
        **kw,
    )


def test_manager_streams_and_passes_through(bpe_tok: Any) -> None:
    mgr = DetokenizerManager(bpe_tok)
    a = bpe_tok.encode("Hello world, 😀 café", add_special_tokens=False)
    b = bpe_tok.encode("你好世界", add_special_tokens=False)
    lp = TokenLogprobs([-0.5], [[1, 2]], [[-0.5, -1.0]])
    texts: dict[str, str] = {"a": "", "b": ""}
    steps = max(len(a), len(b))
    for i in range(steps):
        outs = []
        for rid, ids in (("a", a), ("b", b)):
            if i < len(ids):
                fin = "length" if i == len(ids) - 1 else None
                outs.append(_out(rid, [ids[i]], i + 1, fin, logprobs=lp))
        text_batch, aborts = mgr.handle(TokenBatchOut(outs))
        assert aborts == [] and len(text_batch.outs) == len(outs)
        for o, src in zip(text_batch.outs, outs, strict=True):
            assert (o.rid, o.new_ids, o.finish_reason) == (src.rid, src.new_ids, src.finish_reason)
            assert (o.prompt_tokens, o.cached_tokens, o.completion_tokens) == (7, 3, i + 1)
            assert o.logprobs is lp and o.error == ""
            texts[o.rid] += o.text_delta
    assert texts == {"a": bpe_tok.decode(a), "b": bpe_tok.decode(b)}
    assert mgr.num_active == 0


def test_manager_stop_string(bpe_tok: Any) -> None:
    mgr = DetokenizerManager(bpe_tok)
    ids = bpe_tok.encode("Hello world, this is a test", add_special_tokens=False)
    stop = ("world,", "zzz")
    got, aborts_all, n_hit = "", [], None
    for i, tid in enumerate(ids):
        text_batch, aborts = mgr.handle(TokenBatchOut([_out("r", [tid], i + 1, stop=stop)]))
        aborts_all += aborts
        for o in text_batch.outs:
            assert n_hit is None, "out forwarded after the stop hit"
            got += o.text_delta
            if o.finish_reason is not None:
                assert o.finish_reason == "stop"
                n_hit = o.completion_tokens
    assert got == "Hello "
    assert aborts_all == [AbortReq("r", reason="stop")]
    assert n_hit is not None and n_hit < len(ids)
    assert "r" in mgr  # kept until the scheduler's final out
    text_batch, aborts = mgr.handle(TokenBatchOut([_out("r", [], len(ids), "stop", stop=stop)]))
    assert text_batch.outs == [] and aborts == [] and mgr.num_active == 0


def test_manager_stop_in_final_out(bpe_tok: Any) -> None:
    mgr = DetokenizerManager(bpe_tok)
    ids = bpe_tok.encode("abc STOP def", add_special_tokens=False)
    text_batch, aborts = mgr.handle(
        TokenBatchOut([_out("r", ids, len(ids), "length", stop=("STOP",))])
    )
    assert aborts == [] and mgr.num_active == 0
    (o,) = text_batch.outs
    assert (o.text_delta, o.finish_reason, o.completion_tokens) == ("abc ", "stop", len(ids))


def test_manager_held_text_flushed_at_finish(bpe_tok: Any) -> None:
    mgr = DetokenizerManager(bpe_tok)
    ids = bpe_tok.encode("ok ST", add_special_tokens=False)
    first, _ = mgr.handle(TokenBatchOut([_out("r", ids, len(ids), stop=("STOP",))]))
    last, _ = mgr.handle(TokenBatchOut([_out("r", [], len(ids), "length", stop=("STOP",))]))
    assert first.outs[0].text_delta + last.outs[0].text_delta == "ok ST"
    assert last.outs[0].finish_reason == "length"


def test_manager_error_passthrough(bpe_tok: Any) -> None:
    mgr = DetokenizerManager(bpe_tok)
    ids = bpe_tok.encode("Hi", add_special_tokens=False)
    mgr.handle(TokenBatchOut([_out("r", ids, len(ids))]))
    assert "r" in mgr
    text_batch, aborts = mgr.handle(TokenBatchOut([_out("r", [], len(ids), "abort", error="boom")]))
    (o,) = text_batch.outs
    assert (o.error, o.finish_reason, o.text_delta) == ("boom", "abort", "")
    assert aborts == [] and mgr.num_active == 0


class _ExplodingTokenizer:
    """Delegates to a real tokenizer but fails to decode one id."""

    def __init__(self, inner: Any, bad_id: int) -> None:
        self._inner, self._bad = inner, bad_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, ids: list[int], **kw: Any) -> str:
        if self._bad in ids:
            raise ValueError("bad id")
        return self._inner.decode(ids, **kw)


def test_fast_decode_path_only_for_stock_tokenizers(bpe_tok: Any, sp_tok: Any) -> None:
    assert TokenizerTraits.of(bpe_tok).backend is not None
    assert TokenizerTraits.of(sp_tok).backend is not None
    assert TokenizerTraits.of(_ExplodingTokenizer(bpe_tok, 0)).backend is None


def test_manager_decode_failure_aborts_only_that_request(bpe_tok: Any) -> None:
    good = bpe_tok.encode("fine", add_special_tokens=False)
    bad_id = next(i for i in range(len(bpe_tok)) if i not in good)
    mgr = DetokenizerManager(_ExplodingTokenizer(bpe_tok, bad_id))
    batch = TokenBatchOut([_out("bad", [bad_id], 1), _out("ok", good, len(good), "length")])
    text_batch, aborts = mgr.handle(batch)
    bad, ok = text_batch.outs
    assert bad.finish_reason == "abort" and "bad id" in bad.error
    assert ok.text_delta == "fine" and ok.error == ""
    assert [(a.rid, a.reason) for a in aborts] == [("bad", "abort")]
    text_batch, aborts = mgr.handle(TokenBatchOut([_out("bad", [1], 2, "abort")]))
    assert text_batch.outs == [] and aborts == [] and mgr.num_active == 0


# --------------------------------------------------------------------------- process


def _fake_tokenizer_module(load: Any) -> types.ModuleType:
    mod = types.ModuleType("radixrt.model.tokenizer")
    mod.load_tokenizer = load  # type: ignore[attr-defined]
    return mod


def _load_saved(model_path: str, tokenizer_path: str | None = None) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path or model_path)


def _detok_child(tok_dir: str, ipc: IpcPaths, parent_pid: int) -> None:
    """Spawned child: the process entry point with a tokenizer loaded from `tok_dir`."""
    sys.modules["radixrt.model.tokenizer"] = _fake_tokenizer_module(_load_saved)
    run_detokenizer(tok_dir, None, ipc, parent_pid)


def test_run_detokenizer_reports_load_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model_path: str, tokenizer_path: str | None = None) -> Any:
        raise OSError("no such tokenizer")

    monkeypatch.setitem(sys.modules, "radixrt.model.tokenizer", _fake_tokenizer_module(broken))
    monkeypatch.setattr(detok_mod, "become_helper", lambda nice: None)
    monkeypatch.setattr(detok_mod, "exit_with_parent", lambda pid, **kw: None)
    ipc, ipc_dir = IpcPaths.in_new_tempdir()
    ctx = zmq.Context()
    from_detok = pull_socket(ctx, ipc.tokenizer)
    try:
        run_detokenizer("/nonexistent", None, ipc, os.getppid())
        assert from_detok.poll(20_000)
        (msg,) = [_recv(from_detok)]
        assert not from_detok.poll(100)  # exactly one report
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    assert isinstance(msg, ReadyMsg) and not msg.ok and msg.process == "detokenizer"
    assert "no such tokenizer" in msg.error


def test_run_detokenizer_process(bpe_tok: Any, tmp_path: Path) -> None:
    bpe_tok.save_pretrained(str(tmp_path / "tok"))
    ipc, ipc_dir = IpcPaths.in_new_tempdir()
    ctx = zmq.Context()
    from_detok = pull_socket(ctx, ipc.tokenizer)
    to_sched = pull_socket(ctx, ipc.scheduler)
    to_detok = push_socket(ctx, ipc.detokenizer)
    mpc = mp.get_context("spawn")
    proc = mpc.Process(target=_detok_child, args=(str(tmp_path / "tok"), ipc, os.getpid()))
    proc.start()
    try:
        assert from_detok.poll(60_000)
        assert _recv(from_detok) == ReadyMsg(ok=True, process="detokenizer")
        to_detok.send(b"not a pickle")  # must not kill the loop
        send(to_detok, "not a batch")
        send(to_detok, TokenBatchOut([]))  # empty: nothing forwarded
        ids = bpe_tok.encode("Hi there STOP x", add_special_tokens=False)
        send(to_detok, TokenBatchOut([_out("r", ids, len(ids), stop=("STOP",))]))
        assert from_detok.poll(20_000)
        text_batch = _recv(from_detok)
        assert isinstance(text_batch, TextBatchOut)
        (o,) = text_batch.outs
        assert (o.rid, o.text_delta, o.finish_reason) == ("r", "Hi there ", "stop")
        assert to_sched.poll(20_000)
        assert _recv(to_sched) == AbortReq("r", reason="stop")
        send(to_detok, TokenBatchOut([_out("r", [], len(ids), "stop")]))
        ids2 = bpe_tok.encode("😀 done", add_special_tokens=False)
        send(to_detok, TokenBatchOut([_out("s", ids2, len(ids2), "length")]))
        assert from_detok.poll(20_000)
        (o,) = _recv(from_detok).outs  # the dropped "r" out produced no batch
        assert (o.rid, o.text_delta, o.finish_reason) == ("s", "😀 done", "length")
        assert proc.is_alive()
    finally:
        proc.kill()
        proc.join(10)
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _recv(sock: zmq.Socket) -> Any:
    from radixrt.core import messages

    return messages.decode(sock.recv())
