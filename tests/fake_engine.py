"""A stand-in for `Engine` in tests that drive the real HTTP app without the three processes.

`FakeEngineBase` is the narrow Engine API the server uses: tokenizing, chat templates and input
checks go to the real `InputProcessor`; it is always alive and counts a request outstanding from
`submit` until its last output or its abort. A subclass's `submit` decides what the "model"
answers: it calls `_new_request` and schedules `ReqTextOut`s on the caller's loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from radixrt.core.messages import Usage
from radixrt.core.sampling_params import SamplingParams
from tokenizer_proc.input_processor import InputProcessor
from tokenizer_proc.request_state import ReqState


class FakeEngineBase:
    def __init__(self, tokenizer: Any, context: int, model_path: str):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_context_len = context
        self.info = {"model_path": model_path, "max_context_len": context,
                     "vocab_size": self.vocab_size}
        self.inputs = InputProcessor(tokenizer, self.vocab_size, context)
        self.submitted: list[tuple[list[int], SamplingParams]] = []  # every submit, in order
        self.live: set[str] = set()  # rids submitted, neither finished nor aborted

    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None, **options: Any,
                            ) -> list[int]:
        return self.inputs.apply_chat_template(messages, tools, **options)

    def template_takes_tools(self) -> bool:
        return self.inputs.template_takes_tools()

    def check_input_ids(self, ids: Any, max_new_tokens: int = 1, **kw: Any) -> list[int]:
        return self.inputs.check_ids(ids, max_new_tokens, **kw)

    def check_alive(self) -> None:
        pass

    def num_outstanding(self) -> int:
        return len(self.live)

    def abort(self, rid: str) -> None:
        self.live.discard(rid)

    def stats(self) -> dict[str, Any]:
        return {}

    def _new_request(self, ids: list[int], sp: SamplingParams, loop: asyncio.AbstractEventLoop,
                     queue: asyncio.Queue) -> ReqState:
        """Validate `sp`, record the request (rid `r<n>`) as submitted and live; its state."""
        sp.validate()
        rid = f"r{len(self.submitted)}"
        self.submitted.append((list(ids), sp))
        self.live.add(rid)
        return ReqState(rid=rid, usage=Usage(prompt_tokens=len(ids)), loop=loop, queue=queue)
