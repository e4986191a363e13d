"""Every message that crosses a process boundary, and the one serializer for them.

Flow (ZMQ PUSH/PULL over ipc:// in a private temp dir):
    tokenizer ──GenerateReq / AbortReq / control──▶ scheduler
    scheduler ──TokenBatchOut (one per step)──────▶ detokenizer
    detokenizer ──TextBatchOut (one per step)─────▶ tokenizer
    detokenizer ──AbortReq (stop string hit)──────▶ scheduler
    scheduler ──control replies / ReadyMsg───────▶ tokenizer
    scheduler ──CacheEvicted (steps that evicted)─▶ tokenizer
With `--dp N` there are N schedulers (and N detokenizers) pushing to the one tokenizer.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.sampling_params import SamplingParams

# Finish reasons, as OpenAI names them ("abort" is ours: client gone or error).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass
class GenerateReq:
    """A validated, tokenized request. `rid` is unique per Engine. `stream`: the caller shows
    outputs as they come, so the scheduler sends them every `stream_interval` tokens; a
    request read only once finished gets fewer, larger outs (`OutputProcessor.due`)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = True


@dataclass
class AbortReq:
    """Stop a request. From the tokenizer (client gone) or the detokenizer (stop string hit).

    `reason` ends up as the finish reason reported to the caller ("stop" or "abort").
    """

    rid: str
    reason: str = FINISH_ABORT
    message: str = ""


@dataclass
class FlushCacheReq:
    req_id: int


@dataclass
class StatsReq:
    req_id: int


@dataclass
class CheckInvariantsReq:
    """Ask the scheduler to run every pool's and the tree's invariant check (tests, debug)."""

    req_id: int


@dataclass
class ControlReply:
    """Answer to a control request, matched by `req_id`. `error` is set when it failed."""

    req_id: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class CacheEvicted:
    """Scheduler `replica`'s radix cache no longer holds anything extending each prefix (the
    path to an evicted leaf plus its first token; `[]`: the whole cache was flushed). Lets the
    router's per-replica prefix trees forget what the replica evicted."""

    replica: int
    prefixes: list[list[int]]


@dataclass
class ReadyMsg:
    """A child finished starting (the scheduler: model loaded, pools sized) or failed: `error`."""

    ok: bool
    process: str = "scheduler"
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class Usage:
    """A request's token accounting, the one record every output shape embeds: prompt tokens,
    how many of them came from the prefix cache, and tokens generated so far."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class UsageFields:
    """Read-only `prompt_tokens` / `cached_tokens` / `completion_tokens` over `self.usage`."""

    usage: Usage

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens


@dataclass
class ReqTokenOut(UsageFields):
    """One request's progress in one step. `new_ids` are tokens produced since the last out."""

    rid: str
    new_ids: list[int]
    finish_reason: str | None
    usage: Usage
    logprobs: TokenLogprobs | None = None
    # Sent once, with the first out after the prompt is computed, when the request asked for
    # prompt scores (`SamplingParams.logprob_start_len >= 0`).
    prompt_logprobs: TokenLogprobs | None = None
    # Detokenization settings travel with the request's outputs (the detokenizer keeps no
    # request registry of its own beyond incremental-decoding state).
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    error: str = ""


@dataclass
class TokenBatchOut:
    outs: list[ReqTokenOut]


@dataclass
class ReqTextOut(UsageFields):
    """`ReqTokenOut` after detokenization: the text produced since the last out."""

    rid: str
    text_delta: str
    new_ids: list[int]
    finish_reason: str | None
    usage: Usage
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    error: str = ""


@dataclass
class TextBatchOut:
    outs: list[ReqTextOut]


def encode(msg: object) -> bytes:
    """The one serializer. Pickle is safe here: peers are our own children over private ipc."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)
