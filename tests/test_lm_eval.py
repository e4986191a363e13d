"""lm-evaluation-harness `local-completions` against the live server must score like lm-eval's `hf`
model on the same fp32 weights (issue 9).

Both sides load one fp32 HF export of the default SmolLM2 GGUF. The local tasks (tests/lm_eval_tasks)
are a 3-shot multiple-choice task (loglikelihood: `echo` + `logprobs` over the prompt) and a
2-shot greedy `generate_until` task. Required: identical accuracy, per-sample log-likelihoods within
1e-4, identical greedy flags and generations; a second run against the warm server gives the same
numbers and hits the radix cache.

Contract pieces are also checked directly (tokenizer endpoints, echo schema) so a failure names
the missing piece instead of surfacing as a harness error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lmeval_helpers import (
    TASKS,
    evaluate,
    hf_model_args,
    materialize_tasks,
    per_sample,
    task_metrics,
)
from prometheus_client.parser import text_string_to_metric_families
from test_server import LiveServer, start_server, stop_server

LL_TOL = 1e-4
SERVED_NAME = "smollm2-fp32"
# local-completions results by tokenizer backend: the warm rerun reuses the `remote` run as its
# first run instead of evaluating once more (~35 s on 2 cores).
RUNS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def hf_dir(smollm2_hf_dir: Path) -> Path:
    return smollm2_hf_dir


@pytest.fixture(scope="module")
def include_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def hf_ref(hf_dir: Path, include_path: Path) -> dict[str, Any]:
    """lm-eval's own `hf` model: the reference numbers."""
    return evaluate("hf", hf_model_args(hf_dir), include_path, batch_size=1)


@pytest.fixture(scope="module")
def live(hf_dir: Path) -> Iterator[LiveServer]:
    srv = start_server(str(hf_dir), "--dtype", "float32", "--num-threads", "2",
                       "--served-model-name", SERVED_NAME)
    yield srv
    stop_server(srv)


def local_completions(srv: LiveServer, include_path: Path, tokenizer_backend: str,
                      hf_dir: Path) -> dict[str, Any]:
    args = [f"base_url={srv.url}/v1/completions", f"model={SERVED_NAME}",
            f"tokenizer_backend={tokenizer_backend}", "num_concurrent=2", "max_retries=1",
            "batch_size=4", "timeout=120"]
    if tokenizer_backend == "huggingface":
        args.append(f"tokenizer={hf_dir}")  # the served name is no HF repo
    return evaluate("local-completions", ",".join(args), include_path)


def cached_prompt_tokens(srv: LiveServer) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "radixrt:cached_prompt_tokens_total" and not s.labels:
                return s.value
    raise AssertionError("radixrt:cached_prompt_tokens_total not exported")


def assert_same_scores(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """Per-sample equality first (it names the doc), then the aggregates."""
    for task in TASKS:
        g, r = per_sample(got, task), per_sample(ref, task)
        assert g.keys() == r.keys(), task
        for doc_id in sorted(r):
            a, b = g[doc_id], r[doc_id]
            assert a["prompt"] == b["prompt"], (task, doc_id)
            if "ll" in b:
                diffs = [abs(x - y) for x, y in zip(a["ll"], b["ll"], strict=True)]
                assert max(diffs) <= LL_TOL, (
                    f"{task} doc {doc_id}: log-likelihoods {a['ll']} vs hf {b['ll']}")
                assert a["greedy"] == b["greedy"], (task, doc_id, a["greedy"], b["greedy"])
            else:
                assert a["text"] == b["text"], (task, doc_id, a["text"], b["text"])
        assert task_metrics(got, task) == task_metrics(ref, task), task


# -- the contract, piece by piece ----------------------------------------------------------------
@pytest.mark.slow
def test_tokenizer_endpoints(live: LiveServer, hf_dir: Path) -> None:
    """The shape lm-eval's RemoteTokenizer / check_remote_tokenizer_support probe (lm_eval/utils.py)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    r = httpx.get(live.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, f"GET /tokenizer_info: {r.status_code} {r.text[:200]}"
    info = r.json()
    assert info["eos_token"] == tok.eos_token and info.get("bos_token") == tok.bos_token
    text = "Question: What is 2 + 2?\nAnswer: 4<|im_end|>"
    r = httpx.post(live.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                   timeout=30)
    assert r.status_code == 200, f"POST /tokenize: {r.status_code} {r.text[:200]}"
    ids = r.json()["tokens"]
    assert ids == tok.encode(text, add_special_tokens=False)
    # RemoteTokenizer derives ids by tokenizing the token text
    eos = httpx.post(live.url + "/tokenize", json={"prompt": info["eos_token"],
                                                   "add_special_tokens": False}, timeout=30)
    assert eos.json()["tokens"] == [tok.eos_token_id]
    r = httpx.post(live.url + "/detokenize", json={"tokens": ids}, timeout=30)
    assert r.status_code == 200, f"POST /detokenize: {r.status_code} {r.text[:200]}"
    assert r.json()["prompt"] == text


@pytest.mark.slow
def test_echo_logprobs_cover_the_prompt(live: LiveServer, hf_dir: Path) -> None:
    """lm-eval's loglikelihood payload: echo + logprobs + max_tokens 1 over a batch of id lists."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    prompts = [tok.encode(s) for s in ("Question: What color is grass?\nAnswer: green",
                                       "The capital of France is Paris")]
    body = {"model": SERVED_NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(prompts)))
    for c, ids in zip(choices, prompts, strict=True):
        lp = c["logprobs"]
        n = len(ids) + 1  # prompt + the generated token
        assert len(lp["token_logprobs"]) == n, (
            f"token_logprobs has {len(lp['token_logprobs'])} entries for a {len(ids)}-token "
            f"prompt + 1 generated token: prompt logprobs missing")
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for v, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert isinstance(v, float) and v <= 0 and not math.isnan(v)
            assert isinstance(top, dict) and max(top.values()) >= v
        assert "".join(lp["tokens"][:-1]) == tok.decode(ids)
    # prompt scores only
    r = httpx.post(live.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60)
    assert r.status_code == 200, r.text
    for c, ids in zip(r.json()["choices"], prompts, strict=True):
        assert len(c["logprobs"]["token_logprobs"]) == len(ids)
        assert c["text"] == tok.decode(ids)


# -- lm-eval end to end ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tokenizer_backend", ["huggingface", "remote"])
def test_local_completions_matches_hf(live: LiveServer, hf_ref: dict[str, Any], include_path: Path,
                                      hf_dir: Path, tokenizer_backend: str) -> None:
    """`huggingface` isolates scoring (local tokenizer); `remote` is the no-local-tokenizer path."""
    got = RUNS[tokenizer_backend] = local_completions(live, include_path, tokenizer_backend,
                                                      hf_dir)
    assert_same_scores(got, hf_ref)
    live.assert_clean()


@pytest.mark.slow
def test_warm_rerun_same_numbers_and_cache_hits(live: LiveServer, hf_ref: dict[str, Any],
                                                include_path: Path, hf_dir: Path) -> None:
    first = RUNS.get("remote") or local_completions(live, include_path, "remote", hf_dir)
    live.wait_idle()
    before = cached_prompt_tokens(live)
    second = local_completions(live, include_path, "remote", hf_dir)
    live.wait_idle()
    assert_same_scores(second, first)
    assert_same_scores(second, hf_ref)
    assert cached_prompt_tokens(live) > before
