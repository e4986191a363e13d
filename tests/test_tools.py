"""Tool calling without a running model: the parsers (every family, every streaming split),
request validation (400s naming the field), the grammar schemas, the prompt (template with
`tools`, fallback block, history round trip) and the response / stream shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.config import TOOL_CALL_PARSERS, ServerArgs
from radixrt.server.protocol import ApiError, messages_from
from radixrt.server.tool_parsers import (
    TOOL_PARSERS,
    ArgsDelta,
    CallStart,
    ContentDelta,
    HermesParser,
    JsonArrayCallParser,
    Llama3JsonParser,
    MistralParser,
    NamedCallParser,
    ToolCallParser,
    parse_text,
)
from radixrt.server.tools import (
    ToolCallStream,
    kept_specials,
    parser_class,
    parser_for_template,
    prompt_messages,
    tool_request_from,
)
from tokenizer_proc.input_processor import InputProcessor, template_reads

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": False}}}


# -- parsers -------------------------------------------------------------------------------------
# (parser factory, generated text, expected content, expected [(name, arguments JSON text)])
CASES: list[tuple[Any, str, str, list[tuple[str, str]]]] = [
    (HermesParser, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                   '{"city": "Pa}ris \\"x\\"", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
                   '{"arguments": {"tz": "UTC"}, "name": "get_time"}\n</tool_call>\n',
     "Let me check.", [("get_weather", '{"city": "Pa}ris \\"x\\"", "unit": "c"}'),
                       ("get_time", '{"tz": "UTC"}')]),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     "", [("f", '{"a": 1}')]),
    (HermesParser, '<tool_call>{"name": "f"}</tool_call> done', "done", [("f", "{}")]),
    (HermesParser, 'a <tool_call> not json </tool_call> b',
     "a <tool_call> not json </tool_call> b", []),
    (HermesParser, 'x <tool_call>{"arguments": {}}</tool_call>',
     'x <tool_call>{"arguments": {}}</tool_call>', []),
    (HermesParser, 'cut <tool_call>{"name": "f", "arguments": {"a": [1, ',
     "cut", [("f", '{"a": [1, ')]),
    (HermesParser, "plain text with <tool_ but no call  \n", "plain text with <tool_ but no call  \n",
     []),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}; '
                       '{"name": "f", "parameters": {}}', "",
     [("get_time", '{"tz": "CET"}'), ("f", "{}")]),
    (Llama3JsonParser, ' {"name": "f", "arguments": {"a": 1}}', "", [("f", '{"a": 1}')]),
    (Llama3JsonParser, "The answer is {42}.", "The answer is {42}.", []),
    (Llama3JsonParser, ' {"answer": 42}', ' {"answer": 42}', []),
    (MistralParser, 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", '
                    '"unit": "f"}, "id": "abcdefghi"}, {"name": "get_time", "arguments": '
                    '{"tz": "UTC"}}]',
     "Sure", [("get_weather", '{"city": "Rome", "unit": "f"}'), ("get_time", '{"tz": "UTC"}')]),
    (MistralParser, '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]f[CALL_ID]a1b2c3d4e'
                    '[ARGS]{}', "", [("get_time", '{"tz": "UTC"}'), ("f", "{}")]),
    (MistralParser, "no calls [TOOL_ here", "no calls [TOOL_ here", []),
    (JsonArrayCallParser, '[{"name": "get_time", "arguments": {"tz": "UTC"}}, '
                          '{"name": "f", "arguments": {}}]',
     "", [("get_time", '{"tz": "UTC"}'), ("f", "{}")]),
    (lambda: NamedCallParser("get_time"), ' {"tz": "UTC"}', "", [("get_time", '{"tz": "UTC"}')]),
    (lambda: NamedCallParser("get_time"), "", "", [("get_time", "{}")]),
]


def run_stream(parser: ToolCallParser, pieces: list[str]) -> list[Any]:
    events = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()


def aggregate(events: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = [], []
    for ev in events:
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, CallStart):
            assert ev.index == len(calls), "calls are numbered in order"
            calls.append([ev.name, ""])
        else:
            assert isinstance(ev, ArgsDelta) and ev.index == len(calls) - 1, \
                "arguments follow their call's start"
            calls[ev.index][1] += ev.text
    return "".join(content), [(n, a) for n, a in calls]


@pytest.mark.parametrize("factory,text,content,calls", CASES)
def test_parser_whole_text(factory, text, content, calls):
    assert parse_text(factory(), text) == (content, calls)


@pytest.mark.parametrize("factory,text,content,calls", CASES)
def test_parser_every_split_point(factory, text, content, calls):
    """Two pieces split at every position, and one char at a time, give the same result."""
    for i in range(len(text) + 1):
        assert aggregate(run_stream(factory(), [text[:i], text[i:]])) == (content, calls), i
    assert aggregate(run_stream(factory(), list(text))) == (content, calls)


def test_parser_streams_arguments_before_the_call_closes():
    p = HermesParser()
    evs = p.feed('<tool_call>{"name": "f", "arguments": {"a": "lo')
    assert evs == [CallStart(0, "f"), ArgsDelta(0, '{"a": "lo')]
    assert p.feed('ng"}}</tool_call>') == [ArgsDelta(0, 'ng"}')]
    assert p.finish() == []


def test_parser_holds_back_a_possible_marker_only():
    p = HermesParser()
    assert p.feed("Hello <tool") == [ContentDelta("Hello")]
    assert p.feed("box> x ") == [ContentDelta(" <toolbox> x")]
    assert p.finish() == [ContentDelta(" ")]


PIECES = list('ab {}[]":,;<>/\n\\_f') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '"name"',
    '"arguments"', '{"name": "f", "arguments": ', '\\"']
FAMILIES = {**TOOL_PARSERS, "json_array": JsonArrayCallParser}


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
       st.sampled_from(sorted(FAMILIES)), st.integers(0, 300), st.integers(0, 300))
def test_parser_any_text_any_split(text, family, c1, c2):
    """Whatever the model writes, the split into pieces does not matter; and when no call
    comes out of a family's parser, the content is the text itself."""
    a, b = sorted((c1, c2))
    whole = parse_text(FAMILIES[family](), text)
    split = aggregate(run_stream(FAMILIES[family](), [text[:a], text[a:b], text[b:]]))
    assert split == whole
    if not whole[1] and family != "json_array":
        assert whole[0] == text


def test_registry_matches_the_config_choices():
    assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS) - {"auto"}
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerArgs(tool_call_parser="qwen9")


def test_parser_for_template():
    assert parser_for_template("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert parser_for_template("<tool_call>\n{{ tools }}") == "hermes"
    assert parser_for_template(None) == "hermes"
    assert parser_for_template({"default": "x", "tool_use": "<|python_tag|>"}) == "llama3_json"
    assert parser_class("mistral", "<tool_call>") is MistralParser
    assert parser_class("auto", "<tool_call>") is HermesParser


def test_mistral_ids_are_nine_alphanumerics():
    ids = {MistralParser.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert HermesParser.new_call_id().startswith("call_")


# -- the request ---------------------------------------------------------------------------------
def api_error(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        tool_request_from(body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice", "only allowed"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "'always'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": [WEATHER, "x"]}, "tools[1]", "object"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "duplicate"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tool_requests_name_the_field(body, param, words):
    err = api_error(body)
    assert err.param == param and words in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_tool_request_defaults_and_choices():
    assert tool_request_from({}) is None
    assert tool_request_from({"tools": []}) is None
    r = tool_request_from({"tools": [WEATHER, TIME]})
    assert r is not None and (r.choice, r.parallel, r.names) == ("auto", True,
                                                                 ("get_weather", "get_time"))
    assert r.grammar_schema() is None and isinstance(r.parser(HermesParser), HermesParser)
    r = tool_request_from({"tools": [WEATHER], "tool_choice": "none"})
    assert r is not None and r.parser(HermesParser) is None
    r = tool_request_from({"tools": [{"type": "function", "function": {"name": "ping",
                                                                        "strict": True}}],
                           "tool_choice": {"type": "function", "function": {"name": "ping"}}})
    assert r is not None and r.choice == "function" and r.function == "ping"
    assert json.loads(r.grammar_schema()) == {"type": "object", "properties": {}}


def test_required_schema_accepts_exactly_the_valid_calls():
    r = tool_request_from({"tools": [WEATHER, TIME], "tool_choice": "required",
                           "parallel_tool_calls": False})
    schema = json.loads(r.grammar_schema())
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]
    jsonschema.validate(ok, schema)
    for wrong in ([], ok * 2, [{"name": "get_time", "arguments": {"city": "Oslo", "unit": "c"}}],
                  [{"name": "nope", "arguments": {"tz": "x"}}],
                  [{"name": "get_time", "arguments": {"tz": "x"}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    parallel = json.loads(tool_request_from({"tools": [WEATHER], "tool_choice": "required"})
                          .grammar_schema())
    jsonschema.validate(ok * 3, parallel)  # several calls allowed
    # What the grammar produces parses back into exactly those calls.
    text = json.dumps(ok + [{"name": "get_time", "arguments": {"tz": "UTC"}}])
    assert parse_text(JsonArrayCallParser(), text)[1] == [
        ("get_weather", '{"city": "Oslo", "unit": "c"}'), ("get_time", '{"tz": "UTC"}')]


def test_named_schema_is_the_function_parameters():
    r = tool_request_from({"tools": [WEATHER, TIME],
                           "tool_choice": {"type": "function",
                                           "function": {"name": "get_time"}}})
    assert json.loads(r.grammar_schema()) == TIME["function"]["parameters"]


# -- messages ------------------------------------------------------------------------------------
def test_messages_developer_role_content_parts_and_tool_history():
    msgs = messages_from({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                          {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "7C"}]},
    ]})
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1]["content"] == "Weather?"
    assert msgs[2]["content"] == "" and msgs[2]["tool_calls"] == [
        {"type": "function", "id": "call_1",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "7C"}


@pytest.mark.parametrize("msg,param", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "messages[0].content"),
    ({"role": "user", "content": 5}, "messages[0].content"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
     "messages[0].tool_calls[0]"),
    ({"role": "tool", "content": "x", "tool_call_id": 3}, "messages[0].tool_call_id"),
])
def test_bad_messages_name_the_field(msg, param):
    with pytest.raises(ApiError) as e:
        messages_from({"messages": [msg]})
    assert e.value.status == 400 and e.value.param == param


# -- the prompt ----------------------------------------------------------------------------------
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n[TOOLS]{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": "
    "{{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<tool_response id="
    "{{ m.tool_call_id }}>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizers(tiny_llama_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    with_tools = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    with_tools.chat_template = TOOLS_TEMPLATE
    return {"plain": plain, "tools": with_tools}


def render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    ip = InputProcessor(tok, len(tok), 4096)
    return tok.decode(ip.apply_chat_template(messages, tools))


HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "7 degrees"},
]


def test_template_reads_tools():
    assert template_reads(TOOLS_TEMPLATE, "tools")
    assert not template_reads("{% for m in messages %}{{ m.content }}{% endfor %}", "tools")
    assert template_reads({"default": "{{ messages }}", "tool_use": "{{ tools }}"}, "tools")
    assert template_reads("{% for x in y %}{% break %}{% endfor %}{{ tools }}", "tools")


def test_template_with_tools_renders_tools_and_history(tokenizers):
    tok = tokenizers["tools"]
    assert InputProcessor(tok, len(tok), 4096).template_takes_tools()
    treq = tool_request_from({"tools": [WEATHER, TIME]})
    msgs, tools = prompt_messages(messages_from({"messages": HISTORY}), treq, True)
    assert tools == [WEATHER, TIME]
    text = render(tok, msgs, tools)
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]["unit"]) in text
    # The call round-trips: the arguments the client sent back are the object, not a string.
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
            '</tool_call>') in text
    assert "<tool_response id=call_abc>7 degrees</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_fallback_block_and_history_as_text(tokenizers):
    tok = tokenizers["plain"]
    assert not InputProcessor(tok, len(tok), 4096).template_takes_tools()
    treq = tool_request_from({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    msgs, tools = prompt_messages(messages_from({"messages": HISTORY}), treq, False)
    assert tools is None
    system = msgs[0]
    assert system["role"] == "system" and system["content"].startswith("You help.\n\n")
    for t in (WEATHER, TIME):
        assert json.dumps(t) in system["content"]
    assert "<tool_call>" in system["content"] and "at most one" in system["content"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                       '"arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user",
                       "content": "<tool_response>\n7 degrees\n</tool_response>"}
    # The fallback's own call format is what the hermes parser reads back.
    assert parse_text(HermesParser(), msgs[2]["content"])[1] == [
        ("get_weather", '{"city": "Oslo", "unit": "c"}')]
    text = render(tok, msgs, tools)
    assert "<|im_start|>system\nYou help.\n\nYou can call functions" in text
    # Without a system message the block becomes one.
    msgs, _ = prompt_messages([{"role": "user", "content": "hi"}], treq, False)
    assert [m["role"] for m in msgs] == ["system", "user"]


# -- the response --------------------------------------------------------------------------------
def test_stream_deltas_and_message_agree():
    text = ('I will call.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"tz": "UTC"}}\n</tool_call>')
    ts = ToolCallStream(HermesParser())
    deltas = []
    for i in range(0, len(text), 7):
        deltas += ts.feed(text[i:i + 7])
    deltas += ts.finish()
    starts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d
              and "id" in d["tool_calls"][0]]
    assert [(s["index"], s["type"], s["function"]) for s in starts] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""})]
    args: dict[int, str] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
    msg = ts.message()
    assert msg["content"] == "I will call."
    assert [(c["id"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        (s["id"], args[s["index"]]) for s in starts]
    assert json.loads(args[0]) == {"city": "Oslo", "unit": "c"}
    assert ts.finish_reason("stop") == "tool_calls" and ts.finish_reason("length") == "length"
    assert len({s["id"] for s in starts}) == 2


def test_stream_without_parallel_keeps_the_first_call():
    ts = ToolCallStream(JsonArrayCallParser(), parallel=False)
    ts.feed('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]')
    ts.finish()
    msg = ts.message()
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["a"]


def test_stream_without_calls_is_plain_content():
    ts = ToolCallStream(HermesParser())
    ts.feed("just an answer")
    ts.finish()
    assert ts.message() == {"role": "assistant", "content": "just an answer"}
    assert ts.finish_reason("stop") == "stop"


def test_special_token_markers_are_kept_and_other_specials_removed():
    keep, remove = kept_specials(MistralParser, ["</s>", "[TOOL_CALLS]", "<s>"])
    assert keep and set(remove) == {"</s>", "<s>"}
    assert kept_specials(HermesParser, ["</s>", "<|im_end|>"]) == (False, ())
    text = 'Hi[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]</s>'
    for cut in range(len(text) + 1):
        ts = ToolCallStream(MistralParser(), remove=remove)
        ts.feed(text[:cut])
        ts.feed(text[cut:])
        ts.finish()
        msg = ts.message()
        assert msg["content"] == "Hi" and msg["tool_calls"][0]["function"] == {
            "name": "f", "arguments": '{"a": 1}'}, cut
