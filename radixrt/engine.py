"""`Engine`: the offline Python API over the three-process runtime."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from radixrt.config import ServerArgs
from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.messages import CheckInvariantsReq, FlushCacheReq, ReqTextOut, StatsReq
from radixrt.core.sampling_params import SamplingParams
from tokenizer_proc.manager import EngineDeadError, ReqState, TokenizerManager

ParamsLike = SamplingParams | dict[str, Any] | None


@dataclass
class GenerateOutput:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: TokenLogprobs | None = None
    error: str = ""


@dataclass
class StreamChunk:
    rid: str
    text: str  # the delta since the previous chunk
    token_ids: list[int]  # new token ids since the previous chunk
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: TokenLogprobs | None = None
    error: str = ""


def _to_params(p: ParamsLike) -> SamplingParams:
    if p is None:
        sp = SamplingParams()
    elif isinstance(p, SamplingParams):
        sp = p
    elif isinstance(p, dict):
        return SamplingParams.from_dict(p)
    else:
        raise TypeError(f"sampling_params: expected SamplingParams or dict, got {type(p).__name__}")
    sp.validate()
    return sp


class Engine:
    """`Engine(**fields of ServerArgs)` or `Engine(args=ServerArgs(...))`. Use as a context
    manager (or call `shutdown`) so the child processes stop with it."""

    def __init__(self, args: ServerArgs | None = None, **kwargs: Any):
        if args is not None and kwargs:
            raise TypeError("pass either args=ServerArgs(...) or keyword fields, not both")
        self.args = args or ServerArgs(**kwargs)
        self.tm = TokenizerManager(self.args)
        self.tokenizer = self.tm.tokenizer
        self.info = self.tm.info
        self.max_context_len: int = self.info["max_context_len"]
        self.vocab_size: int = self.info["vocab_size"]

    # -- input preparation (shared with the HTTP server) ---------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: must have 'role' and 'content'")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def validate_input_ids(self, ids: Sequence[int], sp: SamplingParams) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("input_ids: must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("input_ids: every token id must be an integer")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) + sp.max_new_tokens > self.max_context_len:
            raise ValueError(
                f"prompt: {len(ids)} prompt tokens + max_new_tokens {sp.max_new_tokens} exceed "
                f"the context length {self.max_context_len}")
        return list(ids)

    def _prepare(self, prompts: str | list[str] | None, input_ids: Any,
                 sampling_params: ParamsLike | list[ParamsLike]) -> tuple[list[list[int]], list[SamplingParams], bool]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("prompts: pass exactly one of prompts or input_ids")
        if prompts is not None:
            single = isinstance(prompts, str)
            plist = [prompts] if single else list(prompts)
            if not plist:
                raise ValueError("prompts: must not be empty")
            ids_list = [self.tokenize(p) for p in plist]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
            if not ids_list:
                raise ValueError("input_ids: must not be empty")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ValueError("sampling_params: list length differs from the number of prompts")
            params = [_to_params(p) for p in sampling_params]
        else:
            params = [_to_params(sampling_params)] * len(ids_list)
        ids_list = [self.validate_input_ids(ids, sp) for ids, sp in zip(ids_list, params, strict=True)]
        return ids_list, params, single

    # -- generation --------------------------------------------------------------------------------
    @staticmethod
    def _output(state: ReqState) -> GenerateOutput:
        return GenerateOutput(
            rid=state.rid, text=state.text, token_ids=list(state.token_ids),
            finish_reason=state.finish_reason or "abort", prompt_tokens=state.prompt_tokens,
            cached_tokens=state.cached_tokens, completion_tokens=state.completion_tokens,
            logprobs=state.logprobs, error=state.error)

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: ParamsLike | list[ParamsLike] = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 ) -> GenerateOutput | list[GenerateOutput]:
        """Blocking batch generation. A single prompt (str or one id list) returns one output."""
        ids_list, params, single = self._prepare(prompts, input_ids, sampling_params)
        states = [self.tm.submit(ids, sp) for ids, sp in zip(ids_list, params, strict=True)]
        for st in states:
            while not st.done.wait(0.5):
                self.tm.check_alive()
            if self.tm.dead_error is not None:
                raise EngineDeadError(self.tm.dead_error)
        outs = [self._output(st) for st in states]
        return outs[0] if single else outs

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: ParamsLike | list[ParamsLike] = None,
             ) -> GenerateOutput | list[GenerateOutput]:
        """One conversation (list of messages) or a list of conversations."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            return self.generate(input_ids=[self.apply_chat_template(messages)],
                                 sampling_params=sampling_params)[0]  # type: ignore[index]
        return self.generate(input_ids=[self.apply_chat_template(m) for m in messages],
                             sampling_params=sampling_params)

    async def generate_stream(self, prompt: str | None = None, sampling_params: ParamsLike = None,
                              input_ids: list[int] | None = None) -> AsyncIterator[StreamChunk]:
        """Yields text deltas as they are produced; aborts the request if the consumer stops."""
        ids_list, params, _ = self._prepare(prompt, input_ids, sampling_params)
        state = self.tm.submit(ids_list[0], params[0], stream=True,
                               loop=asyncio.get_running_loop())
        assert state.queue is not None
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(state.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    self.tm.check_alive()
                    continue
                if isinstance(item, BaseException):
                    raise item
                out: ReqTextOut = item
                finished = out.finish_reason is not None
                yield StreamChunk(
                    rid=state.rid, text=out.text_delta, token_ids=list(out.new_ids),
                    finish_reason=out.finish_reason, prompt_tokens=state.prompt_tokens,
                    cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens,
                    logprobs=out.logprobs, error=out.error)
        finally:
            if not finished:
                self.tm.abort(state.rid)

    # -- control -----------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only possible when no request is running or waiting."""
        return self.tm.control(FlushCacheReq(req_id=0)).ok

    def stats(self) -> dict[str, Any]:
        """Monotonic counters (requests, prompt/cached/generated tokens, retractions, evictions),
        current gauges (running, waiting, pool usage, evictable vs locked cache) and hit rate."""
        return self.tm.control(StatsReq(req_id=0)).data

    def check_invariants(self) -> None:
        """Raise AssertionError if any pool or the radix tree is inconsistent (slot leaks...)."""
        reply = self.tm.control(CheckInvariantsReq(req_id=0))
        if not reply.ok:
            raise AssertionError(reply.error)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until the scheduler has no running or waiting request (after aborts)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return
            time.sleep(0.05)
        raise TimeoutError("engine did not become idle")

    def shutdown(self) -> None:
        self.tm.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        tm = getattr(self, "tm", None)
        if tm is not None:
            try:
                tm.shutdown()
            except Exception:
                pass
