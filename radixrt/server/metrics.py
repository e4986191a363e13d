"""Prometheus metrics: scheduler counters/gauges read at scrape time, latency histograms
observed in the HTTP process. One registry per server (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "radixrt:"

# stats() key → (metric name without prefix, help). All are monotonic in the scheduler.
COUNTERS = {
    "num_requests_total": ("requests", "Requests received by the scheduler."),
    "num_finished_requests_total": ("finished_requests", "Requests finished."),
    "prompt_tokens_total": ("prompt_tokens", "Prompt tokens of admitted requests."),
    "cached_tokens_total": ("cached_prompt_tokens",
                            "Prompt tokens served from the radix cache (hit rate = this / "
                            "prompt_tokens)."),
    "generated_tokens_total": ("generation_tokens", "Tokens generated."),
    "retractions_total": ("retractions", "Running requests sent back to the queue for memory."),
    "evicted_tokens_total": ("evicted_tokens", "Cached tokens evicted from the radix tree."),
    "forward_steps_total": ("forward_steps", "Forward passes run."),
    "grammars_compiled_total": ("grammars_compiled", "Distinct grammars compiled (structured "
                                                     "outputs, tool calls)."),
    "grammar_forced_tokens_total": ("grammar_forced_tokens",
                                    "Tokens a grammar forced, appended without sampling "
                                    "(fast-forward)."),
}
# Speculative decoding's counters (`--speculative-algorithm`): 0 while it is off.
SPEC_COUNTERS = {
    "spec_draft_tokens_total": ("spec_decode_num_draft_tokens",
                                "Draft tokens proposed and verified (speculative decoding)."),
    "spec_accepted_tokens_total": ("spec_decode_num_accepted_tokens",
                                   "Draft tokens verification accepted (each saved a step)."),
}
GAUGES = {
    "num_running": ("num_running_reqs", "Requests running (decoding or mid-prefill)."),
    "num_waiting": ("num_queue_reqs", "Requests waiting to be scheduled."),
    "token_usage": ("token_usage", "Share of KV slots in use (running requests + cache)."),
    "used_tokens": ("used_tokens", "KV slots in use."),
    "max_total_tokens": ("max_total_tokens", "KV pool size in tokens."),
    "cached_evictable_tokens": ("cache_evictable_tokens", "Cached tokens no request uses."),
    "cached_locked_tokens": ("cache_locked_tokens", "Cached tokens locked by running requests."),
    "cache_hit_rate": ("cache_hit_rate", "cached_prompt_tokens / prompt_tokens since start."),
}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)


class SchedulerCollector:
    """Reads the scheduler's stats once per scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for key, (name, doc) in COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], float(s[key]))
            yield c
        for key, (name, doc) in SPEC_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], float(s.get(key, 0)))
            yield c
        for key, (name, doc) in GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], float(s[key]))
            yield g


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        self.registry.register(SchedulerCollector(stats))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive output tokens.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
