"""The OpenAI-compatible server against a live process on loopback (tiny random model)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixrt import Engine, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    api_key: str | None = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=60)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=30)

    def wait_idle(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.get("/debug/stats").json()
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return
            time.sleep(0.05)
        raise TimeoutError("server did not become idle")

    def assert_clean(self) -> None:
        self.wait_idle()
        r = self.get("/debug/check_invariants")
        assert r.status_code == 200 and r.json() == {"ok": True}, r.text


def start_server(model_dir: str, *extra: str) -> LiveServer:
    port = free_port()
    cmd = [sys.executable, "-m", "radixrt", "serve", "--model", model_dir, "--port", str(port),
           "--max-total-tokens", "8192", "--num-threads", "1", "--dtype", "float32", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
                return LiveServer(proc, url, key)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server did not start")


def stop_server(server: LiveServer) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[LiveServer]:
    srv = start_server(str(tiny_llama_dir))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Iterator[Engine]:
    with Engine(model_path=str(tiny_llama_dir), max_total_tokens=8192, num_threads=1,
                dtype="float32") as eng:
        yield eng


LONG = " ".join(["Radix trees share prefixes so caches keep what was computed once."] * 6)


def test_http_process_yields_to_the_scheduler(server):
    """Under `radixrt serve` the HTTP process lowers its own priority once its children run:
    the scheduler keeps ours, the HTTP process and the detokenizer are `helper_nice` (10) below."""
    import psutil

    me = os.getpriority(os.PRIO_PROCESS, 0)
    http = psutil.Process(server.proc.pid)
    kids = {("scheduler" if any("scheduler.pkl" in a for a in c.cmdline()) else "detokenizer"): c
            for c in http.children()}
    assert set(kids) == {"scheduler", "detokenizer"}
    assert http.nice() == min(19, me + 10)
    assert kids["detokenizer"].nice() == min(19, me + 10)
    assert kids["scheduler"].nice() == me
    assert server.get("/health").json()["status"] == "ok"


def test_http_process_runs_uvloop_and_httptools(server):
    """`radixrt serve` streams on uvloop's event loop with httptools' parser (dependencies of
    the project): the HTTP process has both compiled modules mapped, and `asgi_stack` names them."""
    import psutil

    from radixrt.server.http import asgi_stack

    assert asgi_stack() == ("uvloop", "httptools")
    mapped = {m.path for m in psutil.Process(server.proc.pid).memory_maps()}
    assert any("/uvloop/loop." in p for p in mapped), sorted(mapped)
    assert any("/httptools/parser/parser." in p for p in mapped), sorted(mapped)


def test_models_and_health(server):
    """`models.list()` and `models.retrieve(id)` through the openai SDK: one model, found by its
    served name or `default`; any other id is the SDK's NotFoundError with `model_not_found`."""
    import openai

    c = server.client()
    (listed,) = c.models.list().data
    assert listed.object == "model" and listed.id and listed.model_extra["max_model_len"] > 0
    assert c.models.retrieve(listed.id) == listed
    assert c.models.retrieve("default") == listed
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("org/" + listed.id)  # a slash in the id still reaches the route
    assert e.value.code == "model_not_found" and listed.id in e.value.message
    assert server.get("/health").json()["status"] == "ok"


def test_responses_api_matches_chat_live(server, engine):
    """`/v1/responses` through the openai SDK on the real model: greedy text and logprobs as
    the engine's chat / the chat endpoint's, streamed as not, `max_output_tokens` reached →
    `incomplete`, and `previous_response_id` continuing a conversation whose prefix the radix
    cache holds (reported as cached input tokens)."""
    c = server.client()
    msgs = [{"role": "system", "content": LONG}, {"role": "user", "content": "Hello there"}]
    ref = engine.chat(msgs, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    kw = dict(model="default", instructions=LONG, input="Hello there", max_output_tokens=8,
              temperature=0, extra_body={"ignore_eos": True})
    r = c.responses.create(**kw)
    assert r.output_text == ref.text and r.usage.output_tokens == 8
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(c.responses.create(**kw, stream=True))
    deltas = [ev.delta for ev in events if ev.type == "response.output_text.delta"]
    last = events[-1]  # the SDK's stream helper wants `response.completed`, not this
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert "".join(deltas) == last.response.output_text == ref.text

    lp = c.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = c.chat.completions.create(model="default", messages=msgs, max_tokens=8, temperature=0,
                                     logprobs=True, top_logprobs=2,
                                     extra_body={"ignore_eos": True})
    got = lp.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [t.token for t in got] == [t.token for t in want] and len(got) == 8
    assert all(abs(a.logprob - b.logprob) < 1e-4 and len(a.top_logprobs) == 2
               for a, b in zip(got, want, strict=True))

    # instructions are not carried over (OpenAI's rule): a caller sends them again
    follow = c.responses.create(model="default", input="And then?", previous_response_id=r.id,
                                instructions=LONG, max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 8
    history = msgs + [{"role": "assistant", "content": r.output_text},
                      {"role": "user", "content": "And then?"}]
    ref2 = engine.chat(history, SamplingParams(max_new_tokens=4, temperature=0))
    assert follow.output_text == ref2.text
    alone = c.responses.create(model="default", input="And then?", previous_response_id=r.id,
                               max_output_tokens=4, temperature=0)
    ref3 = engine.chat(history[1:], SamplingParams(max_new_tokens=4, temperature=0))
    assert alone.output_text == ref3.text and alone.usage.input_tokens < follow.usage.input_tokens
    assert c.responses.retrieve(follow.id).output_text == follow.output_text


def test_completion_greedy_equals_engine(server, engine):
    c = server.client()
    r = c.completions.create(model="default", prompt="The quick brown fox", max_tokens=12,
                             temperature=0, extra_body={"ignore_eos": True})
    ref = engine.generate("The quick brown fox", SamplingParams(max_new_tokens=12, temperature=0,
                                                                ignore_eos=True))
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == ref.prompt_tokens
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.created > 0


def test_streaming_completion_and_usage(server, engine):
    c = server.client()
    chunks = list(c.completions.create(model="default", prompt="Radix trees", max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    ref = engine.generate("Radix trees", SamplingParams(max_new_tokens=10, temperature=0,
                                                        ignore_eos=True))
    assert text == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])


def test_outputs_are_read_on_the_apps_event_loop(engine):
    """While an app from `create_app` serves, the engine's outputs are read on the app's event
    loop (no receive-thread hand-off per step): streamed and plain completions through the
    openai SDK equal the engine's own; afterwards the receive thread reads again (a blocking
    `generate` answers) and a new app takes the reading over on its own loop."""
    from starlette.testclient import TestClient

    from radixrt.config import ServerArgs
    from radixrt.server.http import create_app

    sp = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    ref = engine.generate("Radix trees", sp)
    for _ in range(2):
        with TestClient(create_app(engine, ServerArgs())) as http:
            assert engine._tm._reader_loop is not None
            c = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                              http_client=http)
            chunks = list(c.completions.create(model="default", prompt="Radix trees",
                                               max_tokens=10, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
            r = c.completions.create(model="default", prompt="Radix trees", max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == ref.text
        assert engine._tm._reader_loop is None
        assert engine.generate("Radix trees", sp).text == ref.text
    engine.check_invariants()


def test_stream_interval_through_the_openai_sdk(tiny_llama_dir, engine):
    """`radixrt serve --stream-interval 3`, driven by the openai SDK: a stream's first token
    comes alone, then 3 tokens a chunk, the rest with the last; the text is per-token
    streaming's; a stop string cuts where it does at interval 1; non-streamed is the same."""
    srv = start_server(str(tiny_llama_dir), "--stream-interval", "3")
    try:
        c = srv.client()
        kw = dict(model="default", prompt="Radix trees", max_tokens=11, temperature=0,
                  extra_body={"ignore_eos": True})
        ref = engine.generate("Radix trees", SamplingParams(max_new_tokens=11, temperature=0,
                                                            ignore_eos=True))
        chunks = list(c.completions.create(**kw, stream=True, logprobs=1))
        sizes = [len(ch.choices[0].logprobs.tokens) for ch in chunks
                 if ch.choices and ch.choices[0].logprobs]
        assert sizes == [1, 3, 3, 3, 1]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        assert c.completions.create(**kw).choices[0].text == ref.text
        chat = list(c.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hello"}], max_tokens=11,
            temperature=0, stream=True, logprobs=True))
        assert [len(ch.choices[0].logprobs.content) for ch in chat
                if ch.choices and ch.choices[0].logprobs] == [1, 3, 3, 3, 1]
        stop = ref.text[4:7]
        cut = ref.text[: ref.text.index(stop)]
        for stream in (True, False):
            r = c.completions.create(**kw, stop=[stop], stream=stream)
            got = [r] if not stream else [ch for ch in r if ch.choices]
            assert "".join(ch.choices[0].text for ch in got) == cut
            assert got[-1].choices[0].finish_reason == "stop"
        srv.assert_clean()
    finally:
        stop_server(srv)


def test_speculative_ngram_through_the_openai_sdk(tiny_llama_dir, engine):
    """`radixrt serve --speculative-algorithm ngram`, driven by the openai SDK: greedy text
    (completions and chat, streamed and not, a stop string) equals the Engine's without
    speculation while drafts were accepted (the tiny model repeats itself); a sampled request
    beside it still runs; /metrics counts drafts and accepted ones."""
    srv = start_server(str(tiny_llama_dir), "--speculative-algorithm", "ngram")
    try:
        c = srv.client()
        prompt = "one two three one two three one two"
        kw = dict(model="default", prompt=prompt, max_tokens=40, temperature=0,
                  extra_body={"ignore_eos": True})
        ref = engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0,
                                                     ignore_eos=True))
        assert c.completions.create(**kw).choices[0].text == ref.text
        chunks = list(c.completions.create(**kw, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
        stop = ref.text[10:14]
        r = c.completions.create(**kw, stop=[stop])
        assert r.choices[0].text == ref.text[: ref.text.index(stop)]
        assert r.choices[0].finish_reason == "stop"
        msgs = [{"role": "user", "content": prompt}]
        ref_chat = engine.chat(msgs, SamplingParams(max_new_tokens=30, temperature=0))
        got = c.chat.completions.create(model="default", messages=msgs, max_tokens=30,
                                        temperature=0)
        assert got.choices[0].message.content == ref_chat.text
        sampled = c.completions.create(model="default", prompt=prompt, max_tokens=12,
                                       temperature=0.8, seed=3, extra_body={"ignore_eos": True})
        assert sampled.usage.completion_tokens == 12
        stats = srv.get("/debug/stats").json()
        assert 0 < stats["spec_accepted_tokens_total"] <= stats["spec_draft_tokens_total"]
        metrics = srv.get("/metrics").text
        m = re.search(r"^radixrt:spec_decode_num_accepted_tokens_total ([0-9.e+]+)$", metrics,
                      re.M)
        assert m and float(m.group(1)) == stats["spec_accepted_tokens_total"]
        srv.assert_clean()
    finally:
        stop_server(srv)


def test_logit_bias_through_the_openai_sdk(server, engine):
    """`logit_bias` (string token ids, as the SDK sends them): +100 makes greedy pick the token
    every step; -100 on the unbiased first token moves it; the text equals the Engine's with
    the same bias, completions and chat, streamed and not."""
    c = server.client()
    kw = dict(model="default", prompt="Radix trees", max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    plain = engine.generate("Radix trees", SamplingParams(max_new_tokens=6, temperature=0,
                                                          ignore_eos=True))
    forced = c.completions.create(**kw, logit_bias={"42": 100}, logprobs=0)
    assert forced.choices[0].logprobs is not None
    ref = engine.generate("Radix trees", SamplingParams(max_new_tokens=6, temperature=0,
                                                        ignore_eos=True, logit_bias={42: 100}))
    assert ref.token_ids == [42] * 6 and forced.choices[0].text == ref.text
    moved = {str(plain.token_ids[0]): -100}
    ref = engine.generate("Radix trees", SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True, logit_bias={plain.token_ids[0]: -100}))
    assert ref.token_ids[0] != plain.token_ids[0]
    assert c.completions.create(**kw, logit_bias=moved).choices[0].text == ref.text
    chunks = c.completions.create(**kw, logit_bias=moved, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    msgs = [{"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model="default", messages=msgs, max_tokens=4,
                                     temperature=0, logit_bias={"42": 100})
    assert chat.choices[0].message.content == engine.chat(msgs, SamplingParams(
        max_new_tokens=4, temperature=0, logit_bias={42: 100})).text
    server.assert_clean()


def test_chat_stream_and_not(server, engine):
    c = server.client()
    msgs = [{"role": "system", "content": LONG}, {"role": "user", "content": "Hello there"}]
    r = c.chat.completions.create(model="default", messages=msgs, max_tokens=8, temperature=0)
    ref = engine.chat(msgs, SamplingParams(max_new_tokens=8, temperature=0))
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    stream = c.chat.completions.create(model="default", messages=msgs, max_tokens=8,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    # The second request shares the long system prompt: reported as cached.
    r2 = c.chat.completions.create(model="default", messages=[msgs[0], {
        "role": "user", "content": "Something else entirely"}], max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 50


def test_n_seed_stop_logprobs(server):
    c = server.client()
    kw = dict(model="default", prompt=LONG, max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = c.completions.create(**kw)
    b = c.completions.create(**kw)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) > 1  # seed + i per sample: different samples
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert a.usage.completion_tokens == 36
    base = c.completions.create(model="default", prompt="Radix", max_tokens=30, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    cut = c.completions.create(model="default", prompt="Radix", max_tokens=30, temperature=0,
                               stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    lp = c.completions.create(model="default", prompt="Radix", max_tokens=3, temperature=0,
                              logprobs=2).choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(len(t) <= 3 for t in lp.top_logprobs)
    chat = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    echo = c.completions.create(model="default", prompt="Radix", max_tokens=3, temperature=0,
                                echo=True).choices[0].text
    assert echo.startswith("Radix")


def test_echo_logprobs_cover_the_prompt(server, engine):
    """echo + logprobs: prompt scores (token 0 null) then the generated tokens', equal to the
    Engine's `prompt_logprobs` for the same prompt; a repeat (scores now read from the radix
    tree, which keeps the top-1 alternative: logprobs 1, as lm-eval asks) agrees."""
    # Prompts no other test sends: a prefix first cached by a request that scored nothing holds
    # K/V that is not batch-invariant ("exact"), which scoring requests do not build on.
    prompts = ["Scoring: " + LONG, "Prompt scores come back from the tree"]
    body = {"model": "default", "prompt": prompts, "echo": True, "logprobs": 1,
            "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wide = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 2},
                      timeout=60).json()
    for out, k in ((first, 1), (again, 1), (wide, 2)):
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for c, p in zip(out["choices"], prompts, strict=True):
            ref = engine.generate(p, SamplingParams(max_new_tokens=2, temperature=0,
                                                    ignore_eos=True, logprobs=True,
                                                    top_logprobs=k,
                                                    logprob_start_len=0))
            n = ref.prompt_tokens
            lp = c["logprobs"]
            assert c["text"] == p + ref.text
            assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 2
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert ref.prompt_logprobs is not None
            assert lp["token_logprobs"][1:n] == pytest.approx(
                ref.prompt_logprobs.token_logprobs[1:], abs=1e-4)
            for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
                assert max(top.values()) >= v and len(top) <= k + 1
            assert lp["text_offset"][n] == len(p)
    # max_tokens 0: the prompt and its scores only
    r = server.client().completions.create(model="default", prompt=prompts[1], echo=True,
                                           logprobs=1, max_tokens=0)
    assert r.choices[0].text == prompts[1] and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.prompt_tokens
    # streaming: the first chunk carries the prompt and its scores
    chunks = list(server.client().completions.create(
        model="default", prompt=prompts[1], echo=True, logprobs=1, max_tokens=3,
        temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == prompts[1]
    assert len(chunks[0].choices[0].logprobs.token_logprobs) == r.usage.prompt_tokens
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks[1:]
               if ch.choices and ch.choices[0].logprobs) == 3
    server.assert_clean()


def test_server_info_reports_what_start_up_resolved(server, tiny_llama_dir):
    """`/get_server_info`: the flags as given and what the engine resolved from them."""
    info = server.get("/get_server_info").json()
    args, eng = info["server_args"], info["engine"]
    assert args["model_path"] == str(tiny_llama_dir) and args["dtype"] == "float32"
    assert args["quantization"] == "auto" and args["api_key"] is None
    assert eng["dtype"] == "torch.float32" and eng["quantization"] == "none"  # conftest: none
    assert eng["max_total_tokens"] == 8192 and eng["num_threads"] == 1
    assert eng["dtype_probe"] is None  # an explicit dtype is not probed
    assert eng["kv_cache_dtype"] == "float32"  # the dense fp32 reference keeps fp32 K/V


def test_tokenizer_endpoints_live(server, tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    info = server.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["vocab_size"] >= len(tok)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Radix trees<|im_end|>",
                                                    "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode("Radix trees<|im_end|>", add_special_tokens=False)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert text == {"prompt": "Radix trees<|im_end|>"}


def test_generate_progress_bar(engine, capsys):
    sp = SamplingParams(max_new_tokens=2, temperature=0)
    engine.generate(["one two", "three four", "five six"], sp)
    err = capsys.readouterr().err
    assert "Generating" in err and "3/3" in err
    engine.generate(["one two", "three four"], sp, use_tqdm=False)
    engine.generate("one prompt", sp)
    assert "Generating" not in capsys.readouterr().err


BAD = [
    # (endpoint, body or raw bytes, status, param); a leading "/" is a path at the server root
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "echo": False, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": [1] * 2000, "echo": True, "logprobs": 1, "max_tokens": 0}, 400,
     "prompt"),
    ("/tokenize", {"prompt": ["not", "a string"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"prompt": "x"}, 400, "tokens"),
    ("completions", b"{not json", 400, None),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "four"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("completions", {"prompt": [1] * 2000}, 400, "prompt"),
    ("completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     400, "max_tokens"),
    ("completions", {"prompt": "x" * (9 * 2**20)}, 413, None),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD)
def test_bad_input_table(server, endpoint, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = endpoint if endpoint.startswith("/") else f"/v1/{endpoint}"
    r = httpx.post(server.url + path, content=data,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = server.client().completions.create(model="default", prompt="still fine", max_tokens=2,
                                            temperature=0)
    assert ok.choices[0].text is not None


def test_64_concurrent_streams_with_16_disconnects(server):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": "default", "prompt": f"{LONG} request {i}", "max_tokens": 40,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        n, generated = 0, 0
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    obj = json.loads(line[6:])
                    assert "error" not in obj
                    n += 1
                    if i < 16 and n == 2:
                        return -1  # hang up mid-stream
                    if not obj["choices"]:
                        generated = obj["usage"]["completion_tokens"]
                if line == "data: [DONE]":
                    return generated
        return generated

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert results[:16] == [-1] * 16
    assert results[16:] == [40] * 48
    server.assert_clean()


def test_continue_final_message_live(server, engine):
    """An assistant prefix continued (`continue_final_message`): the endpoint's greedy text is
    the Engine's from the same options, whose prompt ends inside the assistant's turn."""
    msgs = [{"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Radix trees share"}]
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    ref = engine.chat(msgs, sp, continue_final_message=True)
    ids = engine.apply_chat_template(msgs, add_generation_prompt=False,
                                     continue_final_message=True)
    assert ref.prompt_tokens == len(ids)
    assert engine.tokenizer.decode(ids).endswith("Radix trees share")
    assert ref.token_ids == engine.generate(input_ids=ids, sampling_params=sp).token_ids
    assert engine.chat(msgs, sp).prompt_tokens > len(ids)  # a closed turn + a new one
    r = server.client().chat.completions.create(
        model="default", messages=msgs, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "ignore_eos": True})
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids)


def test_concurrent_response_streams_with_hang_ups(server):
    """`/v1/responses` streams: 24 at once, 8 hanging up after their third event; the others
    end with `response.incomplete` carrying every token, and no slot or row is left behind."""
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": "default", "input": f"{LONG} request {i}", "max_output_tokens": 12,
                "temperature": 0, "stream": True, "ignore_eos": True, "store": i % 2 == 0}
        events = []
        async with client.stream("POST", f"{server.url}/v1/responses", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if i < 8 and len(events) == 3:
                        return -1  # hang up mid-stream
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.incomplete"
        return events[-1]["response"]["usage"]["output_tokens"]

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    assert asyncio.run(run()) == [-1] * 8 + [12] * 16
    server.assert_clean()


def test_metrics_parse_and_move(server):
    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not s.labels:
                    out[s.name] = s.value
        return out

    before = scrape()
    c = server.client()
    for _ in range(3):
        c.completions.create(model="default", prompt=LONG, max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    server.wait_idle()
    after = scrape()
    assert after["radixrt:requests_total"] - before["radixrt:requests_total"] == 3
    assert after["radixrt:generation_tokens_total"] - before["radixrt:generation_tokens_total"] == 15
    assert after["radixrt:cached_prompt_tokens_total"] > before["radixrt:cached_prompt_tokens_total"]
    assert after["radixrt:e2e_request_latency_seconds_count"] - before[
        "radixrt:e2e_request_latency_seconds_count"] == 3
    assert after["radixrt:time_to_first_token_seconds_count"] >= 3
    assert after["radixrt:num_running_reqs"] == 0
    c.completions.create(model="default", prompt="x", max_tokens=12, temperature=0,
                         extra_body={"regex": "radixtree[0-9]{2}"})
    grammar = scrape()
    assert grammar["radixrt:grammars_compiled_total"] > after["radixrt:grammars_compiled_total"]
    assert (grammar["radixrt:grammar_forced_tokens_total"]
            > after["radixrt:grammar_forced_tokens_total"])  # "radixtree" is forced
    for k, v in after.items():  # counters never go down
        if k.endswith("_total"):
            assert v >= before.get(k, 0), k
    assert httpx.post(server.url + "/flush_cache", timeout=30).json() == {"success": True}
    assert scrape()["radixrt:prompt_tokens_total"] == grammar["radixrt:prompt_tokens_total"]


def test_api_key_overload_and_dead_scheduler(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir), "--api-key", "sekret", "--max-running-requests",
                       "2", "--max-queued-requests", "2")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 200
        assert httpx.get(srv.url + "/get_server_info", timeout=30).status_code == 401
        given = srv.get("/get_server_info").json()["server_args"]
        assert given["api_key"] == "<redacted>" and "sekret" not in json.dumps(given)
        c = srv.client()
        assert c.completions.create(model="default", prompt="hi", max_tokens=2).choices

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120, headers=srv.headers()) as client:
                body = {"prompt": LONG, "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(*(client.post(srv.url + "/v1/completions",
                                                          json=body) for _ in range(10)))

        codes = [r.status_code for r in asyncio.run(flood())]
        assert codes.count(429) >= 1 and codes.count(200) >= 4
        srv.assert_clean()
        # Kill the scheduler: /health turns 503 and an in-flight request fails fast.
        pids = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True,
                              text=True).stdout.split()
        sched = [p for p in pids if "scheduler.pkl" in open(f"/proc/{p}/cmdline").read()]
        assert len(sched) == 1

        async def inflight() -> list[dict]:
            """A streaming request killed mid-flight: it must end with an error event."""
            events: list[dict] = []
            async with httpx.AsyncClient(timeout=60, headers=srv.headers()) as client:
                body = {"prompt": LONG, "max_tokens": 900, "ignore_eos": True, "stream": True}
                async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    t0 = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        events.append(json.loads(line[6:]))
                        if t0 is None:  # the request is running: kill the scheduler now
                            os.kill(int(sched[0]), signal.SIGKILL)
                            t0 = time.monotonic()
                    assert t0 is not None and time.monotonic() - t0 < 10
            return events

        events = asyncio.run(inflight())
        assert events[-1]["error"]["type"] == "service_unavailable"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=srv.headers(),
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
    finally:
        stop_server(srv)
    assert srv.proc.returncode is not None


def test_sigterm_stops_every_process(tiny_llama_dir):
    srv = start_server(str(tiny_llama_dir))
    kids = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True,
                          text=True).stdout.split()
    assert len(kids) == 2
    sockdir = os.path.dirname(next(a for a in open(f"/proc/{kids[0]}/cmdline").read().split("\0")
                                   if a.endswith(".pkl")))
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    for k in kids:
        assert not os.path.exists(f"/proc/{k}") or open(f"/proc/{k}/stat").read().split()[2] == "Z"
    assert not os.path.exists(sockdir)


def test_non_streaming_request_aborted_when_client_disconnects(server):
    """A non-streaming client that hangs up must not leave its samples generating."""
    server.wait_idle()
    before = server.get("/debug/stats").json()
    max_tokens = 1000
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "n": 2}
    # Send it on a raw connection and hang up once tokens are being generated (a fixed client
    # timeout raced the tiny model: at ~2000 tokens/s both samples could all but finish first).
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    deadline = time.monotonic() + 30
    while (server.get("/debug/stats").json()["generated_tokens_total"]
           - before["generated_tokens_total"]) < 4:
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.005)
    conn.close()
    deadline = time.monotonic() + 10
    while server.get("/debug/stats").json()["num_running"] != 0:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    after = server.get("/debug/stats").json()
    generated = after["generated_tokens_total"] - before["generated_tokens_total"]
    assert after["num_finished_requests_total"] - before["num_finished_requests_total"] == 2
    # Cut short: well below the two samples' full budgets (timing-tolerant on a loaded machine).
    assert 0 < generated < 2 * max_tokens - 200
    server.assert_clean()
    ok = server.client().completions.create(model="default", prompt="still serving",
                                            max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_guard_is_plain_asgi_around_streams_and_errors() -> None:
    """The API-key / body-size guard (`radixrt.server.guard.add_guard`, used by `radixrt serve`
    and `radixrt router`) refuses with OpenAI-style 401 / 413 bodies, lets open paths through
    without the key, passes a streamed response's chunks through as the endpoint yields them,
    and turns an `ApiError` raised by an endpoint, an unknown URL and a wrong method into
    OpenAI-style responses. It is plain ASGI: no
    Starlette BaseHTTPMiddleware (`@app.middleware("http")`), which moves every streamed chunk
    through a memory stream between two tasks."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.testclient import TestClient

    from radixrt.server.guard import add_guard
    from radixrt.server.protocol import ApiError

    app = FastAPI()
    add_guard(app, "sekret", 64, ("/health",))

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():  # type: ignore[no-untyped-def]
            for i in range(5):
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/bad")
    async def bad_request() -> None:
        raise ApiError(400, "n must be positive", param="n", code="invalid_value")

    assert not any(m.cls is BaseHTTPMiddleware for m in app.user_middleware)
    key = {"Authorization": "Bearer sekret"}
    with TestClient(app) as c:
        r = c.post("/stream")
        assert r.status_code == 401
        assert r.json()["error"] == {"message": "invalid or missing API key",
                                     "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}
        assert c.post("/stream", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/health").json() == {"ok": True}
        r = c.post("/stream", headers=key, content=b"x" * 65)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        with c.stream("POST", "/stream", headers=key) as r:
            assert r.status_code == 200
            assert list(r.iter_lines()) == [line for i in range(5)
                                            for line in (f"data: {i}", "")]
        r = c.post("/bad", headers=key)
        assert r.status_code == 400
        assert r.json()["error"] == {"message": "n must be positive",
                                     "type": "invalid_request_error", "param": "n",
                                     "code": "invalid_value"}
        # the framework's own errors leave OpenAI-style too: an unknown URL, a wrong method
        r = c.post("/v1/nowhere", headers=key)
        assert r.status_code == 404
        assert r.json()["error"] == {"message": "unknown URL: POST /v1/nowhere",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "unknown_url"}
        r = c.post("/v1/conversations", headers=key)
        assert r.status_code == 404 and "previous_response_id" in r.json()["error"]["message"]
        r = c.get("/stream", headers=key)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_next_within_gives_items_in_order_then_times_out() -> None:
    """`radixrt.server.http.next_within`, through which a request group waits for its outputs:
    queued items come back in order, and an empty queue raises asyncio.TimeoutError after the
    timeout (the caller then checks that the runtime is alive), leaving later items intact."""
    from radixrt.server.http import next_within

    async def run() -> None:
        q: asyncio.Queue = asyncio.Queue()
        for i in range(3):
            q.put_nowait(i)
        assert [await next_within(q, 1.0) for _ in range(3)] == [0, 1, 2]
        t = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await next_within(q, 0.05)
        assert time.monotonic() - t >= 0.04
        asyncio.get_running_loop().call_later(0.01, q.put_nowait, "late")
        assert await next_within(q, 1.0) == "late"

    asyncio.run(run())
