"""`radixrt router`: cache-aware routing in front of radixrt servers (one per machine, or more).

OpenAI API passthrough: a completions or chat request is tokenized here (chat through the
template, as the worker will), a worker is picked by the routing policy (`radixrt.routing`), and
the request body goes to it unchanged; the response (or its SSE stream) comes back unchanged.

- A non-streamed request whose worker cannot be reached, drops the connection, or answers 503
  is retried on another healthy worker (the failed one stops getting requests until its health
  check passes); a stream is retried only while nothing has been sent to the client yet.
- A client that disconnects closes the upstream request, which the radixrt worker turns into
  an abort (KV freed or cached).
- `POST /workers {"url"}`, `DELETE /workers/{url}`, `GET /workers` manage the workers at run
  time; `GET /metrics` reports per worker (routed, cache-routed, tokens, load, errors, health).
"""

from __future__ import annotations

import asyncio
import logging
import os
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
from radixrt.routing.policy import NoWorkerError, policy_from_args
from radixrt.server import protocol as P

logger = logging.getLogger("radixrt.router")

OPEN_PATHS = ("/health", "/metrics")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
CONNECT_TIMEOUT_S = 5.0
RETRY_STATUS = (503,)  # the worker's runtime died: another worker can serve it


class Router:
    """The forwarding logic, independent of the ASGI wiring (`create_app`)."""

    def __init__(self, args: ServerArgs, workers: WorkerSet, prompt_ids: PromptIds):
        self.args = args
        self.workers = workers
        self.prompt_ids = prompt_ids

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
        headers = self.upstream_headers(request)
        if body.get("stream") is True:
            return await self._stream(request, path, raw, ids, headers)
        return await self._once(request, path, raw, ids, headers)

    async def _once(self, request: Request, path: str, raw: bytes, ids: list[int],
                    headers: dict[str, str]) -> Response:
        tried: set[Any] = set()
        while True:
            try:
                d = self.workers.route(ids, tried)
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
                self.workers.policy.finish(url)
                return Response(status_code=499)
            try:
                resp = post.result()
            except httpx.HTTPError as e:
                self._failed(url, f"{type(e).__name__}: {e}", tried)
                continue
            if resp.status_code in RETRY_STATUS:
                self._failed(url, f"HTTP {resp.status_code}: {resp.text[:200]}", tried)
                continue
            self.workers.policy.finish(url, error=resp.status_code >= 500)
            return _passthrough(resp, resp.content)

    def _failed(self, url: str, error: str, tried: set[Any]) -> None:
        self.workers.policy.finish(url, error=True)
        self.workers.mark_failed(url, error)
        self.workers.retries += 1
        tried.add(url)
        logger.warning("request to %s failed (%s): retrying on another worker", url, error)

    async def _stream(self, request: Request, path: str, raw: bytes, ids: list[int],
                      headers: dict[str, str]) -> Response:
        tried: set[Any] = set()
        client = self.workers.client
        while True:
            try:
                d = self.workers.route(ids, tried)
            except NoWorkerError as e:
                raise self.no_worker(e) from None
            url = str(d.worker)
            try:
                resp = await client.send(client.build_request("POST", url + path, content=raw,
                                                              headers=headers), stream=True)
            except httpx.HTTPError as e:
                self._failed(url, f"{type(e).__name__}: {e}", tried)
                continue
            if resp.status_code != 200:
                body = await resp.aread()
                await resp.aclose()
                if resp.status_code in RETRY_STATUS:
                    self._failed(url, f"HTTP {resp.status_code}", tried)
                    continue
                self.workers.policy.finish(url, error=resp.status_code >= 500)
                return _passthrough(resp, body)
            return StreamingResponse(self._relay(url, resp), media_type="text/event-stream")

    async def _relay(self, url: str, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The worker's SSE bytes as they come. Cancelled when the client disconnects: the
        upstream response is closed then, which aborts the request on the worker."""
        error = False
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the worker died mid-stream: the client must know
            error = True
            self.workers.mark_failed(url, f"{type(e).__name__}: {e}")
            err = P.ApiError(502, f"worker {url} failed mid-stream: {type(e).__name__}",
                             type="service_unavailable", code="worker_failed")
            yield b"data: " + orjson.dumps(err.body()) + b"\n\ndata: [DONE]\n\n"
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            self.workers.policy.finish(url, error=error)

    async def any_worker(self, request: Request, method: str, path: str,
                         raw: bytes | None = None) -> Response:
        """Requests any worker answers alike (models, tokenizer endpoints): the first healthy
        one that answers, least loaded first."""
        tried: set[Any] = set()
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
                self._failed(url, f"{type(e).__name__}: {e}", tried)
                continue
            self.workers.policy.finish(url)
            return _passthrough(resp, resp.content)


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

    def error_response(err: P.ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if args.api_key and request.url.path not in OPEN_PATHS:
            if request.headers.get("authorization", "") != f"Bearer {args.api_key}":
                return error_response(P.ApiError(401, "invalid or missing API key",
                                                 type="authentication_error",
                                                 code="invalid_api_key"))
        try:
            return await call_next(request)
        except P.ApiError as e:
            return error_response(e)

    async def json_body(request: Request) -> tuple[bytes, dict[str, Any]]:
        raw = await request.body()
        if len(raw) > args.max_request_bytes:
            raise P.ApiError(413, f"request body larger than {args.max_request_bytes} bytes",
                             code="request_too_large")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise P.bad(None, f"invalid JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise P.bad(None, "the JSON body must be an object", code="invalid_json")
        return raw, body

    def routed(path: str) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                raw, body = await json_body(request)
                return await router.forward(request, path, raw, body)
            except P.ApiError as e:
                return error_response(e)
        return endpoint

    def passthrough(path: str, method: str) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                raw = await request.body() if method == "POST" else None
                return await router.any_worker(request, method, path, raw)
            except P.ApiError as e:
                return error_response(e)
        return endpoint

    for path in ROUTED_PATHS:
        app.add_api_route(path, routed(path), methods=["POST"])
    for path, method in (("/v1/models", "GET"), ("/tokenizer_info", "GET"),
                         ("/tokenize", "POST"), ("/detokenize", "POST")):
        app.add_api_route(path, passthrough(path, method), methods=[method])

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
