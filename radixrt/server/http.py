"""The OpenAI-compatible HTTP server. It runs in the tokenizer process and reuses the Engine's
tokenizer side; the scheduler and detokenizer stay separate processes.

FastAPI + uvicorn: the de-facto ASGI stack of SGLang and vLLM (an OpenAI client cannot tell them
apart), with streaming responses that are cancelled when the client disconnects — which is what
lets a dropped stream abort its request in the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from radixrt.config import ServerArgs
from radixrt.core import cpu_policy
from radixrt.core.errors import EngineDeadError, InvalidRequestError, InvariantError
from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.messages import ReqTextOut
from radixrt.core.sampling_params import SamplingParams
from radixrt.frontend.engine import Engine, ReqState
from radixrt.grammar import check_params
from radixrt.server import api_fields
from radixrt.server import protocol as P
from radixrt.server import responses as R
from radixrt.server import tools as T
from radixrt.server.guard import add_guard, error_response
from radixrt.server.guard import json_body as read_json_body
from radixrt.server.metrics import ServerMetrics

logger = logging.getLogger("radixrt.server")

DISCONNECT_POLL_S = 0.2  # pause between unexpected ASGI messages while awaiting a disconnect


class ClientDisconnected(Exception):
    """The HTTP client of a non-streaming request went away."""


async def next_within(queue: asyncio.Queue, timeout_s: float) -> Any:
    """The queue's next item, or `asyncio.TimeoutError` after `timeout_s`. On Python 3.11+
    through `asyncio.timeout` (no task per call: `wait_for` there wraps the get in a new task,
    ~16 against ~9 us an item, once per streamed chunk)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    return await asyncio.wait_for(queue.get(), timeout=timeout_s)


class RequestGroup:
    """All samples of one HTTP request (prompts × n), read from one shared queue."""

    def __init__(self, server: Server, ids_list: list[list[int]], params: list[SamplingParams],
                 stream: bool):
        self.server = server
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        # Non-streamed samples are read only once finished: a dead --dp replica's re-run them.
        self.states: list[ReqState] = [
            server.engine.submit(ids, sp, loop=loop, queue=self.queue, stream=stream)
            for ids, sp in zip(ids_list, params, strict=True)]
        self.index = {st.rid: i for i, st in enumerate(self.states)}
        self.start = time.monotonic()
        self.last_token: dict[int, float] = {}
        self.finished: set[int] = set()

    async def events(self) -> AsyncIterator[tuple[int, ReqTextOut]]:
        """(sample index, output) until every sample finished; raises EngineDeadError."""
        m = self.server.metrics
        while len(self.finished) < len(self.states):
            try:
                item = await next_within(self.queue, 1.0)
            except asyncio.TimeoutError:
                self.server.engine.check_alive()
                continue
            if isinstance(item, BaseException):
                raise item
            i = self.index.get(item.rid)
            if i is None:
                continue
            t = time.monotonic()
            if item.new_ids:
                prev = self.last_token.get(i)
                if prev is None:
                    m.ttft.observe(t - self.start)
                else:
                    gap = (t - prev) / len(item.new_ids)
                    for _ in item.new_ids:
                        m.itl.observe(gap)
                self.last_token[i] = t
            if item.finish_reason is not None:
                self.finished.add(i)
                m.e2e.observe(t - self.start)
                st = self.states[i]
                ttft = (st.first_token_time - st.created) if st.first_token_time else float("nan")
                logger.info("finished %s: prompt=%d cached=%d generated=%d finish=%s ttft=%.3fs "
                            "latency=%.3fs%s", item.rid, st.prompt_tokens, item.cached_tokens,
                            item.completion_tokens, item.finish_reason, ttft, t - self.start,
                            f" error={item.error}" if item.error else "")
            yield i, item

    def abort_unfinished(self) -> None:
        for i, st in enumerate(self.states):
            if i not in self.finished:
                self.server.engine.abort(st.rid)

    async def abort_on_disconnect(self, request: Request) -> None:
        """Until cancelled: once the client is gone, end `events` with `ClientDisconnected`
        (the caller then aborts every unfinished sample)."""
        # The body is read already, so the next ASGI message is the disconnect (a blocking
        # receive: Starlette's `is_disconnected()` polls one that never completes here).
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.queue.put_nowait(ClientDisconnected())


@dataclasses.dataclass
class ChatRun:
    """A started chat request: its samples (`group`, n per prompt) and each sample's reader of
    tool calls (None: no tools, or `tool_choice: "none"`)."""

    group: RequestGroup
    calls: list[T.ToolCallStream | None]
    n: int
    stream: bool
    include_usage: bool

    def finish_reason(self, i: int, reason: str | None) -> str | None:
        """Sample i's API finish reason (`tool_calls` when it stopped after calling)."""
        ts = self.calls[i]
        return reason if ts is None else ts.finish_reason(reason)


class Server:
    def __init__(self, engine: Engine, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.model_name = args.served_model_name or os.path.basename(
            str(engine.info["model_path"]).rstrip("/"))
        self.metrics = ServerMetrics(engine.stats)
        self.text = P.TokenText(engine.tokenizer)
        self.created = P.now()
        self.response_store = R.ResponseStore(args.responses_store_size)
        template = getattr(engine.tokenizer, "chat_template", None)
        self.tool_parser = T.parser_class(args.tool_call_parser, template)
        self.keep_specials, self.remove_specials = T.kept_specials(
            self.tool_parser, list(getattr(engine.tokenizer, "all_special_tokens", []) or []))

    def model_card(self) -> dict[str, Any]:
        """The served model as `/v1/models` lists it (one, whatever `--dp` says)."""
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "radixrt", "max_model_len": self.engine.max_context_len}

    # -- request checks -------------------------------------------------------------------------
    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in (self.model_name, "default"):
            raise P.ApiError(404, f"the model '{model}' does not exist; this server serves "
                                  f"'{self.model_name}'", param="model",
                             type="invalid_request_error", code="model_not_found")

    def check_capacity(self, n: int) -> None:
        outstanding = self.engine.num_outstanding()
        limit = self.args.max_running_requests * self.args.dp + self.args.max_queued_requests
        if outstanding + n > limit:
            raise P.ApiError(429, f"server overloaded: {outstanding} requests in flight, the "
                                  f"queue holds {limit}; retry later", type="rate_limit_error",
                             code="queue_full", headers={"Retry-After": "1"})

    def check_alive(self) -> None:
        try:
            self.engine.check_alive()
        except EngineDeadError as e:
            raise P.unavailable(e) from None

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """Vocabulary and prompt-length checks; both name `param` (the prompt's API field)."""
        try:
            return self.engine.check_input_ids(ids, ids_field=param, prompt_field=param)
        except InvalidRequestError as e:
            raise P.invalid(e) from None

    def tool_sampling(self, sp: SamplingParams, treq: T.ToolRequest | None) -> SamplingParams:
        """`required` / a named function: the grammar (`json_schema`); `auto` with a parser
        whose markers are special tokens: keep special tokens in the text."""
        if treq is None or treq.choice == "none":
            return sp
        if treq.constrained:
            if any(getattr(sp, f, None) for f in ("json_schema", "regex", "ebnf")):
                raise P.bad("tool_choice", f"'tool_choice': {treq.choice!r} is enforced by a "
                                           "grammar and cannot be combined with "
                                           "'response_format', 'regex' or 'ebnf'")
            sp = dataclasses.replace(sp, json_schema=treq.grammar_schema())
            try:
                check_params(sp)
            except InvalidRequestError as e:  # a tool's parameters the grammar cannot enforce
                raise P.bad("tools", f"tool_choice {treq.choice!r} needs the tools' "
                                     f"parameters as a grammar: {e}") from None
            return sp
        if self.keep_specials:
            return dataclasses.replace(sp, skip_special_tokens=False)
        return sp

    def tool_stream(self, treq: T.ToolRequest | None) -> T.ToolCallStream | None:
        """One choice's reader of tool calls (None: no tools, or `none`: the text is content)."""
        parser = treq.parser(self.tool_parser) if treq is not None else None
        if treq is None or parser is None:
            return None
        remove = self.remove_specials if treq.choice == "auto" else ()
        return T.ToolCallStream(parser, treq.parallel, remove)

    @staticmethod
    def per_sample(sp: SamplingParams, n: int) -> list[SamplingParams]:
        """n samples of one prompt; with a seed, sample i uses seed + i so they differ."""
        if n == 1:
            return [sp]
        out = []
        for i in range(n):
            d = sp.to_dict()
            if sp.seed is not None:
                d["seed"] = sp.seed + i
            out.append(SamplingParams(**d))
        return out

    # -- endpoints ------------------------------------------------------------------------------
    async def completions(self, body: dict[str, Any], request: Request | None = None) -> Response:
        self.check_model(body)
        P.check_fields(body, api_fields.COMPLETIONS)
        prompts = P.prompts_from(body)
        n = P.n_from(body)
        stream, include_usage = P.stream_opts(body)
        echo = P._get(body, "echo", (bool,), False, "a boolean")
        top_lp = P._get(body, "logprobs", (int,), None, "an integer in 0..20")
        if top_lp is not None and not 0 <= top_lp <= 20:
            raise P.bad("logprobs", f"'logprobs' must be in 0..20, got {top_lp}")
        if P._get(body, "suffix", (str,), None, "a string"):
            raise P.bad("suffix", "'suffix' is not supported")
        # echo + logprobs: the logprobs cover the prompt too (scored by the runtime from prompt
        # position 0, served from the radix cache where a cached prefix holds them).
        score_prompt = echo and top_lp is not None
        ids_list = [self.check_ids(self.engine.tokenize(p) if isinstance(p, str) else p,
                                   "prompt") for p in prompts]
        params: list[SamplingParams] = []
        for ids in ids_list:
            mt = P.max_tokens_from(body, ("max_tokens",), 16, len(ids), self.engine.max_context_len,
                                   "prompt", zero_ok=echo)
            # max_tokens 0 without logprobs needs a scored position too (the runtime generates
            # nothing only for scoring requests): the last one, whose scores are dropped.
            start = 0 if score_prompt else (len(ids) - 1 if mt == 0 else -1)
            sp = P.sampling_from_body(body, mt, top_lp is not None, top_lp or 0, start,
                                      self.engine.vocab_size)
            params.extend(self.per_sample(sp, n))
        all_ids = [ids for ids in ids_list for _ in range(n)]
        self.check_alive()
        self.check_capacity(len(all_ids))
        group = RequestGroup(self, all_ids, params, stream)
        rid, created = P.new_id("cmpl"), P.now()
        # The echoed prompt: as sent, or the token ids decoded (special tokens kept).
        prompt_texts = [p if isinstance(p, str) else self.engine.tokenizer.decode(p)
                        for p in prompts]

        def prompt_lp(i: int, lp: TokenLogprobs | None) -> dict[str, Any] | None:
            """Sample i's prompt part of `logprobs` (None: the runtime sent no scores, which
            only happens to a request that failed)."""
            if lp is None:
                return None
            return self.text.prompt_logprobs(all_ids[i], lp, prompt_texts[i // n])

        chunk = self.sse_chunk(rid, "text_completion", created, include_usage)

        if stream:
            async def gen() -> AsyncIterator[bytes]:
                offsets = [len(prompt_texts[i // n]) if echo else 0 for i in range(len(all_ids))]
                # With prompt scores a sample's first chunk (prompt text + its logprobs) waits
                # for the runtime's first out, which carries them; outs are held until then.
                unscored = set(range(len(all_ids))) if score_prompt else set()
                held: dict[int, list[ReqTextOut]] = {}
                if echo and not score_prompt:
                    yield chunk([{"index": i, "text": prompt_texts[i // n], "logprobs": None,
                                  "finish_reason": None} for i in range(len(all_ids))])
                async for i, out in group.events():
                    outs = [out]
                    if i in unscored:
                        if out.prompt_logprobs is None and out.finish_reason is None:
                            held.setdefault(i, []).append(out)
                            continue
                        unscored.discard(i)
                        yield chunk([{"index": i, "text": prompt_texts[i // n],
                                      "logprobs": prompt_lp(i, out.prompt_logprobs),
                                      "finish_reason": None}])
                        outs = held.pop(i, []) + outs
                    for o in outs:
                        lp = self.text.completion_logprobs(o.new_ids, o.logprobs, offsets[i])
                        offsets[i] += len(o.text_delta)
                        if o.text_delta or lp or o.finish_reason:
                            yield chunk([{"index": i, "text": o.text_delta, "logprobs": lp,
                                          "finish_reason": o.finish_reason}])

            return self.sse(group, n, gen(), chunk, include_usage)

        results = await self.collect(group, request)
        choices = []
        for i, (st, lp) in enumerate(results):
            prefix = prompt_texts[i // n] if echo else ""
            logprobs = self.text.completion_logprobs(st.token_ids, lp, len(prefix))
            if score_prompt:
                head = prompt_lp(i, st.prompt_logprobs)
                if head is None:
                    raise P.ApiError(500, "the runtime returned no prompt scores",
                                     type="internal_error")
                logprobs = self.text.join(head, logprobs)
            choices.append({"index": i, "text": prefix + st.text, "logprobs": logprobs,
                            "finish_reason": st.finish_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": self.model_name, "choices": choices,
                             "usage": self.usage(group, n)})

    def start_chat(self, body: dict[str, Any]) -> ChatRun:
        """Checks a chat request, submits its samples and gives their tool-call readers; every
        error before submission is an ApiError naming the chat field."""
        self.check_model(body)
        P.check_fields(body, api_fields.CHAT)
        treq = T.tool_request_from(body)
        messages = P.messages_from(body)
        n = P.n_from(body)
        stream, include_usage = P.stream_opts(body)
        want_lp = P._get(body, "logprobs", (bool,), False, "a boolean")
        top_lp = P._get(body, "top_logprobs", (int,), 0, "an integer in 0..20")
        if top_lp and not want_lp:
            raise P.bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        if not 0 <= top_lp <= 20:
            raise P.bad("top_logprobs", f"'top_logprobs' must be in 0..20, got {top_lp}")
        messages, template_tools = T.prompt_messages(messages, treq,
                                                     self.engine.template_takes_tools())
        options = P.template_options(body)
        try:
            ids = self.engine.apply_chat_template(messages, template_tools, **options)
        except InvalidRequestError as e:
            raise P.invalid(e) from None
        except Exception as e:  # template errors (e.g. roles the template rejects)
            raise P.bad("messages", f"chat template failed: {e}") from None
        self.check_ids(ids, "messages")
        mt = P.max_tokens_from(body, ("max_completion_tokens", "max_tokens"), None, len(ids),
                               self.engine.max_context_len, "messages")
        sp = self.tool_sampling(P.sampling_from_body(body, mt, want_lp, top_lp,
                                                     vocab_size=self.engine.vocab_size), treq)
        params = self.per_sample(sp, n)
        self.check_alive()
        self.check_capacity(n)
        group = RequestGroup(self, [ids] * n, params, stream)
        return ChatRun(group, [self.tool_stream(treq) for _ in range(n)], n, stream,
                       include_usage)

    def chat_deltas(self, run: ChatRun, i: int, out: ReqTextOut,
                    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Sample i's chat deltas for one runtime output (content, or tool calls through its
        reader, which is finished with the sample) and the output's chat logprobs."""
        lp = (self.text.chat_logprobs(out.new_ids, out.logprobs)
              if out.logprobs is not None else None)
        ts = run.calls[i]
        if ts is None:
            return ([{"content": out.text_delta}] if out.text_delta or lp is not None else []), lp
        deltas = ts.feed(out.text_delta)
        if out.finish_reason is not None:
            deltas += ts.finish()
        return deltas, lp

    async def chat(self, body: dict[str, Any], request: Request | None = None) -> Response:
        run = self.start_chat(body)
        group, n, include_usage = run.group, run.n, run.include_usage
        rid, created = P.new_id("chatcmpl"), P.now()
        chunk = self.sse_chunk(rid, "chat.completion.chunk", created, include_usage)

        if run.stream:
            async def gen() -> AsyncIterator[bytes]:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for i in range(n)])
                async for i, out in group.events():
                    deltas, lp = self.chat_deltas(run, i, out)
                    if lp is not None and not deltas:
                        deltas = [{}]
                    for k, delta in enumerate(deltas):
                        yield chunk([{"index": i, "delta": delta,
                                      "logprobs": lp if k == 0 else None,
                                      "finish_reason": None}])
                    if out.finish_reason is not None:
                        yield chunk([{"index": i, "delta": {}, "logprobs": None,
                                      "finish_reason": run.finish_reason(i, out.finish_reason)}])

            return self.sse(group, n, gen(), chunk, include_usage)

        results = await self.collect(group, request)
        choices = []
        for i, (st, lp) in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": st.text}
            ts = run.calls[i]
            if ts is not None:
                ts.feed(st.text)
                ts.finish()
                message = ts.message()
            choices.append({"index": i, "message": message,
                            "logprobs": self.text.chat_logprobs(st.token_ids, lp),
                            "finish_reason": run.finish_reason(i, st.finish_reason)})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": self.model_name, "choices": choices,
                             "usage": self.usage(group, n)})

    async def responses(self, body: dict[str, Any], request: Request | None = None) -> Response:
        """`POST /v1/responses`: the request runs as a chat request (radixrt/server/
        responses.py); a stored response is kept once it finished."""
        self.check_model(body)
        P.check_fields(body, api_fields.RESPONSES)
        rq = R.parse_request(body, self.response_store)
        try:
            run = self.start_chat({**rq.chat_body, "stream": rq.stream})
        except P.ApiError as e:
            raise R.as_responses_error(e) from None
        b = R.ResponseBuilder(self.model_name, rq.echo)

        def finish(reason: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            final, events = b.finish(run.finish_reason(0, reason), self.usage(run.group, 1))
            if rq.store:
                self.response_store.put(final, rq.history + [b.assistant_message()], rq.items)
            return final, events

        if rq.stream:
            async def gen() -> AsyncIterator[bytes]:
                try:
                    for ev in b.start():
                        yield R.sse_event(ev)
                    async for i, out in run.group.events():
                        deltas, lp = self.chat_deltas(run, i, out)
                        tokens = lp["content"] if lp is not None else None
                        if tokens and not deltas:
                            deltas = [{}]
                        for k, delta in enumerate(deltas):
                            for ev in b.delta(delta, tokens if k == 0 else None):
                                yield R.sse_event(ev)
                        if out.finish_reason is not None:
                            for ev in finish(out.finish_reason)[1]:
                                yield R.sse_event(ev)
                except EngineDeadError as e:
                    yield R.sse_event(b.error_event(P.unavailable(e)))
                except P.ApiError as e:
                    yield R.sse_event(b.error_event(e))
                finally:
                    run.group.abort_unfinished()

            return StreamingResponse(gen(), media_type="text/event-stream")

        (st, lp), = await self.collect(run.group, request)
        ts = run.calls[0]
        deltas = ts.feed(st.text) + ts.finish() if ts is not None else [{"content": st.text}]
        chat_lp = self.text.chat_logprobs(st.token_ids, lp)  # None unless asked for
        for k, delta in enumerate(deltas):
            b.delta(delta, chat_lp["content"] if chat_lp is not None and k == 0 else None)
        return JSONResponse(finish(st.finish_reason)[0])

    # -- tokenizer endpoints (server root, as vLLM / SGLang; lm-eval's remote tokenizer) --------
    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.engine.tokenizer
        template = getattr(tok, "chat_template", None)

        def token(name: str) -> str | None:
            v = getattr(tok, name, None)
            return v if isinstance(v, str) else None

        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": token("eos_token"), "bos_token": token("bos_token"),
            "pad_token": token("pad_token"), "unk_token": token("unk_token"),
            "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
            "pad_token_id": tok.pad_token_id,
            "chat_template": template if isinstance(template, str | dict) else None,
            "model_max_length": self.engine.max_context_len,
            "max_model_len": self.engine.max_context_len,
            "vocab_size": self.engine.vocab_size,
        }

    async def tokenize(self, body: dict[str, Any], request: Request | None = None) -> Response:
        """`{"prompt": str, "add_special_tokens": bool = true}` → `{"tokens", "count",
        "max_model_len"}`. Special-token text ("<|im_end|>") maps to its one id."""
        self.check_model(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise P.bad("prompt", f"'prompt' must be a string, got {type(prompt).__name__}")
        special = P._get(body, "add_special_tokens", (bool,), True, "a boolean")
        ids = await run_in_threadpool(self.engine.tokenizer.encode, prompt,
                                      add_special_tokens=special)
        return JSONResponse({"tokens": list(ids), "count": len(ids),
                             "max_model_len": self.engine.max_context_len})

    async def detokenize(self, body: dict[str, Any], request: Request | None = None) -> Response:
        """`{"tokens": [int, ...]}` → `{"prompt": str}`; special tokens are kept."""
        self.check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise P.bad("tokens", "'tokens' must be a list of token ids")
        vocab = self.engine.vocab_size
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise P.bad("tokens", f"token id {outside[0]} is outside the vocabulary "
                                  f"[0, {vocab})")
        try:
            text = await run_in_threadpool(self.engine.tokenizer.decode, ids)
        except Exception as e:  # ids the tokenizer itself cannot decode
            raise P.bad("tokens", f"cannot decode 'tokens': {e}") from None
        return JSONResponse({"prompt": text})

    async def collect(self, group: RequestGroup, request: Request | None = None,
                      ) -> list[tuple[ReqState, TokenLogprobs | None]]:
        """Wait for every sample of a non-streaming request. If the client disconnects first,
        every unfinished sample is aborted (as a dropped stream's are)."""
        watcher = (asyncio.create_task(group.abort_on_disconnect(request))
                   if request is not None else None)
        try:
            async for _ in group.events():
                pass
        except EngineDeadError as e:
            raise P.unavailable(e) from None
        except ClientDisconnected:
            logger.info("client disconnected: aborting %d unfinished sample(s)",
                        len(group.states) - len(group.finished))
            raise P.ApiError(499, "client closed the connection", type="invalid_request_error",
                             code="client_disconnected") from None
        finally:
            if watcher is not None:
                watcher.cancel()
            group.abort_unfinished()
        errors = [st.error for st in group.states if st.error]
        if errors:
            raise P.ApiError(500, errors[0], type="internal_error")
        return [(st, st.logprobs) for st in group.states]

    @staticmethod
    def usage(group: RequestGroup, n: int) -> dict[str, Any]:
        """Prompt tokens count once per prompt (its first sample); completions for every sample."""
        firsts = group.states[::n]
        return P.usage(sum(s.usage.prompt_tokens for s in firsts),
                       sum(s.usage.completion_tokens for s in group.states),
                       sum(s.usage.cached_tokens for s in firsts))

    def sse(self, group: RequestGroup, n: int, chunks: AsyncIterator[bytes],
            chunk: Any, include_usage: bool) -> StreamingResponse:
        """SSE framing shared by both endpoints: the endpoint's chunks, the usage chunk, an error
        event if the runtime dies, then `[DONE]`; unfinished samples are aborted when the stream
        ends early (client disconnected)."""
        async def framed() -> AsyncIterator[bytes]:
            try:
                async for data in chunks:
                    yield data
                if include_usage:
                    yield chunk([], self.usage(group, n))
            except EngineDeadError as e:
                yield self.sse_error(P.unavailable(e))
            except P.ApiError as e:
                yield self.sse_error(e)
            finally:
                group.abort_unfinished()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(framed(), media_type="text/event-stream")

    def sse_chunk(self, rid: str, kind: str, created: int,
                  include_usage: bool) -> Callable[..., bytes]:
        """`chunk(choices, usage=None)`: one SSE event of a stream's `kind` object (the
        `usage` key present exactly when the request asked for usage)."""
        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            obj = {"id": rid, "object": kind, "created": created,
                   "model": self.model_name, "choices": choices}
            if include_usage:
                obj["usage"] = usage
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        return chunk

    @staticmethod
    def sse_error(err: P.ApiError) -> bytes:
        return b"data: " + orjson.dumps(err.body()) + b"\n\n"


def create_app(engine: Engine, args: ServerArgs) -> FastAPI:
    server = Server(engine, args)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        """While the app serves, the engine's outputs are read on its event loop."""
        engine.receive_on(asyncio.get_running_loop())
        try:
            yield
        finally:
            engine.receive_on(None)

    app = FastAPI(title="radixrt", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = server

    add_guard(app, args.api_key, args.max_request_bytes)

    async def json_body(request: Request) -> dict[str, Any]:
        return (await read_json_body(request, args.max_request_bytes))[1]

    def json_route(fn: Any) -> Any:
        """The endpoint of a POST route whose JSON object body goes to `fn(body, request)`;
        an ApiError from either becomes its OpenAI-style error response."""

        async def endpoint(request: Request) -> Response:
            try:
                return await fn(await json_body(request), request)
            except P.ApiError as e:
                return error_response(e)

        return endpoint

    # Tokenizer endpoints at the root (lm-eval's `tokenizer_backend=remote` strips
    # /v1/completions from base_url); behind the API key like everything but /health, /metrics.
    for path, fn in (("/v1/completions", server.completions), ("/v1/chat/completions", server.chat),
                     ("/v1/responses", server.responses),
                     ("/tokenize", server.tokenize), ("/detokenize", server.detokenize)):
        app.post(path, name=fn.__name__)(json_route(fn))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        """A stored response (the openai SDK's `responses.retrieve`)."""
        try:
            return JSONResponse(server.response_store.get(response_id))
        except P.ApiError as e:
            return error_response(e)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> Response:
        """A stored response's input items, a page at a time (`responses.input_items.list`:
        `after`, `limit`, `order`; `include` adds nothing here, so it is refused)."""
        q = request.query_params
        try:
            if q.getlist("include") or q.getlist("include[]"):
                raise P.bad("include", "'include' is not supported on input items",
                            code="unsupported_parameter")
            limit = q.get("limit", "20")
            if not limit.isdigit():
                raise P.bad("limit", f"'limit' must be an integer in 1..100, got {limit!r:.20}")
            return JSONResponse(server.response_store.input_items(
                response_id, q.get("after"), int(limit), q.get("order", "desc")))
        except P.ApiError as e:
            return error_response(e)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        """Forget a stored response (`responses.delete`); later uses of its id are 404/400."""
        try:
            server.response_store.delete(response_id)
        except P.ApiError as e:
            return error_response(e)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return JSONResponse(server.tokenizer_info())

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """The openai SDK's `models.retrieve(id)`: the served model by its name (or `default`,
        as every request's `model` may say); any other id is a 404 `model_not_found`."""
        try:
            server.check_model({"model": model_id})
        except P.ApiError as e:
            return error_response(e)
        return JSONResponse(server.model_card())

    @app.get("/health")
    async def health() -> Response:
        """200 while the runtime serves (with `--dp`, while one replica lives), with the
        requests it runs at once (`max_running_requests`, over its live replicas: what
        `radixrt router` takes as its capacity) and, with `--dp`, the dead replicas."""
        try:
            server.check_alive()
            dead = engine.dead_replicas() if engine.dp > 1 else {}
        except (P.ApiError, EngineDeadError) as e:
            return error_response(e if isinstance(e, P.ApiError) else P.unavailable(e))
        body: dict[str, Any] = {"status": "ok", "max_running_requests":
                                args.max_running_requests * (engine.dp - len(dead))}
        if engine.dp > 1:
            body["dead_replicas"] = {str(i): e for i, e in dead.items()}
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            server.check_alive()
            body = await run_in_threadpool(server.metrics.render)
        except (P.ApiError, EngineDeadError) as e:
            return error_response(e if isinstance(e, P.ApiError) else
                                  P.ApiError(503, str(e), type="service_unavailable"))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        server.check_alive()
        if await run_in_threadpool(engine.flush_cache):
            return JSONResponse({"success": True})
        return error_response(P.ApiError(409, "cannot flush the cache while requests are "
                                              "running or waiting", code="busy"))

    @app.get("/debug/check_invariants")
    async def check_invariants() -> Response:
        """Pool and radix-tree consistency (no leaked or doubly owned KV slot)."""
        server.check_alive()
        try:
            await run_in_threadpool(engine.check_invariants)
        except InvariantError as e:
            return JSONResponse({"ok": False, "error": str(e)}, status_code=500)
        return JSONResponse({"ok": True})

    @app.get("/cache/evictions")
    async def cache_evictions(since: int = 0) -> Response:
        """Prefixes the radix cache(s) evicted from sequence number `since` on, for
        `radixrt router` (README "Scaling out"): `{"epoch", "next_seq", "prefixes", "lost"}`."""
        ev = engine.evictions_since(since)
        return JSONResponse({"epoch": ev.epoch, "next_seq": ev.next_seq,
                             "prefixes": ev.prefixes, "lost": ev.lost})

    @app.get("/get_server_info")
    async def server_info() -> Response:
        """What this server resolved at start-up (SGLang's endpoint name): `server_args` as
        given (API keys redacted) and `engine`, `Engine.info` (the dtype and quantization `auto`
        chose and the probe figures behind them, pool sizes, threads)."""
        server.check_alive()
        given = {k: ("<redacted>" if "api_key" in k and v else v)
                 for k, v in dataclasses.asdict(args).items()}
        return Response(orjson.dumps({"server_args": given, "engine": engine.info},
                                     default=str, option=orjson.OPT_SERIALIZE_NUMPY),
                        media_type="application/json")

    @app.get("/debug/stats")
    async def stats() -> Response:
        server.check_alive()
        return JSONResponse(await run_in_threadpool(engine.stats))

    return app


def serve(args: ServerArgs) -> int:
    """Start the runtime and serve until SIGINT/SIGTERM; then stop every process."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s http pid={os.getpid()}] %(message)s")
    engine = Engine(args)
    # This process only parses, tokenizes and streams; its children already run at their own
    # priority (a child inherits its parent's niceness at spawn, so this comes after them).
    cpu_policy.become_helper(args.helper_nice)

    def stop(sig: int, frame: object) -> None:
        raise _Stop(sig)

    # uvicorn drains in-flight requests on SIGINT/SIGTERM (up to 5 s), restores these handlers
    # and re-raises the signal: ours turns it into a clean return, so the children are stopped
    # and the socket dir removed before the process exits with status 0.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        app = create_app(engine, args)
        logger.info("serving %s on http://%s:%d", app.state.server.model_name, args.host,
                    args.port)
        logger.info("tool calls: %s parser; tools %s", app.state.server.tool_parser.name,
                    "through the chat template" if engine.template_takes_tools()
                    else "in the fallback system block")
        loop, parser = asgi_stack()
        logger.info("http: %s event loop, %s parser", loop, parser)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                    timeout_graceful_shutdown=5, access_log=False, loop=loop, http=parser)
    except _Stop as e:
        logger.info("stopping on signal %d", e.args[0])
    finally:
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def asgi_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools where installed (project
    dependencies; less CPU per streamed chunk than asyncio's loop and h11), else those."""
    have = importlib.util.find_spec
    return ("uvloop" if have("uvloop") else "asyncio", "httptools" if have("httptools") else "h11")


class _Stop(Exception):
    pass
