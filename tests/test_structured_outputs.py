"""Structured outputs and "nothing silently ignored" against a live server, with the real
clients: the `openai` SDK's `chat.completions.parse` and LangChain's
`ChatOpenAI.with_structured_output`. The model is the tiny random Llama: its outputs are valid
because of the grammar alone, and every one is validated against its schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from test_server import LiveServer, start_server, stop_server


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fox"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


class Owner(BaseModel):
    first: str = Field(max_length=6)
    pets: list[Pet] = Field(max_length=2)


MESSAGES = [{"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Describe a pet."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[LiveServer]:
    srv = start_server(str(tiny_llama_dir))
    yield srv
    stop_server(srv)


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "default", **body},
                      headers=server.headers(), timeout=120)


def test_openai_parse_with_pydantic(server: LiveServer) -> None:
    c = server.client()
    for temperature, n in ((0.0, 1), (1.0, 3)):
        r = c.chat.completions.parse(model="default", messages=MESSAGES, response_format=Owner,
                                     max_completion_tokens=400, temperature=temperature, n=n,
                                     seed=7)
        assert len(r.choices) == n
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch.message.content
            assert isinstance(ch.message.parsed, Owner)
            jsonschema.validate(json.loads(ch.message.content), Owner.model_json_schema())
    server.assert_clean()


def test_langchain_with_structured_output(server: LiveServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="default",
                     temperature=0.8, max_completion_tokens=300, max_retries=0, timeout=120)
    structured = llm.with_structured_output(Pet)  # method="json_schema" by default
    for prompt in ("Describe a pet.", "Another one, please."):
        pet = structured.invoke(prompt)
        assert isinstance(pet, Pet)
        jsonschema.validate(pet.model_dump(), Pet.model_json_schema())
    raw = llm.with_structured_output(Pet, include_raw=True).invoke("One more.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Pet)
    assert raw["raw"].response_metadata["finish_reason"] == "stop"


def test_streamed_json_schema_and_concurrent_mixed_requests(server: LiveServer) -> None:
    c = server.client()
    # Without additionalProperties false (what strict clients send) a random model may add
    # keys of its own until max_tokens: valid JSON Schema-wise, but it would not finish.
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema,
                                                 "strict": True}}

    def constrained(i: int) -> str:
        text, finish = "", None
        for ev in c.chat.completions.create(model="default", messages=MESSAGES,
                                            response_format=rf, stream=True, max_tokens=300,
                                            temperature=1.0, seed=i):
            if ev.choices:
                text += ev.choices[0].delta.content or ""
                finish = ev.choices[0].finish_reason or finish
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
        return text

    def free(i: int) -> str:
        r = c.chat.completions.create(model="default", messages=MESSAGES, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: constrained(i) if i % 2 else free(i), range(12)))
    assert len({outs[i] for i in range(0, 12, 2)}) == 1  # greedy free requests agree
    server.assert_clean()


def test_completions_regex_ebnf_and_json_object(server: LiveServer) -> None:
    c = server.client()
    r = c.completions.create(model="default", prompt="The answer:", max_tokens=40,
                             temperature=1.0, n=4, seed=1,
                             extra_body={"regex": r"(yes|no), [0-9]{2}"})
    for ch in r.choices:
        assert ch.finish_reason == "stop" and re.fullmatch(r"(yes|no), [0-9]{2}", ch.text)
    r = c.completions.create(model="default", prompt="A list:", max_tokens=60, temperature=1.0,
                             n=3, seed=2, extra_body={
                                 "ebnf": 'root ::= "[" item (", " item){0,3} "]"\n'
                                         'item ::= "a" | "bb" | [0-9]'})
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        assert re.fullmatch(r"\[(a|bb|[0-9])(, (a|bb|[0-9])){0,3}\]", ch.text), ch.text
    for endpoint in ("completions", "chat"):
        kw = {"max_tokens": 200, "temperature": 0.7, "seed": 3}
        rf = {"type": "json_object"}
        if endpoint == "chat":
            r = c.chat.completions.create(model="default", messages=MESSAGES, response_format=rf,
                                          **kw)
            ch, text = r.choices[0], r.choices[0].message.content
        else:  # not in the SDK's completions signature: sent as an extra field
            r = c.completions.create(model="default", prompt="JSON:",
                                     extra_body={"response_format": rf}, **kw)
            ch, text = r.choices[0], r.choices[0].text
        assert ch.finish_reason in ("stop", "length")
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
    # max_tokens cuts a grammar before it accepts: "length", and the text is a prefix.
    r = c.completions.create(model="default", prompt="x", max_tokens=2, temperature=0,
                             extra_body={"regex": "abcdefghij"})
    assert r.choices[0].finish_reason == "length" and "abcdefghij".startswith(r.choices[0].text)
    server.assert_clean()


BAD = [  # (endpoint, extra body, status, param)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ("completions", {"regex": "(a"}, "regex"),
    ("completions", {"ebnf": "root ::= nowhere"}, "ebnf"),
    ("completions", {"regex": 5}, "regex"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("chat", {"logit_bias": ["5", 1]}, "logit_bias"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "hi"}}, "prediction"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"web_search_options": {}}, "web_search_options"),  # {} turns search on
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("chat", {"function_call": {"name": "f"}}, "function_call"),
    ("completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "none"}, "tool_choice"),  # tool_choice without tools
    ("chat", {"temprature": 0.5}, "temprature"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"tok": -100}}, "logit_bias"),
    ("chat", {"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
]


@pytest.mark.parametrize("endpoint,extra,param", BAD)
def test_bad_or_unsupported_fields_are_400(server: LiveServer, endpoint: str, extra: dict,
                                           param: str) -> None:
    body = ({"messages": MESSAGES} if endpoint == "chat" else {"prompt": "Hi"}) | extra
    r = post(server, f"/v1/{endpoint}" if endpoint == "completions" else
             "/v1/chat/completions", {"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_metadata_and_neutral_values_are_accepted(server: LiveServer) -> None:
    extra = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
             "prompt_cache_key": "abc", "safety_identifier": "s", "logit_bias": {},
             "modalities": ["text"], "function_call": "none", "parallel_tool_calls": True,
             "audio": None, "response_format": {"type": "text"}, "min_tokens": 2,
             "stop_token_ids": [0]}
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3,
                                              "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "best_of": 1,
                                         "user": "u1", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
