"""vLLM's chat-template fields on `/v1/chat/completions` (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`), driven by the `openai` SDK against the real
app and a scripted engine: the prompt that reaches the engine is the template's rendering with
those options, bad values are 400s naming the field, and `radixrt router` tokenizes the same
prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from test_responses_api import client_for
from test_tools_api import ScriptedEngine

from radixrt.router.prompt_ids import PromptIds

MESSAGES = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    """The tiny tokenizer with a template that reads a custom variable, `mood`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok.chat_template = (
        "{% if mood %}[mood: {{ mood }}]{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def rendered(tokenizer: Any, **kw: Any) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, **kw)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fields,template", [
    ({}, {"add_generation_prompt": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"continue_final_message": True},
     {"add_generation_prompt": False, "continue_final_message": True}),
    ({"chat_template_kwargs": {"mood": "calm"}}, {"add_generation_prompt": True, "mood": "calm"}),
])
def test_fields_reach_the_template(tokenizer, fields, template):
    eng = ScriptedEngine(tokenizer, "ok")
    c, _ = client_for(eng)
    c.chat.completions.create(model="toy", messages=MESSAGES, extra_body=fields)
    ids = eng.submitted[-1][0]
    assert ids == rendered(tokenizer, **template)
    assert PromptIds(tokenizer).of("/v1/chat/completions", {"messages": MESSAGES, **fields}) == ids
    text = tokenizer.decode(ids)
    if fields.get("continue_final_message"):
        assert text.endswith("The colour is")  # left open for the model to continue
    if "chat_template_kwargs" in fields:
        assert text.startswith("[mood: calm]")


@pytest.mark.parametrize("fields,param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": ["mood"]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_bad_values_name_the_field(tokenizer, fields, param):
    eng = ScriptedEngine(tokenizer, "ok")
    c, _ = client_for(eng)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="toy", messages=MESSAGES, extra_body=fields)
    assert e.value.body["param"] == param, e.value.body
    assert not eng.submitted
