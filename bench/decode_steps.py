"""Bare decode steps for step-level benchmarks: `bs` requests over `ctx` random cached tokens.

Used by bench/step_overhead.py and bench/step_fusion.py. The pool is filled with random K/V
(attention's cost does not depend on the values), so no prefill runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


class RandomKVDecoder:
    """Decode steps of `bs` requests over `ctx` random cached tokens each, on `runner`
    (a `ModelRunner`); `step()` returns the forward pass's time by `clock`. With `prefix` > 0
    the rows' first `prefix` tokens are the same slots (one cached prefix that every request
    shares, as a system prompt or document in the radix cache: cascade decode)."""

    def __init__(self, runner: Any, bs: int, ctx: int,
                 clock: Callable[[], float] = time.perf_counter, prefix: int = 0):
        import torch

        if not 0 <= prefix < ctx:
            raise ValueError(f"prefix must be in [0, ctx), got {prefix} for ctx {ctx}")
        self.runner, self.bs, self.seq, self.clock = runner, bs, ctx, clock
        rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool
        rp.clear()
        kp.clear()
        self.rows = [rp.alloc() for _ in range(bs)]
        shared = kp.alloc(prefix) if prefix else torch.zeros(0, dtype=torch.int64)
        own = kp.alloc(bs * (ctx - prefix))
        assert shared is not None and own is not None, "pool too small"
        slots = torch.cat([shared, own])
        for i, row in enumerate(self.rows):
            mine = own[i * (ctx - prefix):(i + 1) * (ctx - prefix)]
            rp.write([row], [0], [ctx], torch.cat([shared, mine]))
        g = torch.Generator().manual_seed(0)
        for layer in range(len(kp.k_buffer)):  # set_kv: an int8 pool gets codes and scales
            shape = (slots.numel(), *kp.k_buffer[layer].shape[1:])
            kp.set_kv(layer, slots, torch.randn(shape, generator=g),
                      torch.randn(shape, generator=g))
        self.nxt = list(range(100, 100 + bs))

    def warmed(self, steps: int = 3) -> RandomKVDecoder:
        """This decoder after `steps` untimed steps."""
        for _ in range(steps):
            self.step()
        return self

    def step(self) -> float:
        from radixrt.core.forward_batch import ForwardBatch, ForwardMode
        from radixrt.sampling.sampler import row_argmax

        rp, kp, bs = self.runner.req_to_token_pool, self.runner.token_to_kv_pool, self.bs
        rp.write(self.rows, [self.seq] * bs, [1] * bs, kp.alloc(bs))
        fb = ForwardBatch.build(ForwardMode.DECODE, self.nxt, self.rows, [self.seq] * bs,
                                [1] * bs, rp.req_to_token, self.runner.device)
        t = self.clock()
        logits, picked = self.runner.forward_greedy(fb)  # as the scheduler's greedy steps
        self.nxt = (picked if picked is not None else row_argmax(logits)).tolist()
        dt = self.clock() - t
        self.seq += 1
        return dt


def add_step_args(ap: argparse.ArgumentParser, batch_sizes: list[int]) -> None:
    """The options of a bench over `RandomKVDecoder` steps: --batch-sizes, --ctx, --steps,
    --threads, --kv-cache-dtype, --prefix."""
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=batch_sizes)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", help="ServerArgs.kv_cache_dtype")
    ap.add_argument("--prefix", type=int, default=0,
                    help="the first PREFIX of the --ctx tokens are one cached prefix every row "
                         "shares (cascade decode)")


def bare_runner(a: argparse.Namespace, ctx_max: int, **server_args: Any) -> Any:
    """A `ModelRunner` of the default model as the server builds it, for `add_step_args`'
    options `a`: room for the largest batch at `ctx_max` tokens a row (`server_args` override
    further `ServerArgs` fields)."""
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    bs_max = max(a.batch_sizes)
    return ModelRunner(ServerArgs(max_running_requests=bs_max,
                                  max_total_tokens=bs_max * ctx_max + 64,
                                  max_context_len=ctx_max, log_level="warning",
                                  num_threads=a.threads, kv_cache_dtype=a.kv_cache_dtype,
                                  **server_args))
