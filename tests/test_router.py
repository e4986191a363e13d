"""`radixrt router` live, in front of two `radixrt serve` workers on a tiny random model:
same-prefix requests stick to one worker and different groups spread, streaming passthrough,
a client disconnect aborts the worker's request, bad / unreachable worker URLs give clear
errors, `/metrics` per worker, and a killed worker is detected and its traffic moves with no
request lost or duplicated."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import LiveServer, free_port, start_server, stop_server

SYSTEMS = ["Radix trees share prefixes; caches keep what was computed once. " * 3,
           "The quick brown fox jumps over the lazy dog. " * 4,
           "A system prompt, a few-shot preamble and a long tool description. " * 3,
           "Ünïcödé, emoji 🚲🔧 and 中文字符 also appear in real prompts. " * 3]


@dataclass
class Cluster:
    workers: list[LiveServer]
    router: subprocess.Popen
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                             timeout=60)

    def workers_state(self) -> dict[str, dict]:
        data = httpx.get(f"{self.url}/workers", timeout=10).json()
        return {w["url"]: w for w in data["workers"]}

    def routed(self) -> dict[str, int]:
        return {u: w["routed"] for u, w in self.workers_state().items()}


def start_router(model_dir: str, worker_urls: list[str], *extra: str) -> tuple[subprocess.Popen,
                                                                               str]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixrt", "router", "--model", model_dir, "--port", str(port),
           "--log-level", "warning", "--health-check-interval-s", "0.5",
           "--worker-url", *worker_urls, *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "router exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("router did not start")


# Longer than the tiny model can stream before a hang-up reaches the worker, on any CPU seen
# (~4000 tokens/s on a Zen 5 core finished 900 of them first); the model's context has room.
HANG_UP_MAX_TOKENS = 30000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from tiny_model import build_tiny_llama

    model = str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_32k"),
                                 max_position_embeddings=32768))
    workers = [start_server(model, "--max-total-tokens", "40000") for _ in range(2)]
    router = None
    try:
        router, url = start_router(model, [w.url for w in workers])
        yield Cluster(workers, router, url)
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
        for w in workers:
            stop_server(w)


def complete(c: Cluster, prompt: str, max_tokens: int = 4) -> openai.types.Completion:
    return c.client().completions.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})


def test_groups_stick_and_spread(cluster):
    before = cluster.routed()
    per_group: dict[int, list[int]] = {}
    for q in range(3):
        for g in (0, 1):
            r = complete(cluster, SYSTEMS[g] + f" question {q}")
            per_group.setdefault(g, []).append(r.usage.prompt_tokens_details.cached_tokens)
    delta = {u: n - before[u] for u, n in cluster.routed().items()}
    assert sorted(delta.values()) == [3, 3]  # one group per worker
    for cached in per_group.values():  # the group's later requests hit its worker's cache
        assert cached[0] < cached[1] and cached[1] > 20 and cached[2] > 20
    # Chat: routed on the whole rendered conversation, so a follow-up turn sticks too.
    msgs = [{"role": "system", "content": SYSTEMS[2]}, {"role": "user", "content": "hi"}]
    first = cluster.client().chat.completions.create(model="default", messages=msgs,
                                                     max_tokens=3, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "more"}]
    second = cluster.client().chat.completions.create(model="default", messages=msgs,
                                                      max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 30


def test_models_pass_through_by_id(cluster):
    """`models.retrieve(id)` through the router is a worker's answer, 404 included (the two
    workers started at different times: `created` may differ)."""
    c = cluster.client()
    (listed,) = c.models.list().data
    got = c.models.retrieve(listed.id)
    assert got.model_dump(exclude={"created"}) == listed.model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("not-" + listed.id)
    assert e.value.code == "model_not_found"


def test_responses_follow_their_worker(cluster):
    """A stored response lives on one worker: requests continuing it (streamed or not) and
    `retrieve` / `input_items` / `delete` go there, however the policy would route their own
    prompt."""
    c = cluster.client()
    chain, owners = [], set()
    for stream in (False, True, False, True):
        kw = dict(model="default", input=SYSTEMS[len(chain) % 4] + " next?", max_output_tokens=3,
                  temperature=0, extra_body={"ignore_eos": True})
        if chain:
            kw["previous_response_id"] = chain[-1]
        if stream:
            events = list(c.responses.create(**kw, stream=True))
            assert events[-1].type == "response.incomplete"  # max_output_tokens reached
            rid = events[-1].response.id
        else:
            rid = c.responses.create(**kw).id
        chain.append(rid)
        # only the owner knows it: ask each worker directly
        owners.add(tuple(httpx.get(f"{w.url}/v1/responses/{rid}", timeout=10).status_code
                         for w in cluster.workers))
    assert owners in ({(200, 404)}, {(404, 200)})  # every link on the first one's worker
    last = c.responses.retrieve(chain[-1])
    assert last.previous_response_id == chain[-2]
    (item,) = c.responses.input_items.list(chain[-1]).data
    assert item.content[0].text == SYSTEMS[3] + " next?"
    c.responses.delete(chain[0])
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(chain[0])
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="default", input="x", previous_response_id=chain[0])
    assert e.value.code == "previous_response_not_found"


def test_streaming_passthrough_equals_non_streamed(cluster):
    prompt = SYSTEMS[3] + " stream"
    full = complete(cluster, prompt, max_tokens=12)
    text, usage = "", None
    for ev in cluster.client().completions.create(
            model="default", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ev.choices:
            text += ev.choices[0].text
        if ev.usage:
            usage = ev.usage
    assert text == full.choices[0].text
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens > 30  # same worker as the first call


def test_client_disconnect_aborts_on_the_worker(cluster):
    async def hang_up() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"model": "default", "prompt": "Once upon a time",
                    "max_tokens": HANG_UP_MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{cluster.url}/v1/completions",
                                     json=body) as resp:
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data:")
                    if n >= 3:
                        break  # leave with the stream open: the router must close upstream

    before = [w.get("/debug/stats").json() for w in cluster.workers]
    asyncio.run(hang_up())
    deadline = time.monotonic() + 15
    while True:
        stats = [w.get("/debug/stats").json() for w in cluster.workers]
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            break
        assert time.monotonic() < deadline, "the abandoned stream kept generating"
        time.sleep(0.05)
    generated = sum(a["generated_tokens_total"] - b["generated_tokens_total"]
                    for a, b in zip(stats, before, strict=True))
    assert 0 < generated < HANG_UP_MAX_TOKENS // 2
    for w in cluster.workers:
        w.assert_clean()
    assert all(w["load"] == 0 for w in cluster.workers_state().values())


@pytest.mark.parametrize("url,code", [
    ("ftp://127.0.0.1:1", "invalid_worker_url"),
    ("not a url", "invalid_worker_url"),
    (None, None),
])
def test_bad_worker_urls(cluster, url, code):
    r = httpx.post(f"{cluster.url}/workers", json={"url": url}, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "url" and err["code"] == code


def test_unreachable_and_unknown_workers(cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    r = httpx.post(f"{cluster.url}/workers", json={"url": dead}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "worker_unreachable" and dead in err["message"]
    assert "ConnectError" in err["message"]
    r = httpx.post(f"{cluster.url}/workers", json={"url": cluster.workers[0].url}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "worker_exists"
    r = httpx.delete(f"{cluster.url}/workers/{quote(dead, safe='')}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
    assert set(cluster.workers_state()) == {w.url for w in cluster.workers}


def test_remove_and_add_a_worker_at_run_time(cluster):
    w1 = cluster.workers[1].url
    r = httpx.delete(f"{cluster.url}/workers/{quote(w1, safe='')}", timeout=10)
    assert r.status_code == 200 and [w["url"] for w in r.json()["workers"]] == [
        cluster.workers[0].url]
    before = cluster.routed()
    for g in range(4):
        complete(cluster, SYSTEMS[g] + " only one worker")
    assert cluster.routed()[cluster.workers[0].url] - before[cluster.workers[0].url] == 4
    r = httpx.post(f"{cluster.url}/workers", json={"url": w1 + "/"}, timeout=30)
    assert r.status_code == 200 and {w["url"] for w in r.json()["workers"]} == {
        w.url for w in cluster.workers}


def test_metrics_per_worker(cluster):
    complete(cluster, SYSTEMS[0] + " metrics")
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    routed = {s.labels["worker"]: s.value for s in fams["radixrt_router:requests_routed"].samples
              if s.name.endswith("_total")}
    assert set(routed) == {w.url for w in cluster.workers} and sum(routed.values()) > 0
    for name in ("radixrt_router:load", "radixrt_router:healthy", "radixrt_router:tree_tokens",
                 "radixrt_router:errors", "radixrt_router:cache_routed"):
        assert {s.labels["worker"] for s in fams[name].samples} == set(routed), name


def router_counters(c: Cluster) -> dict[str, float]:
    """Sum over workers of each radixrt_router counter."""
    text = httpx.get(f"{c.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_measured_hits_from_the_workers_usage(cluster):
    """The router counts the cached tokens the workers report (non-streamed answers and the
    usage chunk of a stream) beside its predicted hits."""
    before = router_counters(cluster)
    prompt = SYSTEMS[1] + " measured"
    seen_prompt = seen_cached = 0
    r = complete(cluster, prompt + " one")
    seen_prompt += r.usage.prompt_tokens
    seen_cached += r.usage.prompt_tokens_details.cached_tokens
    usage = None
    for ev in cluster.client().completions.create(
            model="default", prompt=prompt + " two", max_tokens=3, stream=True,
            stream_options={"include_usage": True}):
        usage = ev.usage or usage
    assert usage is not None
    seen_prompt += usage.prompt_tokens
    seen_cached += usage.prompt_tokens_details.cached_tokens
    after = router_counters(cluster)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("radixrt_router:measured_prompt_tokens_total") == seen_prompt
    assert delta("radixrt_router:measured_cached_tokens_total") == seen_cached > 20
    assert delta("radixrt_router:predicted_cached_tokens_total") > 20


def test_killed_worker_traffic_moves_without_loss_or_duplicates(cluster, tiny_llama_dir):
    """Last: kills worker 1. A second router with no health checks in the way (interval 1 h)
    still sends the victim's group there: each request fails to connect, is retried on the
    live worker, and every request gets exactly one answer (the live worker receives each
    exactly once); the main router's health check takes the victim out."""
    live, victim = cluster.workers
    proc, url = start_router(str(tiny_llama_dir), [w.url for w in cluster.workers],
                             "--health-check-interval-s", "3600")
    try:
        side = Cluster(cluster.workers, proc, url)
        # New groups are misses, spread by load then tree size: one soon lands on the victim.
        for k in range(6):
            system = f"Caches keep what was computed {k} times; the quick brown fox. " * 3
            before = side.routed()[victim.url]
            complete(side, system + " first")
            if side.routed()[victim.url] == before + 1:
                break
        else:
            pytest.fail("no new group was routed to the victim")
        victim.proc.kill()
        victim.proc.wait(10)
        before = live.get("/debug/stats").json()["num_requests_total"]
        n = 6

        async def burst() -> list[dict]:
            async with httpx.AsyncClient(timeout=60) as client:
                body = [{"model": "default", "prompt": system + f" after {i}", "max_tokens": 3,
                         "temperature": 0, "ignore_eos": True} for i in range(n)]
                rs = await asyncio.gather(*(client.post(f"{side.url}/v1/completions", json=b)
                                            for b in body))
                return [r.json() | {"status": r.status_code} for r in rs]

        results = asyncio.run(burst())
        assert [r["status"] for r in results] == [200] * n, results
        assert all(len(r["choices"]) == 1 and r["usage"]["completion_tokens"] == 3
                   for r in results)
        assert len({r["id"] for r in results}) == n
        live.wait_idle()
        assert live.get("/debug/stats").json()["num_requests_total"] - before == n  # once each
        state = side.workers_state()[victim.url]
        assert state["healthy"] is False and "ConnectError" in state["last_error"]
        text = httpx.get(f"{side.url}/metrics", timeout=10).text
        retries = [s.value for f in text_string_to_metric_families(text)
                   if f.name == "radixrt_router:retries" for s in f.samples]
        assert retries and retries[0] >= 1
        # A stream to the victim's group now goes straight to the live worker.
        ev = list(side.client().completions.create(
            model="default", prompt=system + " streamed", max_tokens=3, temperature=0,
            stream=True, extra_body={"ignore_eos": True}))
        assert "".join(e.choices[0].text for e in ev if e.choices)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    # The main router's health loop (0.5 s) took the victim out too.
    deadline = time.monotonic() + 10
    while cluster.workers_state()[victim.url]["healthy"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert complete(cluster, SYSTEMS[1] + " after the kill").usage.completion_tokens == 4
