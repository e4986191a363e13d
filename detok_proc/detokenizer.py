"""Detokenizer process: token ids → text deltas, stop strings, and the process loop.

Per request, `IncrementalDecoder` turns new token ids into text deltas whose concatenation is
exactly `tokenizer.decode(all_ids)`, and `StopMatcher` holds back text that could still turn
into a stop string. `DetokenizerManager` applies both to each scheduler step;
`run_detokenizer` is the process entry point.

Nothing here imports torch or transformers at module import time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixrt.core import messages
from radixrt.core.cpu_policy import become_helper
from radixrt.core.ipc import (
    IpcPaths,
    exit_with_parent,
    pull_socket,
    push_socket,
    send,
)
from radixrt.core.messages import (
    FINISH_ABORT,
    FINISH_STOP,
    AbortReq,
    ReadyMsg,
    ReqTextOut,
    ReqTokenOut,
    TextBatchOut,
    TokenBatchOut,
)

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# clean_up_tokenization rewrites patterns of at most 4 chars that start with a space (" n't"),
# so text ending with no space in its last 3 chars can't be rewritten by what follows.
_CLEANUP_LOOKBACK = 3
POLL_TIMEOUT_MS = 100


@dataclass(frozen=True)
class TokenizerTraits:
    """What incremental decoding needs to know about a tokenizer; computed once per tokenizer.

    byte_ids: SentencePiece byte-fallback tokens ("<0xE2>"). A run of them is decoded as one
        UTF-8 group (invalid → one U+FFFD per byte), so even an ASCII byte token's text can
        change until a non-byte token closes the run.
    added_ids: special and added tokens; with skip_special_tokens they vanish before the
        tokenizer's decoder runs, so they don't close a byte run.
    cleanup: decode may apply `clean_up_tokenization` (" ." → "." etc.), which can rewrite a
        trailing space once the next token arrives.
    """

    byte_ids: frozenset[int]
    added_ids: frozenset[int]
    cleanup: bool
    # `tokenizers.Tokenizer` whose `decode(ids, skip_special_tokens=)` is exactly what
    # `tokenizer.decode` returns (stock transformers fast tokenizer, no cleanup): calling it
    # directly skips ~8 us of Python wrapper per call. None: go through `tokenizer.decode`.
    backend: Any = None

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerTraits:
        byte_ids: set[int] = set()
        for b in range(256):
            piece = f"<0x{b:02X}>"
            tid = tokenizer.convert_tokens_to_ids(piece)
            if isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == piece:
                byte_ids.add(tid)
        added = set(getattr(tokenizer, "all_special_ids", ()) or ())
        added.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        return cls(
            byte_ids=frozenset(byte_ids),
            added_ids=frozenset(added),
            cleanup=cleanup,
            backend=None if cleanup else _plain_backend(tokenizer),
        )


def _plain_backend(tokenizer: Any) -> Any:
    """The backend `tokenizers.Tokenizer` if `tokenizer.decode` adds nothing to it, else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: take the safe path
        return None
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    ):
        return tokenizer.backend_tokenizer
    return None


class IncrementalDecoder:
    """Streaming detokenization of one request.

    Invariant: the concatenation of every `step()` result and the final `flush()` equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)` exactly.

    Technique (window of the last couple of steps, so cost per step is O(step size), not
    O(generated length)): `ids[prefix:read]` decodes to `prefix_text`, which is already
    emitted; a step decodes `ids[prefix:]` and emits what follows `prefix_text`. Decoding a
    window rather than single tokens keeps BPE byte merges and SentencePiece's leading-space
    handling right: the window's first surviving token absorbs any "first token" treatment
    (stripped space), and the window is only slid to a start whose text is non-empty. Text is
    held back (the window grows) while it could still change: a trailing U+FFFD (incomplete
    UTF-8), an open run of byte-fallback tokens, or a trailing space that
    `clean_up_tokenization` could rewrite. `flush()` decodes the whole sequence once and emits
    exactly the remainder, so held-back text is never lost.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool,
        traits: TokenizerTraits | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._traits = traits if traits is not None else TokenizerTraits.of(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""
        self._emitted: list[str] = []
        self._flushed = False

    @property
    def ids(self) -> list[int]:
        """Every token id seen so far (do not mutate)."""
        return self._ids

    @property
    def window(self) -> int:
        """Ids in the current decode window, i.e. after its start offset (tests, debug)."""
        return len(self._ids) - self._prefix

    def _decode(self, ids: list[int]) -> str:
        backend = self._traits.backend
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, new_ids: list[int]) -> str:
        """Add `new_ids`; return the text that is now final (possibly "")."""
        if self._flushed:
            raise RuntimeError("step() after flush()")
        self._ids.extend(int(i) for i in new_ids)
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix :])
        if self._must_hold(text) or not text.startswith(self._prefix_text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._advance(text)
        if delta:
            self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """The request finished: return everything still held back. Call once."""
        if self._flushed:
            return ""
        self._flushed = True
        full = self._decode(self._ids)
        done = "".join(self._emitted)
        if full.startswith(done):
            rest = full[len(done) :]
        else:  # Emitted text disagrees with the full decode: a tokenizer quirk we don't know.
            logger.warning("incremental detokenization diverged from full decode")
            text = self._decode(self._ids[self._prefix :])
            rest = text[len(self._prefix_text) :] if text.startswith(self._prefix_text) else ""
        self._emitted.append(rest)
        self._read = len(self._ids)
        return rest

    def _must_hold(self, text: str) -> bool:
        if text.endswith(REPLACEMENT_CHAR):
            return True
        tr = self._traits
        if tr.byte_ids:
            j = len(self._ids) - 1
            while self._skip and j >= 0 and self._ids[j] in tr.added_ids:
                j -= 1
            if j >= 0 and self._ids[j] in tr.byte_ids:
                return True
        return tr.cleanup and " " in text[-_CLEANUP_LOOKBACK:]

    def _advance(self, text: str) -> None:
        """Everything up to len(ids) is emitted: slide the window to start at the old read
        offset if that start keeps some text in front of the next tokens, else grow it."""
        new_read = len(self._ids)
        if self._read > self._prefix:
            head = self._decode(self._ids[self._read : new_read])
            if head:
                self._prefix, self._prefix_text = self._read, head
                self._read = new_read
                return
        self._read, self._prefix_text = new_read, text


class StopMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas.

    Invariant: text returned by `feed` never contains, and is never followed by text that
    completes, a stop string starting inside it; held-back text is always shorter than the
    longest stop string.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in dict.fromkeys(stops) if s)
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self.hit = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit).

        On a hit the text runs up to, not including, the stop string that completed first
        (independent of how the text was split into deltas); every later call returns
        ("", True).
        """
        if self.hit:
            return "", True
        if not self._stops:
            return delta, False
        buf = self._pending + delta
        # (end, start) of each stop's first occurrence; the one complete first wins, as if the
        # text had arrived one char at a time (the longest stop on a tie).
        found = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self._stops) if i >= 0]
        if found:
            self.hit = True
            self._pending = ""
            return buf[: min(found)[1]], True
        keep = self._holdback(buf)
        self._pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Finished without a hit: return the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.hit else out

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


@dataclass
class _ReqState:
    decoder: IncrementalDecoder | None
    matcher: StopMatcher | None
    stopped: bool = False  # stop string hit (or detok failure): drop outs until the final one


class DetokenizerManager:
    """Turns scheduler `TokenBatchOut`s into `TextBatchOut`s, keeping per-request state.

    Invariants: state exists for a rid from its first out until the scheduler's final out
    (finish_reason set) for it; after a stop-string hit exactly one `AbortReq(reason="stop")`
    is returned and the rid's later outs are dropped.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._traits = TokenizerTraits.of(tokenizer)
        self._states: dict[str, _ReqState] = {}

    @property
    def num_active(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def handle(self, batch: TokenBatchOut) -> tuple[TextBatchOut, list[AbortReq]]:
        outs: list[ReqTextOut] = []
        aborts: list[AbortReq] = []
        for out in batch.outs:
            try:
                text_out = self._handle_one(out, aborts)
            except Exception as e:  # one bad request must not take the batch down
                logger.exception("detokenizing request %s failed", out.rid)
                text_out = self._fail(out, e, aborts)
            if text_out is not None:
                outs.append(text_out)
        return TextBatchOut(outs), aborts

    def _handle_one(self, out: ReqTokenOut, aborts: list[AbortReq]) -> ReqTextOut | None:
        rid, final = out.rid, out.finish_reason is not None
        st = self._states.get(rid)
        if st is not None and st.stopped:
            if final:
                del self._states[rid]
            return None
        if out.error:
            if final:
                self._states.pop(rid, None)
            return self._text_out(out, "", out.finish_reason)
        if st is None:
            st = _ReqState(
                IncrementalDecoder(self._tok, out.skip_special_tokens, self._traits),
                StopMatcher(tuple(out.stop)),
            )
            self._states[rid] = st
        assert st.decoder is not None and st.matcher is not None
        delta = st.decoder.step(out.new_ids)
        if final:
            delta += st.decoder.flush()
        text, hit = st.matcher.feed(delta)
        if hit:
            st.stopped = True
            if final:
                del self._states[rid]
            else:
                aborts.append(AbortReq(rid, reason=FINISH_STOP))
            return self._text_out(out, text, FINISH_STOP)
        if final:
            text += st.matcher.flush()
            del self._states[rid]
        return self._text_out(out, text, out.finish_reason)

    def _fail(self, out: ReqTokenOut, exc: Exception, aborts: list[AbortReq]) -> ReqTextOut:
        msg = f"detokenizer: {type(exc).__name__}: {exc}"
        if out.finish_reason is not None:
            self._states.pop(out.rid, None)
        else:
            self._states[out.rid] = _ReqState(None, None, stopped=True)
            aborts.append(AbortReq(out.rid, reason=FINISH_ABORT, message=msg))
        return self._text_out(out, "", FINISH_ABORT, error=msg)

    @staticmethod
    def _text_out(
        out: ReqTokenOut,
        text: str,
        finish_reason: str | None,
        error: str | None = None,
    ) -> ReqTextOut:
        return ReqTextOut(
            rid=out.rid,
            text_delta=text,
            new_ids=list(out.new_ids),
            finish_reason=finish_reason,
            usage=out.usage,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            error=out.error if error is None else error,
        )


def _recv_available(sock: zmq.Socket) -> list[object]:
    """Every message waiting on `sock`, without blocking; undecodable ones are logged, skipped."""
    msgs: list[object] = []
    while True:
        try:
            raw = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return msgs
        try:
            msgs.append(messages.decode(raw))
        except Exception:
            logger.exception("dropping undecodable message (%d bytes)", len(raw))


def run_detokenizer(
    model_path: str,
    tokenizer_path: str | None,
    ipc: IpcPaths,
    parent_pid: int,
    nice: int = 0,
) -> None:
    """Process entry point: PULL `TokenBatchOut`s, PUSH `TextBatchOut`s to the tokenizer and
    stop-string `AbortReq`s to the scheduler. Reports readiness (or a start-up failure) as a
    `ReadyMsg` to the tokenizer. Runs until the parent process dies. It does no tensor work:
    one thread, `nice` added to its priority (`cpu_policy.become_helper`)."""
    become_helper(nice)
    exit_with_parent(parent_pid, cleanup_dir=ipc.directory)
    ctx = zmq.Context()
    to_tokenizer = push_socket(ctx, ipc.tokenizer)

    def report(status: str) -> None:
        ok = status == "ok"
        send(to_tokenizer, ReadyMsg(ok=ok, process="detokenizer", error="" if ok else status))

    try:
        from radixrt.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_path, tokenizer_path)
        manager = DetokenizerManager(tokenizer)
        pull = pull_socket(ctx, ipc.detokenizer)
        to_scheduler = push_socket(ctx, ipc.scheduler)
    except Exception as e:
        logger.exception("detokenizer failed to start")
        report(f"detokenizer: {type(e).__name__}: {e}")
        time.sleep(0.5)  # let the report leave before the process exits
        return
    report("ok")

    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    while True:
        if not poller.poll(POLL_TIMEOUT_MS):
            continue
        for msg in _recv_available(pull):
            try:
                if not isinstance(msg, TokenBatchOut):
                    logger.warning("detokenizer ignoring %s", type(msg).__name__)
                    continue
                text_batch, aborts = manager.handle(msg)
                for abort in aborts:
                    send(to_scheduler, abort)
                if text_batch.outs:
                    send(to_tokenizer, text_batch)
            except Exception:
                logger.exception("detokenizer failed on a batch")
