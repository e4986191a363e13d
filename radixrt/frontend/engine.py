"""`Engine`: the Python API over the three-process runtime, and the narrow API the HTTP server
uses (`submit` / `abort` / `num_outstanding` / `check_alive`, the input helpers, `info`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from radixrt.config import ServerArgs
from radixrt.core.errors import EngineDeadError, InvalidRequestError, InvariantError
from radixrt.core.messages import CheckInvariantsReq, FlushCacheReq, ReqTextOut, StatsReq
from radixrt.core.sampling_params import SamplingParams
from radixrt.frontend.launcher import Launcher
from radixrt.model.loader import default_model_path
from radixrt.model.tokenizer import load_tokenizer
from radixrt.routing.eviction_log import EvictionSlice
from radixrt.routing.policy import policy_from_args
from tokenizer_proc.input_processor import InputProcessor, ParamsLike
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.request_state import GenerateOutput, ReqState, StreamChunk

__all__ = ["Engine", "EngineDeadError", "GenerateOutput", "ParamsLike", "ReqState",
           "StreamChunk"]


class Engine:
    """`Engine(**fields of ServerArgs)` or `Engine(args=ServerArgs(...))`. Use as a context
    manager (or call `shutdown`) so the child processes stop with it."""

    def __init__(self, args: ServerArgs | None = None, **kwargs: Any):
        if args is not None and kwargs:
            raise TypeError("pass either args=ServerArgs(...) or keyword fields, not both")
        args = args or ServerArgs(**kwargs)
        model_path = args.model_path or str(default_model_path())
        self.args = args.replace(model_path=model_path)
        self.launcher = Launcher(self.args)
        self._tm = TokenizerManager(
            self.launcher.paths, self.launcher.dead_child, self.launcher.replica_paths,
            dead_replicas=self.launcher.dead_replicas if args.dp > 1 else None,
            on_lost=self.launcher.stop_replica)
        self._closed = False
        self.dp = self.args.dp
        try:
            self.info: dict[str, Any] = self._start_replicas()
        except BaseException:
            self.shutdown()
            raise
        self.info["dp"] = self.dp
        if self.dp > 1:
            # Each replica's tree is bounded by its own KV pool unless configured otherwise.
            policy = policy_from_args(self.args, range(self.dp),
                                      tree_tokens=self.info["max_total_tokens"])
            for i in range(self.dp):
                policy.set_capacity(i, self.args.max_running_requests)
            self._tm.set_policy(policy)
            self.info["routing_policy"] = self.args.routing_policy
            self.info["replicas"] = [{"threads": t, "cpus": c} for t, c in self.launcher.plan]
        self._tm.start()
        self.max_context_len: int = self.info["max_context_len"]
        self.vocab_size: int = self.info["vocab_size"]
        self._inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_context_len)

    def _start_replicas(self) -> dict[str, Any]:
        """Start the children and load this process's tokenizer while they start up (each
        imports torch and loads the model: seconds); returns replica 0's info. With
        `dtype="auto"` and several replicas, replica 0 starts alone and the others take the dtype
        its probe chose (every replica must compute in the same dtype, whatever the probe's
        timing noise)."""
        together = self.dp == 1 or self.args.dtype != "auto"
        self.launcher.start(None if together else [0])
        self.tokenizer = load_tokenizer(self.args.model_path, self.args.tokenizer_path)
        if together:
            return self._tm.wait_ready(Launcher.expected_ready(self.dp))
        info = self._tm.wait_ready(Launcher.expected_ready(1))
        self.launcher.start(range(1, self.dp), dtype=str(info["dtype"]).removeprefix("torch."))
        self._tm.wait_ready(Launcher.expected_ready(self.dp - 1))
        return info

    # -- input preparation (shared with the HTTP server) ---------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self._inputs.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None, **options: Any,
                            ) -> list[int]:
        """Token ids of a conversation; `tools` go to a template that takes them; `options`:
        `add_generation_prompt`, `continue_final_message`, `template_kwargs`
        (`InputProcessor.apply_chat_template`)."""
        return self._inputs.apply_chat_template(messages, tools, **options)

    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list."""
        return self._inputs.template_takes_tools()

    def check_input_ids(self, ids: Sequence[int], max_new_tokens: int = 1, *,
                        ids_field: str = "input_ids", prompt_field: str = "prompt",
                        budget_field: str = "max_new_tokens") -> list[int]:
        """Vocabulary and context-length checks; `InvalidRequestError` names the field."""
        return self._inputs.check_ids(ids, max_new_tokens, ids_field=ids_field,
                                      prompt_field=prompt_field, budget_field=budget_field)

    def validate_input_ids(self, ids: Sequence[int], sp: SamplingParams) -> list[int]:
        return self.check_input_ids(ids, sp.max_new_tokens)

    # -- the request API (what the HTTP server uses) -------------------------------------------
    def submit(self, input_ids: list[int], sampling: SamplingParams, *,
               loop: asyncio.AbstractEventLoop | None = None,
               queue: asyncio.Queue | None = None, stream: bool | None = None) -> ReqState:
        """Send one validated request; returns its handle (`ReqState`), filled as outputs
        arrive. With `loop`, each `ReqTextOut` (or the `EngineDeadError` that ended the runtime)
        is also put on `queue` (a new one unless given) on that loop. With `dp` > 1, a request
        whose replica dies runs again on a live one unless `stream` (default: a `loop` is
        given) and it already handed over an output."""
        return self._tm.submit(input_ids, sampling, loop=loop, queue=queue, stream=stream)

    def receive_on(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Read the runtime's outputs on `loop` (a server's event loop that submits with
        `loop=`), or on the receive thread again with None (`TokenizerManager.receive_on`)."""
        self._tm.receive_on(loop)

    def abort(self, rid: str) -> None:
        """Give up on a request: it is forgotten here and freed in the scheduler."""
        self._tm.abort(rid)

    def num_outstanding(self) -> int:
        """Requests submitted and neither finished nor aborted."""
        return self._tm.num_outstanding()

    def check_alive(self) -> None:
        """Raise `EngineDeadError` if a runtime process died."""
        self._tm.check_alive()

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: ParamsLike | list[ParamsLike] = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 use_tqdm: bool = True,
                 ) -> GenerateOutput | list[GenerateOutput]:
        """Blocking batch generation. A single prompt (str or one id list) returns one output.

        With more than one prompt a progress bar (finished requests, output tokens/s) is
        written to stderr unless `use_tqdm=False`.
        """
        ids_list, params, single = self._inputs.prepare(prompts, input_ids, sampling_params)
        states = [self.submit(ids, sp) for ids, sp in zip(ids_list, params, strict=True)]
        self._wait_all(states, show_progress=use_tqdm and len(states) > 1)
        outs = [st.result() for st in states]
        return outs[0] if single else outs

    def _wait_all(self, states: list[ReqState], show_progress: bool) -> None:
        """Block until every request finished; raise `EngineDeadError` if the runtime died."""
        from tqdm import tqdm

        bar = tqdm(total=len(states), desc="Generating", unit="req", disable=not show_progress,
                   dynamic_ncols=True)
        try:
            pending = list(states)
            start = time.monotonic()
            while pending:
                if not pending[0].done.wait(0.1 if show_progress else 0.5):
                    self.check_alive()
                still = [st for st in pending if not st.done.is_set()]
                if len(still) != len(pending):
                    bar.update(len(pending) - len(still))
                    pending = still
                    if show_progress:
                        out_toks = sum(st.completion_tokens for st in states)
                        rate = out_toks / max(time.monotonic() - start, 1e-9)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                if self._tm.dead_error is not None:
                    raise EngineDeadError(self._tm.dead_error)
        finally:
            bar.close()

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: ParamsLike | list[ParamsLike] = None, use_tqdm: bool = True,
             tools: list[dict[str, Any]] | None = None, *,
             add_generation_prompt: bool | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             ) -> GenerateOutput | list[GenerateOutput]:
        """One conversation (list of messages) or a list of conversations. `tools` (OpenAI
        function tools) are rendered by the chat template, which must take them (as vLLM's
        `LLM.chat`); the output is the generated text: reading tool calls out of it (and
        `tool_choice`) is the HTTP server's (`/v1/chat/completions`). The template options
        are vLLM's: `add_generation_prompt` (default: true unless `continue_final_message`),
        `continue_final_message`, `chat_template_kwargs` (extra template variables)."""
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise InvalidRequestError("tools", "must be a list of tool objects")
            if tools and not self.template_takes_tools():
                raise InvalidRequestError("tools", "this model's chat template does not render "
                                                   "tools (serve it and use "
                                                   "/v1/chat/completions, which also parses "
                                                   "the calls)")
        options = {"add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message,
                   "template_kwargs": chat_template_kwargs}
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            return self.generate(input_ids=[self.apply_chat_template(messages, tools, **options)],
                                 sampling_params=sampling_params)[0]  # type: ignore[index]
        return self.generate(input_ids=[self.apply_chat_template(m, tools, **options)
                                        for m in messages],
                             sampling_params=sampling_params, use_tqdm=use_tqdm)

    async def generate_stream(self, prompt: str | None = None, sampling_params: ParamsLike = None,
                              input_ids: list[int] | None = None) -> AsyncIterator[StreamChunk]:
        """Yields text deltas as they are produced; aborts the request if the consumer stops."""
        ids_list, params, _ = self._inputs.prepare(prompt, input_ids, sampling_params)
        state = self.submit(ids_list[0], params[0], loop=asyncio.get_running_loop(), stream=True)
        assert state.queue is not None
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(state.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    self.check_alive()
                    continue
                if isinstance(item, BaseException):
                    raise item
                out: ReqTextOut = item
                finished = out.finish_reason is not None
                yield state.chunk(out)
        finally:
            if not finished:
                self.abort(state.rid)

    # -- control -----------------------------------------------------------------------------------
    def _control_all(self, make: Any) -> list[Any]:
        """One control request per live replica (`make()` builds each), their replies in
        replica order."""
        return [self._tm.control(make(), replica=i) for i in self._tm.live_replicas()]

    def dead_replicas(self) -> dict[int, str]:
        """Replica -> why it died, for the `--dp` replicas that are gone (the others serve)."""
        self._tm.check_alive()
        return dict(self._tm.lost)

    def flush_cache(self) -> bool:
        """Drop every cached prefix (of every replica). Only possible when no request is running
        or waiting (a replica that is busy keeps its cache and the answer is False)."""
        return all(r.ok for r in self._control_all(lambda: FlushCacheReq(req_id=0)))

    def stats(self) -> dict[str, Any]:
        """Monotonic counters (requests, prompt/cached/generated tokens, retractions, evictions),
        current gauges (running, waiting, pool usage, evictable vs locked cache) and hit rate.
        With `dp` > 1: summed over the live replicas, plus `replicas` (each live one's stats),
        `routing` (every replica's routing counters) and `dead_replicas` (index -> why)."""
        per = [r.data for r in self._control_all(lambda: StatsReq(req_id=0))]
        if self.dp == 1:
            return per[0]
        out = merge_stats(per)
        out["routing"] = self.routing_stats()
        out["dead_replicas"] = {str(i): e for i, e in self._tm.lost.items()}
        out["retried_requests"] = self._tm.retried
        return out

    def routing_stats(self) -> list[dict[str, Any]]:
        """Per replica: requests routed, routed because its cache matched, prompt tokens routed
        and predicted cached, load (in flight), tokens in its routing tree. Empty with dp 1."""
        policy = self._tm.policy
        if policy is None:
            return []
        return [{**dataclasses.asdict(policy.stats[i]), "tree_tokens": policy.tree_tokens(i),
                 "alive": i not in self._tm.lost} for i in range(self.dp)]

    def evictions_since(self, seq: int) -> EvictionSlice:
        """Prefixes the runtime's caches evicted from sequence number `seq` on (for routers)."""
        return self._tm.eviction_log.since(seq)

    def check_invariants(self) -> None:
        """Raise `InvariantError` if any pool or the radix tree is inconsistent (slot leaks...)."""
        replies = self._control_all(lambda: CheckInvariantsReq(req_id=0))
        for i, reply in zip(self._tm.live_replicas(), replies, strict=True):
            if not reply.ok:
                raise InvariantError(reply.error if self.dp == 1 else
                                     f"replica {i}: {reply.error}")

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
        """Stop the children, close the sockets, remove the socket dir. Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._tm.close()  # first: a child stopped below is no death to report
        self.launcher.stop()
        self.launcher.remove_workdir()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


# Stats that are not sums over replicas.
_RATIOS = ("cache_hit_rate", "token_usage", "new_token_ratio", "spec_accept_rate")
# Per-replica figures that do not add up (kept only under `replicas`).
_PER_REPLICA = ("spec_step_ms", "spec_row_ms")


def merge_stats(per: list[dict[str, Any]]) -> dict[str, Any]:
    """One stats dict for several replicas: counters and sizes summed, step times summed per
    phase, ratios recomputed from the sums (`new_token_ratio`: the mean); `replicas` keeps each
    replica's own (and alone what does not add up: `decode_paths`, the speculative cost
    model's fit)."""
    out: dict[str, Any] = {}
    for key, value in per[0].items():
        if key in _RATIOS or key in _PER_REPLICA:
            continue
        if isinstance(value, dict):
            if all(isinstance(v, int | float) for v in value.values()):
                out[key] = {k: sum(p[key][k] for p in per) for k in value}
        elif isinstance(value, int | float):
            out[key] = sum(p[key] for p in per)
    prompt = out.get("prompt_tokens_total", 0)
    out["cache_hit_rate"] = out.get("cached_tokens_total", 0) / prompt if prompt else 0.0
    size = out.get("max_total_tokens", 0)
    out["token_usage"] = out.get("used_tokens", 0) / size if size else 0.0
    out["new_token_ratio"] = sum(p.get("new_token_ratio", 0.0) for p in per) / len(per)
    if "spec_draft_tokens_total" in out:
        drafted = out["spec_draft_tokens_total"]
        out["spec_accept_rate"] = out["spec_accepted_tokens_total"] / drafted if drafted else 0.0
    out["replicas"] = per
    return out
