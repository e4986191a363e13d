"""The HTTP layer's half of prompt scores, without the runtime: the OpenAI legacy `echo` +
`logprobs` shape, `max_tokens: 0`, list prompts, streaming, and the tokenizer endpoints.

A fake engine stands in for the three processes. It scores like a deterministic toy model
(log-softmax of a table indexed by the previous token) and answers the way the scheduler does:
the first out carries `prompt_logprobs` when `logprob_start_len >= 0`, then one token per out.
The end-to-end version of these checks (real runtime) is in test_server.py / test_lm_eval.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngineBase
from fastapi.testclient import TestClient

from radixrt.config import ServerArgs
from radixrt.core.errors import InvalidRequestError
from radixrt.core.logprobs import TokenLogprobs
from radixrt.core.messages import FINISH_LENGTH, ReqTextOut, Usage
from radixrt.core.sampling_params import SamplingParams
from radixrt.server.http import create_app
from tokenizer_proc.request_state import ReqState

CONTEXT = 256


class ToyScores:
    """log p(next | previous token) = log_softmax(table[previous]); float64 like a real
    runtime's one tensor: chosen and top values are the same floats."""

    def __init__(self, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        logits = rng.normal(0.0, 3.0, (vocab, vocab))
        logits -= logits.max(axis=1, keepdims=True)
        self.lsm = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def row(self, prev: int) -> np.ndarray:
        return self.lsm[prev]

    def score(self, ids: list[int], start: int, k: int) -> TokenLogprobs:
        out = TokenLogprobs()
        for pos in range(start, len(ids)):
            if pos == 0:
                out.token_logprobs.append(None)
                out.top_ids.append([])
                out.top_logprobs.append([])
                continue
            row = self.row(ids[pos - 1])
            top = np.argsort(-row, kind="stable")[:k]
            out.token_logprobs.append(float(row[ids[pos]]))
            out.top_ids.append([int(t) for t in top])
            out.top_logprobs.append([float(row[t]) for t in top])
        return out


class FakeEngine(FakeEngineBase):
    """Greedy generation from `ToyScores`."""

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer, CONTEXT, "/models/toy")
        self.scores = ToyScores(self.vocab_size)

    def submit(self, ids: list[int], sp: SamplingParams, *, loop: asyncio.AbstractEventLoop,
               queue: asyncio.Queue, stream: bool | None = None) -> ReqState:
        state = self._new_request(ids, sp, loop, queue)
        rid = state.rid
        prompt_lp = (self.scores.score(ids, sp.logprob_start_len, sp.top_logprobs)
                     if sp.logprob_start_len >= 0 else None)
        seq, outs = list(ids), []
        for step in range(max(sp.max_new_tokens, 1)):
            new: list[int] = []
            lp = None
            if sp.max_new_tokens > 0:
                row = self.scores.row(seq[-1])
                tok = int(np.argmax(row))
                new = [tok]
                seq.append(tok)
                if sp.logprobs:
                    lp = self.scores.score(seq, len(seq) - 1, sp.top_logprobs)
            last = step == max(sp.max_new_tokens, 1) - 1
            outs.append(ReqTextOut(
                rid=rid, text_delta=self.tokenizer.decode(new), new_ids=new,
                finish_reason=FINISH_LENGTH if last else None,
                usage=Usage(len(ids), 0, len(seq) - len(ids)), logprobs=lp,
                prompt_logprobs=prompt_lp if step == 0 else None))

        def deliver(out: ReqTextOut) -> None:
            if rid not in self.live:
                return
            state.apply(out)
            if out.finish_reason is not None:
                self.live.discard(rid)
            state.notify(out)

        for k, out in enumerate(outs):
            loop.call_later(0.001 * (k + 1), deliver, out)
        return state


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture()
def fake(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture()
def client(fake: FakeEngine) -> TestClient:
    return TestClient(create_app(fake, ServerArgs(served_model_name="toy")))  # type: ignore[arg-type]


def post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo_choice(choice: dict[str, Any], ids: list[int], gen: int, prompt_text: str,
                      fake: FakeEngine, k: int) -> None:
    """The OpenAI legacy shape over prompt + `gen` generated tokens, numbers from ToyScores."""
    lp = choice["logprobs"]
    n = len(ids) + gen
    assert {"tokens", "token_logprobs", "top_logprobs", "text_offset"} == set(lp)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert len(lp["text_offset"]) == n
    assert choice["text"].startswith(prompt_text)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = fake.scores.score(ids, 0, k)
    for j in range(1, len(ids)):
        assert lp["tokens"][j] == fake.tokenizer.decode([ids[j]])
        assert lp["token_logprobs"][j] == ref.token_logprobs[j]  # exact: untouched floats
        top = lp["top_logprobs"][j]
        assert top[lp["tokens"][j]] <= max(top.values())
        assert max(top.values()) == ref.top_logprobs[j][0]
        assert len(top) <= k + 1
    # text_offset: each token starts where its text is in `text`
    text = choice["text"]
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[off:off + len(tok)] == tok
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_string_prompt(client: TestClient, fake: FakeEngine) -> None:
    prompt = "The quick brown fox jumps"
    ids = fake.tokenize(prompt)
    out = post(client, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2,
                                           "max_tokens": 3, "temperature": 0})
    (choice,) = out["choices"]
    check_echo_choice(choice, ids, 3, prompt, fake, 2)
    assert fake.submitted[0][1].logprob_start_len == 0
    assert out["usage"]["completion_tokens"] == 3 and out["usage"]["prompt_tokens"] == len(ids)
    # the generated part follows the prompt part, offsets continue into the completion
    lp = choice["logprobs"]
    assert lp["text_offset"][len(ids)] == len(prompt)
    assert all(isinstance(v, float) for v in lp["token_logprobs"][len(ids):])


def test_lm_eval_payload_batch_of_id_lists(client: TestClient, fake: FakeEngine,
                                           tokenizer: Any) -> None:
    """lm-eval's loglikelihood request; its parser's arithmetic on the answer."""
    texts = ["Question: what is a radix tree?\nAnswer: a trie", "Caches keep prefixes"]
    prompts = [tokenizer.encode(t) for t in texts]
    body = {"model": "toy", "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    out = post(client, "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c, ids in zip(out["choices"], prompts, strict=True):
        check_echo_choice(c, ids, 1, tokenizer.decode(ids), fake, 1)
        ctxlen = len(ids) - 3
        lps = c["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = c["logprobs"]["top_logprobs"][ctxlen:-1]
        ref = fake.scores.score(ids, 0, 1)
        assert math.fsum(lps) == math.fsum(ref.token_logprobs[ctxlen:])
        greedy = all(v == max(t.values()) for v, t in zip(lps, tops, strict=True))
        assert greedy == all(ref.top_ids[j][0] == ids[j] for j in range(ctxlen, len(ids)))
    # a continuation that is the argmax everywhere is reported greedy (exact float equality)
    row_prev = prompts[0][-1]
    best = int(np.argmax(fake.scores.row(row_prev)))
    ids = prompts[0] + [best]
    c = post(client, "/v1/completions", {**body, "prompt": [ids]})["choices"][0]
    v, top = c["logprobs"]["token_logprobs"][-2], c["logprobs"]["top_logprobs"][-2]
    assert v == max(top.values())


def test_max_tokens_zero_prompt_scores_only(client: TestClient, fake: FakeEngine,
                                            tokenizer: Any) -> None:
    ids = tokenizer.encode("Radix trees share prefixes")
    out = post(client, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0,
                                           "max_tokens": 0})
    (c,) = out["choices"]
    assert c["text"] == tokenizer.decode(ids) and c["finish_reason"] == "length"
    assert len(c["logprobs"]["token_logprobs"]) == len(ids)
    assert all(t is None or len(t) == 1 for t in c["logprobs"]["top_logprobs"])  # the chosen one
    assert out["usage"]["completion_tokens"] == 0
    # echo without logprobs: the prompt back, no logprobs, nothing generated
    out = post(client, "/v1/completions", {"prompt": "Radix trees", "echo": True,
                                           "max_tokens": 0})
    assert out["choices"][0]["text"] == "Radix trees" and out["choices"][0]["logprobs"] is None


def test_list_prompts_n_and_index(client: TestClient, fake: FakeEngine) -> None:
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    out = post(client, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                           "max_tokens": 2, "n": 2, "temperature": 0})
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for c in out["choices"]:
        p = prompts[c["index"] // 2]
        check_echo_choice(c, fake.tokenize(p), 2, p, fake, 1)
    assert out["usage"]["prompt_tokens"] == sum(len(fake.tokenize(p)) for p in prompts)


def test_stream_first_chunk_carries_prompt_scores(client: TestClient, fake: FakeEngine) -> None:
    prompt = "Streaming radix caches"
    ids = fake.tokenize(prompt)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x)["choices"][0] for x in lines[:-1]]
    first = chunks[0]
    assert first["text"] == prompt and first["finish_reason"] is None
    assert len(first["logprobs"]["token_logprobs"]) == len(ids)
    assert first["logprobs"]["token_logprobs"][0] is None
    rest = chunks[1:]
    assert sum(len(c["logprobs"]["tokens"]) for c in rest if c["logprobs"]) == 3
    assert rest[-1]["finish_reason"] == "length"
    text = "".join(c["text"] for c in chunks)
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    for tok, off in zip(tokens, offsets, strict=True):
        assert text[off:off + len(tok)] == tok


BAD = [
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * CONTEXT, "echo": True, "logprobs": 1,
                         "max_tokens": 0}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_input(client: TestClient, path: str, body: dict[str, Any], param: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_tokenizer_endpoints(client: TestClient, tokenizer: Any) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["pad_token"] == tokenizer.pad_token
    assert info["max_model_len"] == info["model_max_length"] == CONTEXT
    assert info["vocab_size"] == len(tokenizer) and isinstance(info["chat_template"], str)
    text = "hello world<|im_end|>"
    out = post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == CONTEXT
    assert post(client, "/tokenize", {"prompt": "<|im_end|>", "add_special_tokens": False}
                )["tokens"] == [tokenizer.eos_token_id]
    assert post(client, "/tokenize", {"prompt": ""})["tokens"] == []
    assert post(client, "/detokenize", {"tokens": out["tokens"]})["prompt"] == text


def test_tokenizer_endpoints_need_the_api_key(fake: FakeEngine) -> None:
    client = TestClient(create_app(fake, ServerArgs(api_key="k")))  # type: ignore[arg-type]
    assert client.get("/tokenizer_info").status_code == 401
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
    ok = client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200


def test_engine_rejects_logprob_start_len_past_the_prompt(fake: FakeEngine) -> None:
    with pytest.raises(InvalidRequestError) as e:
        fake.inputs.prepare("hi there", None, {"logprob_start_len": 50, "max_new_tokens": 0})
    assert e.value.field == "logprob_start_len"
    ids, params, _ = fake.inputs.prepare("hi there", None,
                                         {"logprob_start_len": 0, "max_new_tokens": 0})
    assert params[0].max_new_tokens == 0 and ids[0]


@pytest.mark.parametrize("text", ["naïve café 😀 déjà", "plain ascii text"])
def test_text_offsets_when_token_texts_do_not_concatenate(tokenizer: Any, text: str) -> None:
    """Byte tokens of one character decode to U+FFFD each: offsets fall back to decoded
    prefixes, stay inside the text and never decrease."""
    from radixrt.server.protocol import TokenText

    tt = TokenText(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    lp = TokenLogprobs([None] + [-1.0] * (len(ids) - 1), [[] for _ in ids], [[] for _ in ids])
    out = tt.prompt_logprobs(ids, lp, text)
    offs = out["text_offset"]
    assert offs[0] == 0 and offs == sorted(offs) and offs[-1] < len(text)
    for i in range(len(ids)):
        assert offs[i] == len(tokenizer.decode(ids[:i]).rstrip("\ufffd"))
    if "😀" in text:  # the emoji's byte tokens all start at the emoji
        assert [o for o, t in zip(offs, out["tokens"], strict=True) if t == "\ufffd"]
        assert offs[-1] == text.index("à")
