"""`radixrt router`: cache-aware routing in front of radixrt servers (one per machine, or more).

OpenAI API passthrough: a completions or chat request is tokenized here (chat through the
template, as the worker will), a worker is picked by the routing policy (`radixrt.routing`), and
the request body goes to it unchanged; the response (or its SSE stream) comes back unchanged.

- A non-streamed request whose worker cannot be reached, drops the connection, or answers 503
  is retried on another healthy worker (the failed one stops getting requests until its health
  check passes); a stream is retried only while nothing has been sent to the client yet.
- A client that disconnects closes the upstream request, which the radixrt worker turns into
  an abort (KV freed or cached).
- `/v1/responses`: a stored response lives on the worker that made it. The router remembers
  which (`ResponseOwners`, from the response's `id` or its stream's `response.created`), sends
  a request with that `previous_response_id` there, and `GET` / `DELETE /v1/responses/{id}`
  (and its `input_items`) too; an owner it does not know (or an unhealthy one) leaves the request to the policy, and
  the worker that gets it answers 400 `previous_response_not_found`.
- `POST /workers {"url"}`, `DELETE /workers/{url}`, `GET /workers` manage the workers at run
  time; `GET /metrics` reports per worker (routed, cache-routed, tokens, load, errors, health).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import unquote

import anyio
import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool

from radixrt.config import ServerArgs
from radixrt.router.prompt_ids import PromptIds
from radixrt.router.workers import WorkerError, WorkerSet
from radixrt.routing.policy import Decision, NoWorkerError, policy_from_args
from radixrt.server import protocol as P
from radixrt.server.guard import OPEN_PATHS, add_guard, error_response
from radixrt.server.guard import json_body as read_json_body

logger = logging.getLogger("radixrt.router")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
RESPONSE_OWNERS = 1 << 16  # response ids whose worker the router remembers (LRU)
CONNECT_TIMEOUT_S = 5.0
RETRY_STATUS = (503,)
MAX_SSE_LINE = 1 << 20  # longest SSE line the usage scan buffers  # the worker's runtime died: another worker can serve it


class ResponseOwners:
    """Response id → the worker that stored it, the `capacity` most recently used."""

    def __init__(self, capacity: int = RESPONSE_OWNERS):
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def add(self, rid: Any, url: str) -> None:
        if isinstance(rid, str):
            self._owner[rid] = url
            self._owner.move_to_end(rid)
            while len(self._owner) > self.capacity:
                self._owner.popitem(last=False)

    def get(self, rid: Any) -> str | None:
        url = self._owner.get(rid) if isinstance(rid, str) else None
        if url is not None:
            self._owner.move_to_end(rid)
        return url


class Router:
    """The forwarding logic, independent of the ASGI wiring (`create_app`)."""

    def __init__(self, args: ServerArgs, workers: WorkerSet, prompt_ids: PromptIds):
        self.args = args
        self.workers = workers
        self.prompt_ids = prompt_ids
        self.owners = ResponseOwners()

    def pinned_out(self, path: str, body: dict[str, Any]) -> set[Any]:
        """Workers to exclude so that a request continuing a stored response goes to its
        owner (nothing when the owner is unknown or unhealthy)."""
        if path != "/v1/responses":
            return set()
        owner = self.owners.get(body.get("previous_response_id"))
        if owner is None or owner in self.workers.unhealthy() or owner not in self.workers.workers:
            return set()
        return set(self.workers.workers) - {owner}

    def upstream_headers(self, request: Request) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.args.worker_api_key:
            h["authorization"] = f"Bearer {self.args.worker_api_key}"
        elif "authorization" in request.headers:
            h["authorization"] = request.headers["authorization"]
        return h

    def no_worker(self, e: NoWorkerError) -> P.ApiError:
        details = "; ".join(f"{w.url}: {w.last_error or 'unhealthy'}"
                            for w in self.workers.workers.values() if not w.healthy)
        return P.ApiError(503, f"{e}" + (f" ({details})" if details else ""),
                          type="service_unavailable", code="no_worker")

    async def forward(self, request: Request, path: str, raw: bytes,
                      body: dict[str, Any]) -> Response:
        ids = await run_in_threadpool(self.prompt_ids.of, path, body)
        out = output_budget(path, body)
        headers = self.upstream_headers(request)
        pinned = self.pinned_out(path, body)
        if body.get("stream") is True:
            return await self._stream(request, path, raw, ids, out, headers, pinned)
        return await self._once(request, path, raw, ids, out, headers, pinned)

    async def _once(self, request: Request, path: str, raw: bytes, ids: list[int],
                    out: int | None, headers: dict[str, str], pinned: set[Any]) -> Response:
        tried: set[Any] = set(pinned)
        while True:
            try:
                d = self.workers.route(ids, tried, out)
            except NoWorkerError as e:
                raise self.no_worker(e) from None
            url = str(d.worker)
            post = asyncio.ensure_future(self.workers.client.post(
                url + path, content=raw, headers=headers))
            gone = asyncio.ensure_future(_client_gone(request))
            try:
                await asyncio.wait({post, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not post.done():  # the client left: closing the upstream request aborts it
                post.cancel()
                self.workers.policy.finish(d)
                return Response(status_code=499)
            try:
                resp = post.result()
            except httpx.HTTPError as e:
                self._failed(d, f"{type(e).__name__}: {e}", tried)
                continue
            if resp.status_code in RETRY_STATUS:
                self._failed(d, f"HTTP {resp.status_code}: {resp.text[:200]}", tried)
                continue
            self.workers.policy.finish(d, error=resp.status_code >= 500)
            if resp.status_code == 200:
                body = _json_of(resp.content)
                self._observe(url, body.get("usage"))
                if path == "/v1/responses":
                    self.owners.add(body.get("id"), url)
            return _passthrough(resp, resp.content)

    def _observe(self, url: str, usage: dict[str, Any] | None) -> None:
        """Count the worker's reported usage (its real cache hits) when the answer had one
        (chat / completions spelling, or the Responses API's `input_tokens`)."""
        if not usage:
            return
        try:
            if "input_tokens" in usage:
                prompt, details = usage["input_tokens"], usage.get("input_tokens_details")
            else:
                prompt, details = usage["prompt_tokens"], usage.get("prompt_tokens_details")
            cached = int((details or {}).get("cached_tokens") or 0)
            self.workers.policy.observed(url, int(prompt), cached)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass

    def _failed(self, d: Decision, error: str, tried: set[Any]) -> None:
        url = str(d.worker)
        self.workers.policy.finish(d, error=True)
        self.workers.mark_failed(url, error)
        self.workers.retries += 1
        tried.add(url)
        logger.warning("request to %s failed (%s): retrying on another worker", url, error)

    async def _stream(self, request: Request, path: str, raw: bytes, ids: list[int],
                      out: int | None, headers: dict[str, str], pinned: set[Any]) -> Response:
        tried: set[Any] = set(pinned)
        client = self.workers.client
        while True:
            try:
                d = self.workers.route(ids, tried, out)
            except NoWorkerError as e:
                raise self.no_worker(e) from None
            url = str(d.worker)
            try:
                resp = await client.send(client.build_request("POST", url + path, content=raw,
                                                              headers=headers), stream=True)
            except httpx.HTTPError as e:
                self._failed(d, f"{type(e).__name__}: {e}", tried)
                continue
            if resp.status_code != 200:
                body = await resp.aread()
                await resp.aclose()
                if resp.status_code in RETRY_STATUS:
                    self._failed(d, f"HTTP {resp.status_code}", tried)
                    continue
                self.workers.policy.finish(d, error=resp.status_code >= 500)
                return _passthrough(resp, body)
            return StreamingResponse(self._relay(d, resp), media_type="text/event-stream")

    async def _relay(self, d: Decision, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The worker's SSE bytes as they come. Cancelled when the client disconnects: the
        upstream response is closed then, which aborts the request on the worker. The usage
        chunk (`stream_options.include_usage`) is read on the way for the measured hits."""
        url = str(d.worker)
        error = False
        tail = b""  # the unfinished last line of what was relayed
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
                tail = self._scan_usage(url, tail + chunk)
        except httpx.HTTPError as e:  # the worker died mid-stream: the client must know
            error = True
            self.workers.mark_failed(url, f"{type(e).__name__}: {e}")
            err = P.ApiError(502, f"worker {url} failed mid-stream: {type(e).__name__}",
                             type="service_unavailable", code="worker_failed")
            yield b"data: " + orjson.dumps(err.body()) + b"\n\ndata: [DONE]\n\n"
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            self.workers.policy.finish(d, error=error)

    def _scan_usage(self, url: str, data: bytes) -> bytes:
        """Observe the usage of the complete `data:` lines in `data` that carry one; returns
        the incomplete last line (dropped beyond `MAX_SSE_LINE` bytes)."""
        if b"\n" not in data:
            return data if len(data) <= MAX_SSE_LINE else b""
        *lines, rest = data.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            if b'"type":"response.created"' in line:  # a Responses stream: who stores it
                self.owners.add(_json_of(line[6:]).get("response", {}).get("id"), url)
            elif b'"usage"' in line:
                obj = _json_of(line[6:])
                # chat / completions: a top-level usage; Responses: the final response's
                usage = obj.get("usage") or (obj.get("response") or {}).get("usage")
                self._observe(url, usage)
        return rest if len(rest) <= MAX_SSE_LINE else b""

    async def any_worker(self, request: Request, method: str, path: str,
                         raw: bytes | None = None, pinned: set[Any] | None = None) -> Response:
        """Requests any worker answers alike (models, tokenizer endpoints): the first healthy
        one that answers, least loaded first (among those not `pinned` out)."""
        tried: set[Any] = set(pinned or ())
        headers = self.upstream_headers(request)
        while True:
            try:
                d = self.workers.policy.route([], exclude=tried | self.workers.unhealthy())
            except NoWorkerError as e:
                raise self.no_worker(e) from None
            url = str(d.worker)
            try:
                resp = await self.workers.client.request(
                    method, url + path, content=raw, headers=headers,
                    params=dict(request.query_params))
            except httpx.HTTPError as e:
                self._failed(d, f"{type(e).__name__}: {e}", tried)
                continue
            self.workers.policy.finish(d)
            return _passthrough(resp, resp.content)


def output_budget(path: str, body: dict[str, Any]) -> int | None:
    """Tokens the request may generate in all (`max_tokens` / `max_completion_tokens` /
    `max_output_tokens` x `n`), for the routing policy's pending work; completions default to
    16 (as the worker), a chat or Responses request without a limit is unknown (None)."""
    limit = body.get("max_completion_tokens", body.get("max_tokens",
                                                        body.get("max_output_tokens")))
    if limit is None and path.endswith("/v1/completions"):
        limit = 16
    n = body.get("n", 1)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    return limit * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1)


def _json_of(content: bytes) -> dict[str, Any]:
    """A JSON object's fields ({} for anything else)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def _passthrough(resp: httpx.Response, body: bytes) -> Response:
    headers = {k: v for k, v in resp.headers.items() if k.lower() in ("retry-after",)}
    return Response(body, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (the body was read already, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.2)


class RouterCollector:
    """Per-worker routing counters and gauges, read at scrape time."""

    def __init__(self, workers: WorkerSet):
        self.workers = workers

    def collect(self):
        ws = self.workers
        counters = {
            "requests_routed": ("routed", "Requests routed to the worker."),
            "cache_routed": ("cache_routed", "Requests routed there because its prefix tree "
                                             "matched the prompt (predicted cache hits)."),
            "routed_prompt_tokens": ("routed_tokens", "Prompt tokens routed to the worker."),
            "predicted_cached_tokens": ("matched_tokens", "Prompt tokens the router predicted "
                                                          "the worker had cached."),
            "errors": ("errors", "Requests to the worker that failed (transport or 5xx)."),
            "measured_prompt_tokens": ("measured_prompt_tokens", "Prompt tokens of the "
                                       "worker's answers that reported usage."),
            "measured_cached_tokens": ("measured_cached_tokens", "Cached prompt tokens the "
                                       "worker reported (usage.prompt_tokens_details."
                                       "cached_tokens): its real hits, beside the predicted."),
        }
        for name, (field, doc) in counters.items():
            c = CounterMetricFamily(f"radixrt_router:{name}", doc, labels=["worker"])
            for url in ws.workers:
                s = ws.policy.stats.get(url)
                c.add_metric([url], float(getattr(s, field) if s else 0))
            yield c
        gauges = {
            "load": ("Requests in flight on the worker (through this router).",
                     lambda u: ws.policy.stats[u].load if u in ws.policy.stats else 0),
            "healthy": ("1 if the worker gets requests, 0 if it failed.",
                        lambda u: int(ws.workers[u].healthy)),
            "tree_tokens": ("Tokens the router believes the worker caches.",
                            ws.policy.tree_tokens),
            "pending_tokens": ("Work in flight on the worker, in tokens (uncached prompt + "
                               "output budget), as the routing policy counts it.",
                               lambda u: ws.policy.stats[u].pending
                               if u in ws.policy.stats else 0),
        }
        for name, (doc, get) in gauges.items():
            g = GaugeMetricFamily(f"radixrt_router:{name}", doc, labels=["worker"])
            for url in ws.workers:
                g.add_metric([url], float(get(url)))
            yield g
        r = CounterMetricFamily("radixrt_router:retries", "Requests retried on another worker.")
        r.add_metric([], float(ws.retries))
        yield r


def create_app(args: ServerArgs, prompt_ids: PromptIds,
               client: httpx.AsyncClient | None = None) -> FastAPI:
    """The router app; workers from `args.worker_urls` are added (unreachable ones kept as
    unhealthy, with an error logged) when it starts."""
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                         limits=httpx.Limits(max_connections=None,
                                                             max_keepalive_connections=64))
    headers = {"authorization": f"Bearer {args.worker_api_key}"} if args.worker_api_key else {}
    workers = WorkerSet(policy_from_args(args), client, headers)
    router = Router(args, workers, prompt_ids)
    registry = CollectorRegistry()
    registry.register(RouterCollector(workers))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for url in args.worker_urls:
            await workers.add(url, probe=False)
        task = asyncio.create_task(workers.health_loop(args.health_check_interval_s))
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    app = FastAPI(title="radixrt router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router

    add_guard(app, args.api_key, args.max_request_bytes, OPEN_PATHS)

    async def json_body(request: Request) -> tuple[bytes, dict[str, Any]]:
        return await read_json_body(request, args.max_request_bytes)

    def routed(path: str) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                raw, body = await json_body(request)
                return await router.forward(request, path, raw, body)
            except P.ApiError as e:
                return error_response(e)
        return endpoint

    def passthrough(method: str) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                raw = await request.body() if method == "POST" else None
                # The URL as asked: `/v1/models/{id}` carries the id in its path; a stored
                # response's is asked of the worker that stores it.
                rid = request.path_params.get("response_id")
                pinned = router.pinned_out("/v1/responses", {"previous_response_id": rid})
                return await router.any_worker(request, method, request.url.path, raw, pinned)
            except P.ApiError as e:
                return error_response(e)
        return endpoint

    for path in ROUTED_PATHS:
        app.add_api_route(path, routed(path), methods=["POST"])
    for path, method in (("/v1/models", "GET"), ("/v1/models/{model_id:path}", "GET"),
                         ("/tokenizer_info", "GET"),
                         ("/tokenize", "POST"), ("/detokenize", "POST"),
                         ("/v1/responses/{response_id}", "GET"),
                         ("/v1/responses/{response_id}/input_items", "GET"),
                         ("/v1/responses/{response_id}", "DELETE")):
        app.add_api_route(path, passthrough(method), methods=[method])

    @app.get("/health")
    async def health() -> Response:
        if any(w.healthy for w in workers.workers.values()):
            return JSONResponse({"status": "ok", "workers": workers.describe()})
        return error_response(P.ApiError(503, "no healthy worker", type="service_unavailable",
                                         code="no_worker"))

    @app.get("/workers")
    async def list_workers() -> Response:
        return JSONResponse({"policy": workers.policy.name, "workers": workers.describe()})

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        try:
            _, body = await json_body(request)
            url = body.get("url")
            if not isinstance(url, str):
                raise P.bad("url", "'url' must be the worker's base URL, e.g. "
                                   "http://10.0.0.2:30000")
            try:
                await workers.add(url)
            except WorkerError as e:
                raise P.bad("url", str(e), code=e.code) from None
        except P.ApiError as e:
            return error_response(e)
        return JSONResponse({"policy": workers.policy.name, "workers": workers.describe()})

    @app.delete("/workers/{url:path}")
    async def remove_worker(url: str) -> Response:
        try:
            workers.remove(unquote(url))
        except WorkerError as e:
            return error_response(P.ApiError(404, str(e), param="url", code=e.code))
        return JSONResponse({"policy": workers.policy.name, "workers": workers.describe()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(args: ServerArgs) -> int:
    """Run the router until SIGINT/SIGTERM."""
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer

    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s router pid={os.getpid()}] %(message)s")
    model_path = args.model_path or str(default_model_path())
    prompt_ids = PromptIds(load_tokenizer(model_path, args.tokenizer_path))
    app = create_app(args, prompt_ids)
    logger.info("routing (%s) to %s on http://%s:%d", args.routing_policy,
                ", ".join(args.worker_urls) or "no worker yet", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5, access_log=False)
    return 0
