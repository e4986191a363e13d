"""The roofline of one forward step: what it must move and compute, and the machine's ceilings.

A decode step reads every weight once (plus each request's K/V) and does 2 FLOPs per weight
per token; on a CPU it is bound by memory bandwidth, so its lower bound is
`max(bytes / bandwidth, flops / matmul peak)`. A prefill is bound by the matmul peak. Both
ceilings are measured here, at the thread count the step runs with and in its dtype (or fp32
where that is faster: `measure_ceilings`), and the
`fraction` of a step is `lower bound / measured time` (1.0 = at the roofline).

Cost formulas are pure functions of the model's shape (`ModelConfig` fields), so a test can
check them against a hand count; `weight_bytes` sums what a built model actually stores (so
quantized weights count at their stored size).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from radixrt.model.model_config import attention_pair_macs, layer_matmul_macs

# -- what a step moves and computes ------------------------------------------------------------------


def layer_linear_params(cfg: Any) -> int:
    """Weights (and biases) of one decoder layer's four matmuls: qkv, o, gate_up, down."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    n = layer_matmul_macs(cfg)
    if cfg.qkv_bias:
        n += q + 2 * kv
    if cfg.o_proj_bias:
        n += h
    if cfg.mlp_bias:
        n += 2 * i + h
    return n


def lm_head_params(cfg: Any) -> int:
    return cfg.vocab_size * cfg.hidden_size


def dense_params_read(cfg: Any) -> int:
    """Elements read by one step whatever its batch: every layer's matmuls and norms, the final
    norm and the LM head (the embedding table is only gathered, one row per token; when tied it
    *is* the LM head)."""
    norms = 2 * cfg.hidden_size * cfg.num_layers + cfg.hidden_size
    return cfg.num_layers * layer_linear_params(cfg) + norms + lm_head_params(cfg)


def matmul_flops_per_token(cfg: Any, with_lm_head: bool) -> int:
    """2 FLOPs per multiply-add over every layer's matmuls (biases ignored), plus the LM head."""
    return 2 * (cfg.num_layers * layer_matmul_macs(cfg)
                + (lm_head_params(cfg) if with_lm_head else 0))


def attention_flops(cfg: Any, keys: int) -> int:
    """One query token over `keys` keys, every layer: QK^T and PV, 2 FLOPs per multiply-add."""
    return cfg.num_layers * 2 * attention_pair_macs(cfg) * keys


def kv_bytes(cfg: Any, tokens: int, kv_elem_bytes: float) -> int:
    """K and V of `tokens` tokens over every layer (`kv_elem_bytes` may be fractional: an int8
    pool's per-row scales)."""
    return round(2 * cfg.num_layers * cfg.kv_size * tokens * kv_elem_bytes)


@dataclass(frozen=True)
class StepCost:
    """Bytes a step must read and FLOPs it must do (lower bounds: no re-reads, no overheads)."""

    bytes: int
    flops: int


def decode_cost(cfg: Any, seq_lens: list[int], weight_bytes_read: int,
                kv_elem_bytes: float) -> StepCost:
    """A decode step: one new token per request; request r attends over `seq_lens[r]` keys
    (its own new one included). Reads the weights once and each request's K/V once (the
    embedding rows gathered and the activations are a few KiB: not counted)."""
    b = len(seq_lens)
    keys = sum(seq_lens)
    bytes_ = weight_bytes_read + kv_bytes(cfg, keys, kv_elem_bytes)
    flops = b * matmul_flops_per_token(cfg, with_lm_head=True) + attention_flops(cfg, keys)
    return StepCost(bytes_, flops)


def prefill_cost(cfg: Any, batch: int, input_len: int, weight_bytes_read: int,
                 kv_elem_bytes: float) -> StepCost:
    """A prefill of `batch` prompts of `input_len` tokens, no cached prefix, causal: token t
    attends over t + 1 keys; logits for the last token of each prompt only. Bytes: weights once,
    K/V written once."""
    tokens = batch * input_len
    causal_keys = batch * input_len * (input_len + 1) // 2
    flops = (tokens * matmul_flops_per_token(cfg, with_lm_head=False)
             + batch * 2 * lm_head_params(cfg) + attention_flops(cfg, causal_keys))
    return StepCost(weight_bytes_read + kv_bytes(cfg, tokens, kv_elem_bytes), flops)


def weight_bytes(model: Any, skip_linear: bool = False) -> int:
    """Bytes a step reads in full from a built model: every parameter and buffer (each tensor's
    own bytes, a tensor starting where another does counted once, so a tied LM head counts
    once), except rotary tables and an untied embedding table (both only gathered by row).
    Counted per tensor, not per storage: the runner moves all of them into one huge-page
    buffer (radixrt/mem/huge_pages.py). `skip_linear` leaves out every tensor of the matmul
    weights (`model.linear_weights()`, all their representations), for a caller that adds what
    they read at a given row count."""
    seen: set[int] = set()
    if skip_linear:
        seen = {t.data_ptr() for w in model.linear_weights()
                for t in [*w.parameters(), *w.buffers()]}
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    untied_embed = embed is not None and lm_head is not None and embed is not lm_head
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" in name or (untied_embed and t is embed):
            continue
        key = t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


# -- the machine's ceilings --------------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    """Measured at `threads` threads: read bandwidth (GB/s) and matmul peak (GFLOP/s, `dtype`)."""

    mem_gbps: float
    matmul_gflops: float
    dtype: str
    threads: int
    matmul_n: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def best_ceilings(first: Ceilings, again: Ceilings) -> Ceilings:
    """`again` with each ceiling at least `first`'s: a reading disturbed by the machine's other
    work is never what a step is judged against (one row of stop 54's c8 report read the matmul
    peak at 1180 GFLOP/s against 2481 before it, and its prefill came out at 106% of that)."""
    return replace(again, mem_gbps=max(first.mem_gbps, again.mem_gbps),
                   matmul_gflops=max(first.matmul_gflops, again.matmul_gflops))


def measure_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Read bandwidth in GB/s: the best of `reps` sums over a `mib` MiB fp32 tensor (far larger
    than any last-level cache), as a decode step streams its weights; the tensor both on the
    allocator's default pages and on huge pages (as the runtime holds its weights and KV pool,
    radixrt/mem/huge_pages.py), whichever reads faster."""
    import torch

    from radixrt.mem.huge_pages import huge_page_buffer

    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    best = float("inf")
    for x in (torch.ones(n, dtype=torch.float32),
              huge_page_buffer(n * 4).view(torch.float32).fill_(1.0)):
        x.sum()
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        del x
    return n * 4 / best / 1e9


def measure_matmul(threads: int, dtype: Any, n: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of an n x n x n `F.linear` (the model's matmul) in `dtype`, best of `reps`."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    a = torch.randn(n, n).to(dtype)
    w = torch.randn(n, n).to(dtype)
    F.linear(a, w)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        F.linear(a, w)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


# Compute scaling of two threads over one below this: they share one core's execution units.
SAME_CORE_SCALING = 1.5


def thread_placement(rounds: int = 2000, iters: int = 2_000_000) -> dict[str, Any]:
    """Where torch's first two intra-op threads run now: {"round_trip_ns", "placement",
    "compute_scaling", "same_core"}, placement "near", "far" or "unknown" (fewer than 2
    threads, or no kernel library; then the other fields are None). compute_scaling is two
    threads' multiply-add throughput over one's; same_core is whether it shows the two sharing
    one core. The hypervisor of a 2-vCPU VM may move it between placements from minute to
    minute; they differ in bandwidth and in what sharing costs (radixrt/attention/csrc/
    cpu_probe.cpp), so a benchmark records this next to its steps."""
    import math

    import torch

    ops = getattr(torch.ops, "radixrt", None)
    trip = getattr(ops, "thread_round_trip_ns", None)
    scaling_op = getattr(ops, "thread_compute_scaling", None)
    ns = float(trip(rounds)) if trip is not None else float("nan")
    # over it "far" (no shared cache), else "near": the decode team's own threshold
    # (radixrt/attention/csrc/placement.h), read from the kernel library
    far_ns = float(ops.far_round_trip_ns()) if trip is not None else float("nan")
    scaling = float(scaling_op(iters)) if scaling_op is not None else float("nan")
    if math.isnan(ns):
        return {"round_trip_ns": None, "placement": "unknown", "compute_scaling": None,
                "same_core": None}
    known = not math.isnan(scaling)
    return {"round_trip_ns": round(ns, 1),
            "placement": "far" if ns > far_ns else "near",
            "compute_scaling": round(scaling, 2) if known else None,
            "same_core": scaling < SAME_CORE_SCALING if known else None}


def measure_ceilings(threads: int, dtype: Any, n: int = 2048) -> Ceilings:
    """Read bandwidth and the matmul peak: the faster of `dtype` and float32. A step judged
    against a dtype that is slower than fp32 on this CPU (bf16 emulated, where the model's
    matmuls run on the int8 kernel anyway) would get an easy bound; fp32 is always there."""
    import torch

    with torch.inference_mode():
        peaks = {dt: measure_matmul(threads, dt, n) for dt in dict.fromkeys((dtype, torch.float32))}
        best = max(peaks, key=peaks.__getitem__)
        return Ceilings(measure_bandwidth(threads), peaks[best],
                        str(best).removeprefix("torch."), threads, n)


def bound_s(cost: StepCost, c: Ceilings, memory: bool = True) -> float:
    """The step's lower bound in seconds: max(bytes / bandwidth, flops / peak); with
    `memory=False` only the compute term (the prefill ceiling)."""
    compute = cost.flops / (c.matmul_gflops * 1e9)
    return max(cost.bytes / (c.mem_gbps * 1e9), compute) if memory else compute


def roofline_fields(cost: StepCost, c: Ceilings, measured_s: float, memory: bool = True,
                    ) -> dict[str, float]:
    """Bytes, FLOPs, the bound and the fraction reached (bound / measured) of one step."""
    lb = bound_s(cost, c, memory)
    return {"bytes": cost.bytes, "flops": cost.flops, "bound_ms": lb * 1e3,
            "fraction": lb / measured_s if measured_s > 0 else float("nan"),
            "bound_by": ("memory" if memory and cost.bytes / (c.mem_gbps * 1e9)
                         >= cost.flops / (c.matmul_gflops * 1e9) else "compute")}
