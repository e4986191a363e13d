"""The HTTP layer's half of tool calling with `tool_choice: auto`, driven by the `openai` SDK
against the real app and a scripted engine: the "model" writes each parser family's native
format in small pieces (as tokens arrive), so the parsing, the response and the stream are
checked on outputs no random model would write."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from fake_engine import FakeEngineBase
from fastapi.testclient import TestClient

from radixrt.config import ServerArgs
from radixrt.core.messages import FINISH_STOP, ReqTextOut, Usage
from radixrt.core.sampling_params import SamplingParams
from radixrt.server.http import Server, create_app
from radixrt.server.protocol import ApiError
from radixrt.server.tools import tool_request_from
from tokenizer_proc.request_state import ReqState

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Oslo and the time in UTC?"}]


class ScriptedEngine(FakeEngineBase):
    """Every request "generates" `script` in pieces of `piece` characters, then stops."""

    def __init__(self, tokenizer: Any, script: str = "", piece: int = 3):
        super().__init__(tokenizer, 4096, "/models/scripted")
        self.script, self.piece = script, piece

    def submit(self, ids: list[int], sp: SamplingParams, *, loop: asyncio.AbstractEventLoop,
               queue: asyncio.Queue, stream: bool | None = None) -> ReqState:
        state = self._new_request(ids, sp, loop, queue)
        rid = state.rid
        pieces = [self.script[i:i + self.piece]
                  for i in range(0, len(self.script), self.piece)] or [""]
        for k, text in enumerate(pieces):
            out = ReqTextOut(rid=rid, text_delta=text, new_ids=[k % self.vocab_size],
                             finish_reason=FINISH_STOP if k == len(pieces) - 1 else None,
                             usage=Usage(len(ids), 0, k + 1))

            def deliver(out: ReqTextOut = out) -> None:
                state.apply(out)
                if out.finish_reason is not None:
                    self.live.discard(rid)
                state.notify(out)

            loop.call_later(0.001 * (k + 1), deliver)
        return state


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def client_for(engine: ScriptedEngine, **args: Any) -> openai.OpenAI:
    app = create_app(engine, ServerArgs(served_model_name="toy", **args))  # type: ignore[arg-type]
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                         http_client=TestClient(app))


def stream_result(stream: Any) -> tuple[str, list[dict[str, str]], str | None, list[Any]]:
    """(content, calls [{id, name, arguments}], finish_reason, the tool-call deltas)."""
    content, calls, finish, deltas = "", [], None, []
    for ev in stream:
        ch = ev.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            deltas.append(d)
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function"
                assert d.function.arguments == ""
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = ch.finish_reason or finish
    return content, calls, finish, deltas


HERMES = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": '
          '"UTC"}}\n</tool_call>')
LLAMA3 = ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
          '{"name": "get_time", "parameters": {"tz": "UTC"}}')
MISTRAL = ('I will look both up.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
           '"Oslo"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]')
EXPECTED = [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize("parser,script,content", [
    ("hermes", HERMES, "I will look both up."), ("llama3_json", LLAMA3, None),
    ("mistral", MISTRAL, "I will look both up.")])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_auto_calls_in_each_family(tokenizer, parser, script, content, piece):
    c = client_for(ScriptedEngine(tokenizer, script, piece), tool_call_parser=parser)
    r = c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        EXPECTED
    assert len({t.id for t in msg.tool_calls}) == 2
    if parser == "mistral":
        assert all(len(t.id) == 9 and t.id.isalnum() for t in msg.tool_calls)

    s_content, calls, finish, deltas = stream_result(c.chat.completions.create(
        model="toy", messages=ASK, tools=TOOLS, stream=True))
    assert finish == "tool_calls" and s_content == (content or "")
    assert [(x["name"], x["arguments"]) for x in calls] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls]
    if piece == 1:
        assert len(deltas) > 4, "arguments stream in fragments"


def test_auto_without_calls_and_none_return_the_text(tokenizer):
    text = "No tool needed: <tool_call> is only mentioned."
    c = client_for(ScriptedEngine(tokenizer, text))
    r = c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    c = client_for(ScriptedEngine(tokenizer, HERMES))
    r = c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == HERMES and not r.choices[0].message.tool_calls
    content, calls, finish, _ = stream_result(c.chat.completions.create(
        model="toy", messages=ASK, tools=TOOLS, tool_choice="none", stream=True))
    assert (content, calls, finish) == (HERMES, [], "stop")


def test_parallel_tool_calls_false_keeps_the_first(tokenizer):
    c = client_for(ScriptedEngine(tokenizer, HERMES))
    r = c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS,
                                  parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, finish, _ = stream_result(c.chat.completions.create(
        model="toy", messages=ASK, tools=TOOLS, parallel_tool_calls=False, stream=True))
    assert [x["name"] for x in calls] == ["get_weather"] and finish == "tool_calls"


def test_request_plumbing_into_sampling_params(tokenizer):
    """`required` / named → the grammar schema; auto / none → no grammar; the prompt carries
    the fallback block (the tiny template takes no tools)."""
    eng = ScriptedEngine(tokenizer, '[{"name": "get_time", "arguments": {"tz": "UTC"}}]')
    c = client_for(eng)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}},
                   "auto", "none"):
        c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS, tool_choice=choice)
        ids, sp = eng.submitted[-1]
        want = tool_request_from({"tools": TOOLS, "tool_choice": choice}).grammar_schema()
        assert sp.json_schema == want and sp.skip_special_tokens
        assert "You can call functions" in tokenizer.decode(ids)


def test_grammar_choices_do_not_combine_with_another_grammar(tokenizer):
    server = Server(ScriptedEngine(tokenizer), ServerArgs())  # type: ignore[arg-type]
    treq = tool_request_from({"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(ApiError) as e:
        server.tool_sampling(SamplingParams(regex="a+"), treq)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    auto = tool_request_from({"tools": TOOLS})
    assert server.tool_sampling(SamplingParams(regex="a+"), auto).regex == "a+"


def test_special_token_marker_is_kept_and_other_specials_dropped(tiny_llama_dir, tmp_path):
    """A tokenizer whose `[TOOL_CALLS]` is a special token and a template that uses it:
    `auto` picks the mistral parser, the request keeps special tokens, and the other special
    tokens (the end-of-turn one here) never reach the content."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.chat_template = ("{{ '[AVAILABLE_TOOLS]' }}{% for m in messages %}{{ m.content }}"
                         "{% endfor %}")
    eng = ScriptedEngine(tok, MISTRAL + "<|im_end|>", piece=5)
    c = client_for(eng)
    r = c.chat.completions.create(model="toy", messages=ASK, tools=TOOLS)
    assert not eng.submitted[-1][1].skip_special_tokens
    msg = r.choices[0].message
    assert msg.content == "I will look both up."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        EXPECTED


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "frobnicate"}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "regex": "a+"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_grammar_conflicts_and_unenforceable_schemas_are_400(tokenizer, extra, param):
    eng = ScriptedEngine(tokenizer, "x")
    c = client_for(eng)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="toy", messages=ASK, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert not eng.submitted
