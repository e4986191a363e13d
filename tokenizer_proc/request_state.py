"""What a caller sees of one request: `ReqState` (filled as outputs arrive) and the two public
result shapes it builds, `GenerateOutput` (whole request) and `StreamChunk` (one delta)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.messages import FINISH_ABORT, ReqTextOut, Usage, UsageFields


@dataclass
class GenerateOutput(UsageFields):
    """A finished request. `prompt_tokens` / `cached_tokens` / `completion_tokens` read `usage`."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage
    logprobs: TokenLogprobs | None = None
    # Prompt scores (`SamplingParams.logprob_start_len >= 0`): entry j is about prompt token
    # `logprob_start_len + j`; None when none were asked for.
    prompt_logprobs: TokenLogprobs | None = None
    error: str = ""


@dataclass
class StreamChunk(UsageFields):
    """One streamed delta; `usage` is the request's accounting so far."""

    rid: str
    text: str  # the delta since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    finish_reason: str | None
    usage: Usage
    logprobs: TokenLogprobs | None = None
    # Set on the one chunk that carries the prompt scores (the first, when asked for).
    prompt_logprobs: TokenLogprobs | None = None
    error: str = ""


@dataclass
class ReqState(UsageFields):
    """One request's handle; filled by the tokenizer manager's receive thread.

    Sync callers wait on `done`; async callers read each `ReqTextOut` (or the exception that
    ended the runtime) from `queue`, on their own `loop`.

    `stream`: the caller may show each output as it comes (so once `delivered`, the request
    cannot be re-run without the caller seeing it twice); a non-streamed caller reads only the
    finished state, so a request whose replica died can be re-run elsewhere (`restart`).
    """

    rid: str
    usage: Usage
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    error: str = ""
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    stream: bool = False
    delivered: bool = False  # an output was handed to the caller (queue / done)
    attempts: int = 1  # runs started (a dead replica's request re-run elsewhere adds one)

    def apply(self, out: ReqTextOut) -> None:
        self.text += out.text_delta
        self.token_ids.extend(out.new_ids)
        if out.new_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.usage = out.usage
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = TokenLogprobs()
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.error:
            self.error = out.error
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    def notify(self, item: ReqTextOut | BaseException) -> None:
        if not isinstance(item, BaseException):
            self.delivered = True
        if self.loop is not None and self.queue is not None:
            try:
                on_loop = asyncio.get_running_loop() is self.loop
            except RuntimeError:  # not on an event loop's thread
                on_loop = False
            if on_loop:  # read on the caller's own loop (`TokenizerManager.receive_on`)
                self.queue.put_nowait(item)
            else:
                try:
                    self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
                except RuntimeError:  # the caller's event loop is closed: nobody is listening
                    pass
        if isinstance(item, BaseException) or self.finish_reason is not None:
            self.done.set()

    def retriable(self) -> bool:
        """Whether re-running from scratch is invisible to the caller: not finished, and
        either not streamed or nothing handed over yet."""
        return self.finish_reason is None and (not self.stream or not self.delivered)

    def restart(self) -> None:
        """Forget a lost run's partial output before the request runs again."""
        self.usage = Usage(prompt_tokens=self.usage.prompt_tokens)
        self.text = ""
        self.token_ids = []
        self.logprobs = self.prompt_logprobs = None
        self.error = ""
        self.first_token_time = None
        self.attempts += 1

    def fail(self, err: str, exc: BaseException) -> None:
        """The runtime died: end this request with `err`."""
        self.error = err
        self.finish_reason = self.finish_reason or FINISH_ABORT
        self.notify(exc)

    # -- the public result shapes, built here only --------------------------------------------
    def result(self) -> GenerateOutput:
        return GenerateOutput(
            rid=self.rid, text=self.text, token_ids=list(self.token_ids),
            finish_reason=self.finish_reason or FINISH_ABORT, usage=self.usage,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs, error=self.error)

    def chunk(self, out: ReqTextOut) -> StreamChunk:
        return StreamChunk(
            rid=self.rid, text=out.text_delta, token_ids=list(out.new_ids),
            finish_reason=out.finish_reason, usage=out.usage, logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs, error=out.error)
