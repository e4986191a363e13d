"""Tool calling against a live server with the real clients: the `openai` SDK, the OpenAI
Agents SDK (`OpenAIChatCompletionsModel` and its default `OpenAIResponsesModel`, a two-tool
agent loop to its final output) and LangChain's `ChatOpenAI.bind_tools` (chat completions and
`use_responses_api`).

The model is the tiny random Llama: it never calls a tool by itself. Every call here comes
from `tool_choice: "required"` or a named function, which the grammar enforces, so the calls
are valid because of the grammar, not luck: each generated argument string is checked
against its schema. Enum / bounded schemas keep the random model's outputs short.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from test_server import LiveServer, start_server, stop_server
from test_tools import TOOLS_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "maxLength": 8},
        "hours24": {"type": "boolean"}},
        "required": ["tz", "hours24"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def tools_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that takes `tools` (hermes-style markers), and a
    4096-token context: its byte-level vocabulary spends about a token per JSON character,
    and an agent's third turn carries both tools' schemas, two calls and their results."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_tools")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[LiveServer]:
    srv = start_server(str(tools_model_dir))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def fallback_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """The tiny model's own template, which takes no tools: the fallback block."""
    srv = start_server(str(tiny_llama_dir))
    yield srv
    stop_server(srv)


def check_call(name: str, arguments: str) -> dict[str, Any]:
    """A call names a tool and its arguments are JSON valid against that tool's schema."""
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


# -- openai SDK ----------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["server", "fallback_server"])
def test_required_call(which, request):
    srv: LiveServer = request.getfixturevalue(which)
    r = srv.client().chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)
    srv.assert_clean()


def test_named_call_streams_name_then_argument_fragments(server):
    c = server.client()
    kw = dict(model="default", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [t.function.name for t in whole.message.tool_calls] == ["get_time"]
    check_call("get_time", whole.message.tool_calls[0].function.arguments)

    deltas, finish = [], None
    for ev in c.chat.completions.create(stream=True, **kw):
        ch = ev.choices[0]
        deltas += ch.delta.tool_calls or []
        assert not ch.delta.content
        finish = ch.finish_reason or finish
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_time" and first.function.arguments == ""
    assert len(rest) > 1, "arguments arrive in fragments"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    args = "".join(d.function.arguments for d in rest)
    assert args == whole.message.tool_calls[0].function.arguments  # greedy: the same call
    assert finish == "tool_calls"


def test_parallel_calls_stream_with_indexes(server):
    stream = server.client().chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400,
        temperature=0, stream=True, n=2, seed=1)
    calls: dict[tuple[int, int], dict[str, str]] = {}
    finish = {}
    for ev in stream:
        for ch in ev.choices:
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    assert (ch.index, d.index) not in calls
                    assert d.index == sum(1 for c, _ in calls if c == ch.index)
                    calls[ch.index, d.index] = {"name": d.function.name, "args": ""}
                else:
                    calls[ch.index, d.index]["args"] += d.function.arguments
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert {c for c, _ in calls} == {0, 1}
    for (choice, _), call in calls.items():
        if finish[choice] == "tool_calls":  # a cut call ("length") may be incomplete
            check_call(call["name"], call["args"])
    assert set(finish.values()) <= {"tool_calls", "length"}


def test_history_round_trips_and_reuses_the_cache(server):
    c = server.client()
    first = c.chat.completions.create(model="default", messages=ASK, tools=TOOLS,
                                      tool_choice="required", parallel_tool_calls=False,
                                      max_tokens=200, temperature=0)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12 degrees"}]
    second = c.chat.completions.create(model="default", messages=history, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The tools and the question are the same prefix: served from the radix cache.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8


def test_developer_role_and_content_parts_equal_their_plain_forms(server):
    c = server.client()
    kw = dict(model="default", max_tokens=12, temperature=0)
    parts = c.chat.completions.create(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Answer "},
                                          {"type": "text", "text": "briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}], **kw)
    plain = c.chat.completions.create(messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi there"}], **kw)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
])
def test_bad_tool_input_is_a_400_naming_the_field(server, body, param):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=body.pop("messages", ASK),
                                  max_tokens=4, extra_body=body)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = c.chat.completions.create(model="default", messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


# -- OpenAI Agents SDK ---------------------------------------------------------------------------
def agent_setup(server: LiveServer, api: str,
                ) -> tuple[Any, list[tuple[str, dict]], list[dict[str, Any]]]:
    """A two-tool agent on the live server, through the SDK's chat-completions model class
    (`api` "chat") or its default, the Responses one ("responses": `/v1/responses`, each turn
    replaying the earlier turns' output items). The first turn must call a tool (`required`);
    a hook then names the other tool for the second turn and turns tools off (`none`) for
    the third, which writes the final answer. `reset_tool_choice=False` keeps the SDK from
    resetting the choice to `auto` after a tool call (it would with the default True)."""
    from agents import (
        Agent,
        AgentHooks,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[tuple[str, dict]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], unit: Literal["c", "f"]) -> str:
        """Current weather in a city."""
        calls.append(("get_weather", {"city": city, "unit": unit}))
        return f"12 degrees {unit} in {city}"

    @function_tool
    def get_time(tz: Literal["UTC", "CET", "PST"], hours24: bool) -> str:
        """Local time in a time zone."""
        calls.append(("get_time", {"tz": tz, "hours24": hours24}))
        return "14:05" if hours24 else "2:05 pm"

    tools = [get_weather, get_time]

    class Steer(AgentHooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: str) -> None:
            done = {name for name, _ in calls}
            left = [t.name for t in tools if t.name not in done]
            choice = left[0] if left else "none"
            # the last turn's answer is held to FINAL (the radixrt `regex` extra), so it ends
            # with the model's stop, not at max_tokens: the Responses model class raises on
            # an incomplete response, as OpenAI's API would make it
            extra = {"regex": FINAL} if choice == "none" else None
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=choice,
                                                       extra_body=extra)

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    sent: list[dict[str, Any]] = []  # every request body the SDK sent
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    agent = Agent(
        name="assistant", instructions="Use the tools, then answer.", tools=tools,
        model=(OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
            model="default", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                     temperature=0, max_tokens=200),
        reset_tool_choice=False, hooks=Steer())
    return agent, calls, sent


FINAL = r"It is (warm|cold) in Paris at [0-9]{1,2}:[0-9]{2}\."


def check_requests(api: str, sent: list[dict[str, Any]]) -> None:
    """Three turns, each on the endpoint `api` names; chained turns after the first send the
    previous response's id and only the tool result."""
    assert len(sent) == 3
    assert all(("messages" in b) == (api == "chat") for b in sent)
    if api == "responses-chained":
        assert "previous_response_id" not in sent[0]
        for b in sent[1:]:
            assert b["previous_response_id"].startswith("resp")
            assert [it["type"] for it in b["input"]] == ["function_call_output"]
    elif api == "responses":
        assert all("previous_response_id" not in b for b in sent)


def check_agent_run(agent: Any, calls: list[tuple[str, dict]], final: Any) -> None:
    from agents import FunctionTool

    schemas = {t.name: t.params_json_schema for t in agent.tools if isinstance(t, FunctionTool)}
    assert sorted(name for name, _ in calls) == ["get_time", "get_weather"]
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    assert isinstance(final, str) and re.fullmatch(FINAL, final), final  # the third turn


@pytest.mark.parametrize("api", ["chat", "responses", "responses-chained"])
def test_agents_sdk_two_tool_loop(server, api):
    """`responses-chained`: the SDK's response chaining (`auto_previous_response_id`): each
    turn sends only its new items (the tool results) with the previous response's id, and the
    server continues the conversation it stored."""
    from agents import Runner

    agent, calls, sent = agent_setup(server, api)
    result = asyncio.run(Runner.run(agent, "Weather and time in Paris?", max_turns=5,
                                    auto_previous_response_id=api == "responses-chained"))
    check_agent_run(agent, calls, result.final_output)
    assert agent.model_settings.tool_choice == "none"
    check_requests(api, sent)


@pytest.mark.parametrize("api", ["chat", "responses", "responses-chained"])
def test_agents_sdk_two_tool_loop_streamed(server, api):
    from agents import Runner

    agent, calls, sent = agent_setup(server, api)

    async def run() -> tuple[Any, list[str]]:
        result = Runner.run_streamed(agent, "Weather and time in Paris?", max_turns=5,
                                     auto_previous_response_id=api == "responses-chained")
        kinds = []
        async for ev in result.stream_events():
            if ev.type == "run_item_stream_event":
                kinds.append(ev.item.type)
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    check_agent_run(agent, calls, final)
    assert kinds.count("tool_call_item") == 2 and kinds.count("tool_call_output_item") == 2
    check_requests(api, sent)
    assert kinds[-1] == "message_output_item"


# -- LangChain -----------------------------------------------------------------------------------
def langchain_tools() -> list[Any]:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], unit: Literal["c", "f"]) -> str:
        """Current weather in a city."""
        return f"12 {unit}"

    @tool
    def get_time(tz: Literal["UTC", "CET", "PST"], hours24: bool) -> str:
        """Local time in a time zone."""
        return "14:05"

    return [get_weather, get_time]


def langchain_model(server: LiveServer, responses: bool = False) -> Any:
    """`ChatOpenAI` on the live server, through `/v1/chat/completions` or (`responses`)
    `/v1/responses` (`use_responses_api=True`)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="default",
                      temperature=0, max_tokens=200, max_retries=0,
                      use_responses_api=responses)


@pytest.mark.parametrize("responses", [False, True])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_langchain_bind_tools(server, choice, responses):
    from langchain_core.messages import HumanMessage, ToolMessage

    tools = langchain_tools()
    schemas = {t.name: t.tool_call_schema.model_json_schema() for t in tools}
    bound = langchain_model(server, responses).bind_tools(
        tools, tool_choice=choice, strict=True, parallel_tool_calls=False)
    msg = bound.invoke([HumanMessage("Weather and time in Paris?")])
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
    call = msg.tool_calls[0]
    assert choice == "required" or call["name"] == choice
    jsonschema.validate(call["args"], schemas[call["name"]])
    if responses:
        assert msg.response_metadata["status"] == "completed"
    else:
        assert msg.response_metadata["finish_reason"] == "tool_calls"

    full = None
    for chunk in bound.stream([HumanMessage("Weather and time in Paris?")]):
        full = chunk if full is None else full + chunk
    assert full is not None and full.tool_calls == [{**call, "id": full.tool_calls[0]["id"]}]

    # The call and its result go back as history (LangChain's ToolMessage → role "tool").
    tool_fn = {t.name: t for t in tools}[call["name"]]
    reply = langchain_model(server, responses).bind_tools(tools, tool_choice="none").invoke([
        HumanMessage("Weather and time in Paris?"), msg,
        ToolMessage(tool_fn.invoke(call["args"]), tool_call_id=call["id"])])
    end = reply.response_metadata["status" if responses else "finish_reason"]
    assert not reply.tool_calls
    assert end in (("completed", "incomplete") if responses else ("stop", "length"))


def test_engine_chat_renders_tools_through_the_template(tools_model_dir: Path,
                                                         tiny_llama_dir: Path) -> None:
    """`Engine.chat(..., tools=...)`: the template renders the tools (the prompt is the
    template's with them, longer than without), greedy text equal to generating from those
    ids; a template that does not take tools, or tools that are not a list of objects, is an
    error naming `tools` (never a silent drop)."""
    from radixrt import Engine, SamplingParams
    from radixrt.core.errors import InvalidRequestError

    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    with Engine(model_path=str(tools_model_dir), num_threads=1, dtype="float32",
                max_total_tokens=8192) as eng:
        ids = eng.apply_chat_template(ASK, TOOLS)
        assert len(ids) > len(eng.apply_chat_template(ASK)) + 20
        out = eng.chat(ASK, sp, tools=TOOLS)
        assert out.prompt_tokens == len(ids)
        assert out.token_ids == eng.generate(input_ids=ids, sampling_params=sp).token_ids
        many = eng.chat([ASK, ASK], sp, use_tqdm=False, tools=TOOLS)
        assert [o.token_ids for o in many] == [out.token_ids] * 2
        with pytest.raises(InvalidRequestError, match="tools"):
            eng.chat(ASK, sp, tools={"name": "f"})  # type: ignore[arg-type]
        eng.check_invariants()
    with Engine(model_path=str(tiny_llama_dir), num_threads=1, dtype="float32",
                max_total_tokens=2048) as plain:
        with pytest.raises(InvalidRequestError, match="does not render tools") as ei:
            plain.chat(ASK, sp, tools=TOOLS)
        assert ei.value.field == "tools"
