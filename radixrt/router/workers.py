"""`WorkerSet`: the radixrt servers behind `radixrt router`, their health, and the routing
policy's view of each one's cache.

A worker is healthy until a request to it fails to connect or read, it answers 503 (its runtime
died), or its `/health` check fails; unhealthy workers get no new requests, and the health loop
(every `health_check_interval_s`) brings them back once `/health` answers 200 again. The same
loop reads each worker's `/cache/evictions` so the policy's tree drops what the worker evicted;
a new epoch (the worker restarted) or lost entries make the policy forget that worker's tree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import httpx

from radixrt.config import worker_url_error
from radixrt.routing.policy import Decision, RoutingPolicy

logger = logging.getLogger("radixrt.router")

HEALTH_TIMEOUT_S = 3.0


class WorkerError(Exception):
    """A worker URL that cannot be added (bad, duplicate, unknown or unreachable); `code` is
    the API error code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass
class Worker:
    url: str
    healthy: bool = True
    last_error: str = ""
    checked_at: float = 0.0
    epoch: str | None = None  # of the worker's eviction log
    next_seq: int = 0


def normalize(url: str) -> str:
    return url.rstrip("/")


class WorkerSet:
    """Registered workers (by base URL, no trailing slash) and the policy routing over them."""

    def __init__(self, policy: RoutingPolicy, client: httpx.AsyncClient,
                 headers: dict[str, str] | None = None):
        self.policy = policy
        self.client = client
        self.headers = headers or {}  # sent to workers on health / eviction polls
        self.workers: dict[str, Worker] = {}
        self.capacity: dict[str, int | None] = {}  # from each worker's last /health answer
        self.retries = 0

    # -- membership ------------------------------------------------------------------------------
    async def add(self, url: str, probe: bool = True) -> Worker:
        """Register `url`; with `probe`, only if its `/health` answers 200 now
        (`WorkerError` says why not). Without, an unreachable worker is kept as unhealthy."""
        err = worker_url_error(url)
        if err:
            raise WorkerError(err, "invalid_worker_url")
        url = normalize(url)
        if url in self.workers:
            raise WorkerError(f"worker {url} is already registered", "worker_exists")
        problem = await self.check(url)
        if problem and probe:
            raise WorkerError(f"worker {url} is unreachable or unhealthy: {problem}",
                              "worker_unreachable")
        w = Worker(url, healthy=problem is None, last_error=problem or "",
                   checked_at=time.monotonic())
        self.workers[url] = w
        self.policy.add_worker(url)
        self.policy.set_capacity(url, self.capacity.get(url))
        if problem:
            logger.error("worker %s is not healthy yet (%s): no requests until it is", url,
                         problem)
        else:
            logger.info("worker %s added", url)
        return w

    def remove(self, url: str) -> None:
        url = normalize(url)
        if url not in self.workers:
            raise WorkerError(f"no worker {url} is registered", "worker_not_found")
        del self.workers[url]
        self.policy.remove_worker(url)
        logger.info("worker %s removed", url)

    # -- routing ---------------------------------------------------------------------------------
    def unhealthy(self) -> set[str]:
        return {u for u, w in self.workers.items() if not w.healthy}

    def route(self, ids: Sequence[int], exclude: set[Hashable],
              output_tokens: int | None = None) -> Decision:
        """A healthy worker not in `exclude` (raises `NoWorkerError`)."""
        return self.policy.route(ids, exclude=exclude | self.unhealthy(),
                                 output_tokens=output_tokens)

    def mark_failed(self, url: str, error: str) -> None:
        """A request to `url` failed at the transport level or with 503: stop routing to it
        until its health check passes."""
        w = self.workers.get(url)
        if w is not None and w.healthy:
            w.healthy = False
            w.last_error = error
            logger.warning("worker %s marked unhealthy: %s", url, error)

    def describe(self) -> list[dict[str, object]]:
        out = []
        for url, w in self.workers.items():
            s = self.policy.stats.get(url)
            out.append({"url": url, "healthy": w.healthy, "last_error": w.last_error,
                        "load": s.load if s else 0, "routed": s.routed if s else 0,
                        "routed_tokens": s.routed_tokens if s else 0,
                        "cache_routed": s.cache_routed if s else 0,
                        "predicted_cached_tokens": s.matched_tokens if s else 0,
                        "measured_prompt_tokens": s.measured_prompt_tokens if s else 0,
                        "measured_cached_tokens": s.measured_cached_tokens if s else 0,
                        "pending_tokens": s.pending if s else 0,
                        "capacity": s.capacity if s else None,
                        "errors": s.errors if s else 0,
                        "tree_tokens": self.policy.tree_tokens(url)})
        return out

    # -- health and cache refresh ------------------------------------------------------------------
    async def check(self, url: str) -> str | None:
        """None if `GET url/health` answers 200, else what went wrong. A registered worker's
        capacity (`max_running_requests` in the answer: what its live replicas run at once)
        goes to the policy."""
        try:
            r = await self.client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if r.status_code != 200:
            return f"/health answered HTTP {r.status_code}"
        try:
            cap = r.json().get("max_running_requests")
        except (ValueError, AttributeError):
            cap = None
        self.capacity[url] = cap if isinstance(cap, int) and cap > 0 else None
        if url in self.workers:
            self.policy.set_capacity(url, self.capacity[url])
        return None

    async def refresh_evictions(self, w: Worker) -> None:
        """Apply the worker's evictions since the last poll to the policy's tree."""
        try:
            r = await self.client.get(f"{w.url}/cache/evictions", params={"since": w.next_seq},
                                      headers=self.headers, timeout=HEALTH_TIMEOUT_S)
            if r.status_code != 200:
                return  # an older radixrt without the endpoint: the LRU bound alone applies
            data = r.json()
        except (httpx.HTTPError, ValueError):
            return
        if data.get("epoch") != w.epoch or data.get("lost"):
            if w.epoch is not None:  # restarted, or we fell behind: start over
                self.policy.forget(w.url)
            w.epoch = data.get("epoch")
            w.next_seq = int(data.get("next_seq", 0))
            return
        if data.get("prefixes"):
            self.policy.evicted(w.url, data["prefixes"])
        w.next_seq = int(data.get("next_seq", w.next_seq))

    async def check_all(self) -> None:
        async def one(w: Worker) -> None:
            problem = await self.check(w.url)
            w.checked_at = time.monotonic()
            if problem is None:
                if not w.healthy:
                    logger.info("worker %s is healthy again", w.url)
                w.healthy, w.last_error = True, ""
                await self.refresh_evictions(w)
            elif w.healthy:
                w.healthy, w.last_error = False, problem
                logger.warning("worker %s failed its health check: %s", w.url, problem)

        await asyncio.gather(*(one(w) for w in list(self.workers.values())))

    async def health_loop(self, interval_s: float) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)
