"""The Responses API (`/v1/responses`) driven by the `openai` SDK's own `responses` client
against the real app and a scripted engine (the "model" writes a fixed text in small pieces):
the translation onto the chat endpoint (what reaches the engine), the output items, the
stream's event sequence as the SDK's stream helper checks it, stored responses and
`previous_response_id`, and errors that name the Responses field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from test_tools_api import HERMES, ScriptedEngine

from radixrt.config import ServerArgs
from radixrt.server.http import create_app
from radixrt.server.protocol import ApiError
from radixrt.server.responses import (
    ResponseBuilder,
    ResponseStore,
    input_messages,
    responses_param,
)

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}},
         {"type": "function", "name": "get_time",
          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def client_for(engine: ScriptedEngine, **args: Any) -> tuple[openai.OpenAI, TestClient]:
    app = create_app(engine, ServerArgs(served_model_name="toy", **args))  # type: ignore[arg-type]
    http = TestClient(app)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                         http_client=http), http


def prompt_of(engine: ScriptedEngine, tokenizer: Any, k: int = -1) -> str:
    return tokenizer.decode(engine.submitted[k][0])


def test_text_response_and_what_reaches_the_engine(tokenizer):
    eng = ScriptedEngine(tokenizer, "Paris is the capital.", piece=4)
    c, _ = client_for(eng)
    r = c.responses.create(model="toy", input="Capital of France?", instructions="Be brief.",
                           max_output_tokens=50, temperature=0, top_p=0.5,
                           metadata={"trace": "t1"}, user="u1")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp")
    assert r.output_text == "Paris is the capital."
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [p.type for p in item.content] == ["output_text"]
    assert r.usage.input_tokens == len(eng.submitted[-1][0])
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.instructions == "Be brief." and r.metadata == {"trace": "t1"}
    assert r.max_output_tokens == 50 and r.temperature == 0 and r.top_p == 0.5
    ids, sp = eng.submitted[-1]
    assert sp.max_new_tokens == 50 and sp.temperature == 0 and sp.top_p == 0.5
    # instructions → the system message, input → the user message: the chat request's prompt
    c.chat.completions.create(model="toy", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"}])
    assert eng.submitted[-1][0] == ids


def test_function_calls_become_items_and_the_stream_checks_out(tokenizer):
    """hermes-format calls → a message item with the text before them, then one
    `function_call` item per call; the streamed events, accumulated by the SDK's own stream
    helper (which raises on an inconsistent sequence), give the same output."""
    c, _ = client_for(ScriptedEngine(tokenizer, HERMES, piece=3))
    r = c.responses.create(model="toy", input="Weather in Oslo and the time in UTC?",
                           tools=TOOLS)
    assert [it.type for it in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "I will look both up."
    calls = [(it.name, json.loads(it.arguments)) for it in r.output[1:]]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]
    assert len({it.call_id for it in r.output[1:]}) == 2 and r.status == "completed"
    assert r.tool_choice == "auto" and [t.name for t in r.tools] == ["get_weather", "get_time"]

    with c.responses.stream(model="toy", input="Weather in Oslo and the time in UTC?",
                            tools=TOOLS) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == 3
    assert kinds.count("response.output_item.done") == 3
    assert kinds.count("response.function_call_arguments.delta") > 2
    assert [(it.type, getattr(it, "name", None), getattr(it, "arguments", None))
            for it in final.output] == [(it.type, getattr(it, "name", None),
                                         getattr(it, "arguments", None)) for it in r.output]
    assert final.output[0].content[0].text == "I will look both up."
    raw = list(c.responses.create(model="toy", input="hi", tools=TOOLS, stream=True))
    assert [ev.sequence_number for ev in raw] == list(range(len(raw)))


def test_tool_choice_and_json_schema_reach_the_grammar(tokenizer):
    eng = ScriptedEngine(tokenizer, '{"city": "Oslo"}')
    c, _ = client_for(eng)
    r = c.responses.create(model="toy", input="x", tools=TOOLS,
                           tool_choice={"type": "function", "name": "get_weather"})
    assert json.loads(eng.submitted[-1][1].json_schema) == TOOLS[0]["parameters"]
    assert [(it.type, it.name, it.arguments) for it in r.output] == [
        ("function_call", "get_weather", '{"city": "Oslo"}')]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c.responses.create(model="toy", input="x", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert json.loads(eng.submitted[-1][1].json_schema) == schema
    c.responses.create(model="toy", input="x", text={"format": {"type": "json_object"}})
    assert json.loads(eng.submitted[-1][1].json_schema) == {"type": "object"}


def test_previous_response_id_continues_the_conversation(tokenizer):
    """The second request's prompt is the first one's conversation (without its
    instructions), its output, then the new input: the chat template of exactly those."""
    eng = ScriptedEngine(tokenizer, HERMES)
    c, _ = client_for(eng)
    first = c.responses.create(model="toy", input="Weather in Oslo?", tools=TOOLS,
                               instructions="Use tools.")
    outputs = [{"type": "function_call_output", "call_id": it.call_id, "output": "12 C"}
               for it in first.output if it.type == "function_call"]
    second = c.responses.create(model="toy", input=outputs, tools=TOOLS, tool_choice="none",
                                previous_response_id=first.id)
    assert second.previous_response_id == first.id
    prompt = prompt_of(eng, tokenizer)
    assert "Use tools." not in prompt  # instructions are not carried over
    assert prompt.count("Weather in Oslo?") == 1 and prompt.count("12 C") == 2
    assert prompt.count('"get_weather"') >= 2  # the listed tool and the replayed call
    # the same conversation sent in full (the SDK's items replayed) gives the same prompt
    replay = [{"role": "user", "content": "Weather in Oslo?"}]
    replay += [it.model_dump(exclude_none=True) for it in first.output] + outputs
    c.responses.create(model="toy", input=replay, tools=TOOLS, tool_choice="none")
    assert eng.submitted[-1][0] == eng.submitted[-2][0]

    assert c.responses.retrieve(second.id).output_text == second.output_text
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="toy", input="more", previous_response_id=second.id)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"
    unstored = c.responses.create(model="toy", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"n": 2}, "n"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_requests_name_the_responses_field(tokenizer, extra, param):
    eng = ScriptedEngine(tokenizer, "x")
    c, _ = client_for(eng)
    body = {"model": "toy", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as e:
        c.post("/responses", body=body, cast_to=object)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert not eng.submitted
    ok = c.responses.create(model="toy", input="hi", metadata={"k": "v"}, service_tier="auto",
                            safety_identifier="s", prompt_cache_key="p", reasoning={})
    assert ok.status == "completed"


# -- the pieces, without HTTP --------------------------------------------------------------------
def test_input_items_as_chat_messages():
    items = [{"role": "developer", "content": "sys"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                 "text": "b"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "r1"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "r2"}]},
             {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]
    assert input_messages(items) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]
    with pytest.raises(ApiError) as e:
        input_messages([{"type": "function_call", "name": "f", "arguments": "{}"}])
    assert e.value.param == "input[0].call_id"


def test_chat_params_in_responses_spelling():
    assert responses_param("max_completion_tokens") == "max_output_tokens"
    assert responses_param("messages[3].content") == "input"
    assert responses_param("tools[1].function.parameters") == "tools[1].parameters"
    assert responses_param("response_format") == "text.format"
    assert responses_param("temperature") == "temperature"


def test_builder_statuses_and_store_eviction():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}}
    b = ResponseBuilder("m", {})
    b.start()
    b.delta({"content": "ab"})
    final, events = b.finish("length", usage)
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    assert [e["sequence_number"] for e in events] == list(range(events[0]["sequence_number"],
                                                                b.seq))
    store = ResponseStore(capacity=2)
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, [{"role": "user", "content": rid}])
    assert len(store) == 2
    with pytest.raises(ApiError) as e:
        store.get("a")  # least recently used: evicted
    assert e.value.status == 404
    store.get("b")  # b is now the most recent; d evicts c
    store.put({"id": "d"}, [])
    assert store.history("b") == [{"role": "user", "content": "b"}]
    with pytest.raises(ApiError) as e:
        store.history("c")
    assert e.value.status == 400 and e.value.param == "previous_response_id"


def test_router_routes_a_response_on_the_prompt_the_worker_computes(tokenizer):
    """`radixrt router` tokenizes a Responses request as the worker will (instructions +
    input through the chat template), so it routes on the real prefix."""
    from radixrt.router.prompt_ids import PromptIds

    eng = ScriptedEngine(tokenizer, "ok")
    c, _ = client_for(eng)
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "12 C"}]
    body = {"instructions": "Use tools.", "input": items, "tools": TOOLS}
    prompt_ids = PromptIds(tokenizer)
    for tools in (False, True):  # the tiny template takes no tools: the fallback block
        sent = body if tools else {k: v for k, v in body.items() if k != "tools"}
        c.responses.create(model="toy", **sent)
        assert prompt_ids.of("/v1/responses", sent) == eng.submitted[-1][0]
    # the chat endpoint's tool-call history too (rendered as text for this template)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]
    c.chat.completions.create(model="toy", messages=messages)
    assert prompt_ids.of("/v1/chat/completions", {"messages": messages}) == eng.submitted[-1][0]
    assert prompt_ids.of("/v1/responses", {"input": [{"type": "bogus"}]}) == []


def test_input_items_are_listed_a_page_at_a_time(tokenizer):
    """`responses.input_items.list`: this response's own input (not the conversation it
    continues), ids kept or given, newest first by default, pages through `after`; the SDK's
    auto-pagination walks every page."""
    c, http = client_for(ScriptedEngine(tokenizer, "ok"))
    first = c.responses.create(model="toy", input="first")
    items = [{"role": "user", "content": f"q{i}"} for i in range(5)]
    items.insert(2, {"type": "message", "id": "msg_mine", "role": "assistant",
                     "content": [{"type": "output_text", "text": "a", "annotations": []}]})
    r = c.responses.create(model="toy", input=items, previous_response_id=first.id)
    page = c.responses.input_items.list(r.id, limit=4, order="asc")
    assert [it.content[0].text for it in page.data] == ["q0", "q1", "a", "q2"]
    assert page.data[2].id == "msg_mine" and page.has_more
    assert [it.content[0].type for it in page.data] == ["input_text"] * 2 + ["output_text",
                                                                            "input_text"]
    walked = [it.content[0].text for it in c.responses.input_items.list(r.id, limit=2)]
    assert walked == ["q4", "q3", "q2", "a", "q1", "q0"]  # desc, every page
    assert [it.content[0].text for it in c.responses.input_items.list(first.id).data] == \
        ["first"]
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=nope", "after"), ("include=x", "include")):
        resp = http.get(f"/v1/responses/{r.id}/input_items?{query}")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, query
    assert http.get("/v1/responses/resp-none/input_items").status_code == 404
