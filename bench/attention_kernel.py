"""Decode and extend attention: the C++ kernels against the torch gather + SDPA paths.

    python bench/attention_kernel.py attention --batch 1 8 64 --ctx 512 2048 --prefix 0 400
    python bench/attention_kernel.py extend --dtype bfloat16 float32 --reps 5
    python bench/attention_kernel.py step --batch 1 8 64 --ctx 512 2048 --dtype bfloat16
    python bench/attention_kernel.py kernel --baseline 1e7a68f --batch 8 64 --ctx 512 2048
    python bench/attention_kernel.py prefetch --ahead 1 2 3 --batch 8 64 --ctx 512 --prefix 0 400
    python bench/attention_kernel.py extend-kernel --baseline bad92c2 --dtype bfloat16 --reps 7
    python bench/attention_kernel.py extend-phases --threads 1 --reps 9
    python bench/attention_kernel.py group-pass --batch 4 8 16 64 --ctx 600 --prefix 570 --dtype float16

`extend-kernel`: the extend op alone (`torch.ops.radixrt.extend_attention` on `--layers` layers,
default 4, reported per layer) against the same op compiled from `extend_attention.cpp` at
`--baseline` (default HEAD), and with its shared-prefix groups off, on `EXTEND_KERNEL_SHAPES`
(agent waves with own or 700-token shared prefixes, a mixed batch, fresh prefills, chunks deep
in a long context); `--dtype float16` runs fp32 queries over a half pool.

`extend-phases`: where the bf16 extend kernel's time goes on those shapes, on the path this CPU
takes (vdpbf16ps with AVX512-BF16, else fp32 FMA): the current `extend_attention.cpp` built whole
and without each phase (`RADIXRT_EXT_SKIP_PHASES`: scores, softmax, P V, V packing: on the fp32
path the K/V block conversion; results wrong), interleaved on one layer's K/V; a phase's cost is
the difference.

`kernel`: the op alone (`PagedDecodePlan.run` on every layer, plan built once) against the same op
compiled from `paged_decode.cpp` at git revision `--baseline` (built beside the current one with
the same flags, registered as `torch.ops.radixrt_baseline`), with the K+V bytes a layer has to
read (each shared prefix once) and the bandwidth that makes. Enough layers are allocated that K/V
comes from memory, as in a real step; `--hot` attends one layer 30 times instead (the kernel's
compute where K/V fits in the caches).

`group-pass`: how a cascade group's rows pass over their shared prefix where the scan has no
dot-product instruction: this checkout's `paged_decode.cpp` built twice, every group on the
register-tiled key blocks (`RADIXRT_PD_BLOCK_GROUP_ROWS=2`) and none (the scan), the op alone on
30 layers from memory with one group of `--batch` rows over the first `--prefix` of `--ctx`
keys, alternating; the blocks' speed over the scan's. The threshold between them
(`kBlockGroupRows`, csrc/paged_decode.cpp) was chosen this way.

`prefetch`: the op alone on 30 layers from memory (as `kernel`) at each of `--ahead` prefetch
distances (key blocks the scans fetch ahead, `torch.ops.radixrt.paged_decode_prefetch`, set for
calls sharing their items among threads and for calls alone alike; `2/l1`, `2/l2`: 2 blocks
into L1 or L2, `torch.ops.radixrt.paged_decode_prefetch_l1`), alternating in one process; the
GB/s of K/V each reads and its speed against the first setting. The defaults were chosen this
way (csrc/paged_decode.cpp); another CPU may want others (`--ahead 2/l2 2/l1`).

`attention`: the attention backend alone on SmolLM2's shape (9 query heads, 3 KV heads, head dim
64): one step's plan (`init_forward_metadata`) plus `forward` on every layer of a pool filled with
random K/V, reported per 30-layer step. Enough layers are allocated that the KV does not stay in
the CPU caches from one layer to the next (as in a real step, where the weights flush them).
`step`: a whole decode step of the model (`ModelRunner.forward`, default SmolLM2) over a pool
filled with random K/V (no prefill: attention's cost does not depend on the values).

`extend`: the backend's extend attention alone (plan + `forward` on 3 layers, reported per layer)
on the serving traces' shapes (`EXTEND_SHAPES`: the agent wave of 20 requests x 65 new tokens on
an 850-token cached prefix, the same with 40 one-token decode rows of a mixed batch, fresh causal
prefills of 512 / 2048 tokens and 4 x 512): the torch path (`extend_kernel=False`: padded or
ragged SDPA, K/V gathered, float masks), the C++ op, and for bf16 the C++ op with fp32 FMA
instead of vdpbf16ps (`kernel_fma`). GFLOP/s count the useful work only, 4 * D * heads per
visible (query, key) pair.

`attention` and `step` put every request at `ctx` tokens; with `--prefix P` > 0 the batch's rows start with the
same P slots (one cached prefix shared by all requests: cascade decode). Slots are allocated as
the runtime does (contiguous runs from the free list). Old and new paths alternate in one process,
`--reps` times each; medians are reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import cpu_name, markdown_table  # noqa: E402
from radixrt.attention import cpu_kernels  # noqa: E402
from radixrt.attention.cascade import SharedPrefixGroup  # noqa: E402
from radixrt.attention.paged_decode import PagedDecodePlan  # noqa: E402
from radixrt.attention.torch_native import TorchNativeBackend  # noqa: E402
from radixrt.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
# Distinct K/V bytes the "from memory" cases cycle through, at least (up to LAYERS layers): 256
# MiB until stop 70, when on the AMX Xeon (an LLC reported at 480 MiB) 11 layers of a 64-row
# batch over 544 keys (280 MB) read at 26 GB/s and all 30 (765 MB, as a real step reads them)
# at 22.8 GB/s, the rate the op had inside decode steps.
FROM_MEMORY_BYTES = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# kernel / prefetch also take "float16": a half pool under fp32 queries (a float32 model's
# `kv_cache_dtype` float16, the default with quantized weights).
POOL_DTYPES = {**DTYPES, "float16": torch.float16}


def machine() -> dict[str, Any]:
    spec = cpu_kernels.loaded_spec()
    return {"cpu": cpu_name(), "isa": spec.isa if spec else None, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "loadavg_1m": os.getloadavg()[0]}


def fill_random(kv: TokenToKVPool, used: int, seed: int = 0) -> None:
    """Random K/V in slots 1..used of every layer (written in chunks, in the pool's dtype)."""
    g = torch.Generator().manual_seed(seed)
    chunk = 16384
    for buf in (*kv.k_buffer, *kv.v_buffer):
        for s in range(1, used + 1, chunk):
            e = min(used + 1, s + chunk)
            buf[s:e] = torch.randn(e - s, *buf.shape[1:], generator=g).to(buf.dtype)


def decode_batch(rp: ReqToTokenPool, kv: TokenToKVPool, bs: int, ctx: int,
                 prefix: int) -> ForwardBatch:
    """`bs` requests of `ctx` tokens (this step's included); the first `prefix` slots shared by
    all rows when `prefix` > 0. Allocation as the runtime does it: one run per request."""
    rp.clear()
    kv.clear()
    rows = [rp.alloc() for _ in range(bs)]
    assert all(r is not None for r in rows)
    shared = kv.alloc(prefix) if prefix else torch.zeros(0, dtype=torch.int64)
    assert shared is not None
    for r in rows:
        own = kv.alloc(ctx - prefix)
        assert own is not None
        rp.req_to_token[r, :ctx] = torch.cat([shared, own]).to(torch.int32)
    return ForwardBatch.build(ForwardMode.DECODE, [100] * bs, rows, [ctx - 1] * bs, [1] * bs,
                              rp.req_to_token)


def interleaved(fns: dict[str, Any], reps: int) -> dict[str, float]:
    """Median wall seconds (`name`) and process CPU seconds (`name_cpu`) of each callable, run
    alternately `reps` times after one warm-up each. On a shared machine CPU time is the steadier
    figure (with 1 thread it is the work done; wall time also counts waiting for a core)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k}_cpu": statistics.median(v) for k, v in cpu.items()})
    return out


def _cases(batches: list[int], ctxs: list[int], prefixes: list[int]):
    for ctx in ctxs:
        for bs in batches:
            for prefix in prefixes:
                if prefix < ctx and not (prefix and bs < 2):  # cascade needs >= 2 rows
                    yield bs, ctx, prefix


def _attention_case(dname: str, bs: int, ctx: int, prefix: int, reps: int) -> dict[str, Any]:
    dtype = DTYPES[dname]
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = prefix + bs * (ctx - prefix)
    per_layer = tokens * KV_HEADS * HEAD_DIM * 2 * elem
    layers = min(LAYERS, max(2, math.ceil(FROM_MEMORY_BYTES / per_layer)))
    kv = TokenToKVPool(tokens + 8, layers, KV_HEADS, HEAD_DIM, dtype)
    fill_random(kv, tokens + 8)
    fb = decode_batch(ReqToTokenPool(bs, ctx + 1), kv, bs, ctx, prefix)
    step = _layers_step(fb, bs, dtype, layers)

    torch_path = TorchNativeBackend(kv, decode_kernel=False)
    kernel = TorchNativeBackend(kv, decode_kernel=True)
    med = interleaved({"torch": lambda: step(torch_path), "kernel": lambda: step(kernel)}, reps)
    scale = LAYERS / layers * 1e3
    return {"dtype": dname, "batch": bs, "ctx": ctx, "prefix": prefix, "layers_timed": layers,
            "torch_ms": med["torch"] * scale, "kernel_ms": med["kernel"] * scale,
            "speedup": med["torch"] / med["kernel"],
            "torch_cpu_ms": med["torch_cpu"] * scale, "kernel_cpu_ms": med["kernel_cpu"] * scale,
            "kv_mb_per_step": per_layer * LAYERS / 2**20}


def _layers_step(fb: ForwardBatch, n: int, dtype: torch.dtype, layers: int
                 ) -> Callable[[TorchNativeBackend], None]:
    """One step of `fb` on a backend: plan once, attend `layers` layers with seeded random
    q/k/v for its `n` tokens."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)

    def step(be: TorchNativeBackend) -> None:
        be.init_forward_metadata(fb)
        for layer in range(layers):
            be.forward(q, k, v, layer, HEAD_DIM**-0.5, fb)

    return step


EXTEND_SHAPES: dict[str, list[tuple[int, int]]] = {
    "agent 20x(850+65)": [(850, 65)] * 20,
    "mixed 20x(850+65) + 40x(899+1)": [(850, 65)] * 20 + [(899, 1)] * 40,
    "fresh 1x512": [(0, 512)],
    "fresh 1x2048": [(0, 2048)],
    "fresh 4x512": [(0, 512)] * 4,
}


def _extend_case(dname: str, shape: str, reps: int, layers: int = 3) -> dict[str, Any]:
    dtype = DTYPES[dname]
    rows = EXTEND_SHAPES[shape]
    tokens = sum(p + e for p, e in rows)
    kv = TokenToKVPool(tokens + 8, layers, KV_HEADS, HEAD_DIM, dtype)
    fill_random(kv, tokens + 8)
    rp = ReqToTokenPool(len(rows), max(p + e for p, e in rows) + 1)
    reqs = [rp.alloc() for _ in rows]
    for r, (p, e) in zip(reqs, rows, strict=True):  # one run per request, as the runtime does
        rp.req_to_token[r, : p + e] = kv.alloc(p + e).to(torch.int32)
    ext = [e for _, e in rows]
    fb = ForwardBatch.build(ForwardMode.EXTEND, [100] * sum(ext), reqs, [p for p, _ in rows],
                            ext, rp.req_to_token)
    n = sum(ext)
    step = _layers_step(fb, n, dtype, layers)

    def with_dot(be: TorchNativeBackend, dot: bool) -> None:
        previous = torch.ops.radixrt.extend_attention_bf16_dot(dot)
        try:
            step(be)
        finally:
            torch.ops.radixrt.extend_attention_bf16_dot(previous)

    torch_path = TorchNativeBackend(kv, extend_kernel=False)
    kernel = TorchNativeBackend(kv, extend_kernel=True)
    fns = {"torch": lambda: step(torch_path), "kernel": lambda: with_dot(kernel, True)}
    if dtype == torch.bfloat16:
        fns["kernel_fma"] = lambda: with_dot(kernel, False)
    med = interleaved(fns, reps)
    flops = sum(4 * HEAD_DIM * HEADS * e * (p + (e + 1) / 2) for p, e in rows)
    row: dict[str, Any] = {"dtype": dname, "shape": shape, "gflop_per_layer": flops / 1e9}
    for name in fns:
        row[f"{name}_ms"] = med[name] / layers * 1e3
        row[f"{name}_cpu_ms"] = med[f"{name}_cpu"] / layers * 1e3
        row[f"{name}_gflops"] = flops / (med[name] / layers) / 1e9
    row["speedup"] = med["torch"] / med["kernel"]
    return row


# Op-alone shapes of `extend-kernel`: name -> (rows, shared prefix slots of every row).
EXTEND_KERNEL_SHAPES: dict[str, tuple[list[tuple[int, int]], int]] = {
    "agent 1x(850+75)": ([(850, 75)], 0),
    "agent 20x(850+65), own prefixes": ([(850, 65)] * 20, 0),
    "agent 20x(850+65), 700 shared": ([(850, 65)] * 20, 700),
    "agent 64x(850+65), 700 shared": ([(850, 65)] * 64, 700),
    "mixed 20x(850+65) + 40x(899+1), 700 shared": ([(850, 65)] * 20 + [(899, 1)] * 40, 700),
    "fresh 1x512": ([(0, 512)], 0),
    "fresh 4x512": ([(0, 512)] * 4, 0),
    "fresh 8x512": ([(0, 512)] * 8, 0),
    "fresh 1x2048": ([(0, 2048)], 0),
    # a paced chunk deep in a long-context prompt (long-context random, stop 75)
    "chunk 1x(1000+100)": ([(1000, 100)], 0),
    "chunk 1x(3584+256)": ([(3584, 256)], 0),
    # the pacer's chunk of an agent's follow-up call at 3k context (long-context agent, stop 78)
    "chunk 1x(3300+64)": ([(3300, 64)], 0),
}


def _extend_op_args(dtype: torch.dtype, rows: list[tuple[int, int]], shared: int,
                    layers: int, kv_dtype: torch.dtype | None = None
                    ) -> tuple[TokenToKVPool, list[torch.Tensor], int]:
    """Pool (random K/V, `layers` layers; `kv_dtype` float16 under a float32 `dtype`: a
    narrowed pool), the op's index tensors and the query count: each row's prefix starts with
    the same `shared` slots, then its own run of slots."""
    own = [p + e - shared for p, e in rows]
    kv = TokenToKVPool(shared + sum(own) + 8, layers, KV_HEADS, HEAD_DIM, dtype,
                       kv_dtype=kv_dtype)
    fill_random(kv, shared + sum(own) + 8)
    common = kv.alloc(shared) if shared else torch.zeros(0, dtype=torch.int64)
    parts = kv.alloc(sum(own)).split(own)
    pre = [torch.cat([common, part[: p - shared]]) for (p, _), part in zip(rows, parts,
                                                                          strict=True)]
    new = [part[p - shared:] for (p, _), part in zip(rows, parts, strict=True)]
    kptr = torch.tensor([0] + [p for p, _ in rows]).cumsum(0)
    qptr = torch.tensor([0] + [e for _, e in rows]).cumsum(0)
    index = [torch.cat(pre).to(torch.int32), kptr, torch.cat(new).to(torch.int32), qptr]
    return kv, index, int(qptr[-1])


def _extend_kernel_case(dname: str, shape: str, reps: int, layers: int = 4) -> dict[str, Any]:
    """The op alone on `layers` layers (K/V of each layer read in turn): `--baseline` build vs
    this one, and this one with shared-prefix groups off. `float16`: fp32 queries over a half
    pool (a float32 model's float16 K/V cache)."""
    narrowed = dname == "float16"
    dtype = torch.float32 if narrowed else DTYPES[dname]
    rows, shared = EXTEND_KERNEL_SHAPES[shape]
    kv, (kvi, kptr, loc, qptr), n = _extend_op_args(
        dtype, rows, shared, layers, torch.float16 if narrowed else None)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = HEAD_DIM**-0.5

    def step(op: Any, groups: bool = True) -> None:
        previous = torch.ops.radixrt.extend_attention_groups(groups)
        try:
            for layer in range(layers):
                op(q, kv.k_buffer[layer], kv.v_buffer[layer], kvi, kptr, loc, qptr, scale)
        finally:
            torch.ops.radixrt.extend_attention_groups(previous)

    new, old = torch.ops.radixrt.extend_attention, torch.ops.radixrt_baseline.extend_attention
    args = (q, kv.k_buffer[0], kv.v_buffer[0], kvi, kptr, loc, qptr, scale)
    max_diff = float((new(*args).float() - old(*args).float()).abs().max())
    med = interleaved({"baseline": lambda: step(old), "kernel": lambda: step(new),
                       "no_groups": lambda: step(new, False)}, reps)
    flops = sum(4 * HEAD_DIM * HEADS * e * (p + (e + 1) / 2) for p, e in rows)
    row: dict[str, Any] = {"dtype": dname, "shape": shape, "gflop_per_layer": flops / 1e9,
                           "max_abs_diff": max_diff}
    for name in ("baseline", "kernel", "no_groups"):
        row[f"{name}_ms"] = med[name] / layers * 1e3
        row[f"{name}_cpu_ms"] = med[f"{name}_cpu"] / layers * 1e3
        row[f"{name}_gflops"] = flops / (med[name] / layers) / 1e9
    row["speedup"] = med["baseline"] / med["kernel"]
    return row


def markdown_extend_kernel(rows: list[dict[str, Any]], baseline: str) -> str:
    table = markdown_table(
        ["dtype", "shape", "baseline ms (GFLOP/s)", "kernel ms (GFLOP/s)", "speedup",
         "groups off ms", "baseline CPU ms", "kernel CPU ms", "max abs diff"],
        ([r["dtype"], r["shape"], f"{r['baseline_ms']:.2f} ({r['baseline_gflops']:.0f})",
          f"{r['kernel_ms']:.2f} ({r['kernel_gflops']:.0f})", f"{r['speedup']:.2f}x",
          f"{r['no_groups_ms']:.2f}", f"{r['baseline_cpu_ms']:.2f}",
          f"{r['kernel_cpu_ms']:.2f}", f"{r['max_abs_diff']:.1e}"] for r in rows))
    return (f"Extend attention op alone, ms per layer (medians); baseline = `{baseline}`\n\n"
            f"{table}")


# extend-phases: phase -> RADIXRT_EXT_SKIP_PHASES bit of extend_attention.cpp.
EXTEND_PHASES = {"scores": 1, "softmax": 2, "P V": 4, "V packing": 8}


def bench_extend_phases(shapes: list[str], reps: int,
                        dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """The `dtype` pool's phases: this `extend_attention.cpp` built once whole and once
    without each phase (wrong results), interleaved on one layer's K/V (hot); a phase's cost is
    the whole's time minus the time without it."""
    csrc = Path(cpu_kernels.__file__).resolve().parent / "csrc"
    src = (csrc / "extend_attention.cpp").read_text()
    headers = {h: (csrc / h).read_text() for h in cpu_kernels.headers()}
    ops = {"whole": None, **dict.fromkeys(EXTEND_PHASES)}
    for name in ops:
        namespace = "radixrt_phases" + ("" if name == "whole" else str(EXTEND_PHASES[name]))
        build_op_library(src, "extend_attention.cpp", namespace, headers,
                         (f"RADIXRT_EXT_SKIP_PHASES={EXTEND_PHASES.get(name, 0)}",))
        ops[name] = getattr(torch.ops, namespace).extend_attention
    out = []
    for shape in shapes:
        rows, shared = EXTEND_KERNEL_SHAPES[shape]
        kv, (kvi, kptr, loc, qptr), n = _extend_op_args(dtype, rows, shared, 1)
        q = torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
        args = (q.to(dtype), kv.k_buffer[0], kv.v_buffer[0], kvi, kptr, loc, qptr,
                HEAD_DIM**-0.5)
        med = interleaved({k: (lambda op=op, args=args: op(*args)) for k, op in ops.items()},
                          reps)
        row: dict[str, Any] = {"shape": shape, "dtype": str(dtype).removeprefix("torch."),
                               "whole_ms": med["whole"] * 1e3}
        for name in EXTEND_PHASES:
            row[f"{name}_ms"] = (med["whole"] - med[name]) * 1e3
        row["rest_ms"] = row["whole_ms"] - sum(row[f"{k}_ms"] for k in EXTEND_PHASES)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def markdown_extend_phases(rows: list[dict[str, Any]]) -> str:
    names = [*EXTEND_PHASES, "rest"]
    table = markdown_table(
        ["shape", "whole ms", *(f"{k} ms (share)" for k in names)],
        ([r["shape"], f"{r['whole_ms']:.2f}",
          *(f"{r[f'{k}_ms']:.2f} ({r[f'{k}_ms'] / r['whole_ms']:.0%})" for k in names)]
         for r in rows))
    dtypes = ", ".join(sorted({r.get("dtype", "bfloat16") for r in rows}))
    return f"{dtypes} extend attention by phase, one layer, ms (medians)\n\n{table}"


def bench_extend(dtypes: list[str], reps: int) -> list[dict[str, Any]]:
    out = []
    for dname in dtypes:
        for shape in EXTEND_SHAPES:
            row = _extend_case(dname, shape, reps)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def markdown_extend(rows: list[dict[str, Any]]) -> str:
    def fma(r: dict[str, Any]) -> str:
        if "kernel_fma_ms" not in r:
            return "-"
        return f"{r['kernel_fma_ms']:.1f} ({r['kernel_fma_gflops']:.0f})"

    table = markdown_table(
        ["dtype", "shape", "torch path ms (GFLOP/s)", "kernel ms (GFLOP/s)",
         "kernel fp32-FMA ms (GFLOP/s)", "speedup", "torch CPU ms", "kernel CPU ms"],
        ([r["dtype"], r["shape"], f"{r['torch_ms']:.1f} ({r['torch_gflops']:.0f})",
          f"{r['kernel_ms']:.1f} ({r['kernel_gflops']:.0f})", fma(r), f"{r['speedup']:.2f}x",
          f"{r['torch_cpu_ms']:.1f}", f"{r['kernel_cpu_ms']:.1f}"] for r in rows))
    return f"Extend attention only, ms per layer (medians)\n\n{table}"


def bench_attention(batches: list[int], ctxs: list[int], prefixes: list[int],
                    dtypes: list[str], reps: int) -> list[dict[str, Any]]:
    out = []
    for dname in dtypes:
        for bs, ctx, prefix in _cases(batches, ctxs, prefixes):
            row = _attention_case(dname, bs, ctx, prefix, reps)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def _step_case(runner: Any, dname: str, bs: int, ctx: int, prefix: int,
               reps: int) -> dict[str, Any]:
    backend = runner.attn_backend
    fb = decode_batch(runner.req_to_token_pool, runner.token_to_kv_pool, bs, ctx, prefix)

    def run(kernel: bool) -> None:
        backend.decode_kernel = kernel
        runner.forward(fb)

    with torch.inference_mode():
        med = interleaved({"torch": lambda: run(False), "kernel": lambda: run(True)}, reps)
    backend.decode_kernel = True
    return {"dtype": dname, "batch": bs, "ctx": ctx, "prefix": prefix,
            "torch_ms": med["torch"] * 1e3, "kernel_ms": med["kernel"] * 1e3,
            "speedup": med["torch"] / med["kernel"],
            "torch_cpu_ms": med["torch_cpu"] * 1e3, "kernel_cpu_ms": med["kernel_cpu"] * 1e3}


def bench_step(batches: list[int], ctxs: list[int], prefixes: list[int], dtypes: list[str],
               reps: int, model_path: str | None, threads: int) -> list[dict[str, Any]]:
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    out = []
    cases = list(_cases(batches, ctxs, prefixes))
    need = max(p + b * (c - p) for b, c, p in cases)
    for dname in dtypes:
        args = ServerArgs(model_path=model_path, dtype=dname, num_threads=threads,
                          max_running_requests=max(batches), max_total_tokens=need + 64,
                          max_context_len=max(ctxs) + 8, attention_backend="torch",
                          log_level="warning")
        runner = ModelRunner(args)
        backend = runner.attn_backend
        if not (isinstance(backend, TorchNativeBackend) and backend.decode_kernel):
            raise SystemExit(f"kernel not in use: {cpu_kernels.unavailable_reason()}")
        fill_random(runner.token_to_kv_pool, need + 8)
        for bs, ctx, prefix in cases:
            row = _step_case(runner, dname, bs, ctx, prefix, reps)
            print(json.dumps(row), flush=True)
            out.append(row)
        del runner, backend
    return out


def build_op_library(src: str, source: str, namespace: str, headers: dict[str, str],
                     defines: tuple[str, ...] = ()) -> None:
    """Compiles the kernel source text `src` (file name `source`) with its ops registered under
    `namespace` instead of `radixrt` (same compiler flags as the current build, plus `-D`
    `defines`) beside the cached builds, and loads it; `headers` (name -> text) are the ones it
    includes."""
    build_op_sources({source: src}, namespace, headers, defines)


def build_op_sources(sources: dict[str, str], namespace: str, headers: dict[str, str],
                     defines: tuple[str, ...] = ()) -> None:
    """`build_op_library` for several kernel sources (file name -> text) in one library."""
    from torch.utils import cpp_extension

    renamed = {}
    for source, src in sources.items():
        for macros in (("TORCH_LIBRARY(", "TORCH_LIBRARY_FRAGMENT("), ("TORCH_LIBRARY_IMPL(",)):
            if not any(f"{m}radixrt," in src for m in macros):
                raise SystemExit(f"no {macros[0]}radixrt, ...) in {source}")
            for m in macros:
                src = src.replace(f"{m}radixrt,", f"{m}{namespace},")
        # custom classes are named by their library in every schema that takes one
        src = src.replace("torch.classes.radixrt.", f"torch.classes.{namespace}.")
        renamed[source] = src
    spec = cpu_kernels.build_spec()
    cflags = [*spec.cflags, *(f"-D{d}" for d in defines)]
    key = hashlib.sha256(("".join(renamed.values()) + "".join(headers.values())
                          + " ".join(cflags) + torch.__version__).encode()).hexdigest()
    directory = cpu_kernels.cache_root() / f"{namespace}-{spec.isa}-{key[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in headers.items():
        if not (directory / name).exists():
            (directory / name).write_text(text)
    targets = []
    for source, src in renamed.items():
        target = directory / source.replace(".cpp", f"_{namespace}.cpp")
        if not target.exists() or target.read_text() != src:  # an unchanged file is not rebuilt
            target.write_text(src)
        targets.append(str(target))
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    cpp_extension.load(name=f"{namespace}_{key[:16]}", sources=targets,
                       extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                       extra_include_paths=[str(directory)],  # <torch_headers.h>
                       build_directory=str(directory), is_python_module=False)


def revision_sources(rev: str, names: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """(`radixrt/attention/csrc/<name>` for each name, every csrc/*.h) as of git `rev`."""
    root = Path(__file__).resolve().parents[1]

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout

    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, "radixrt/attention/csrc/"],
                            cwd=root, check=True, capture_output=True, text=True).stdout
    headers = {Path(p).name: show(p) for p in listed.split() if p.endswith(".h")}
    return {n: show(f"radixrt/attention/csrc/{n}") for n in names}, headers


def checkout_sources(names: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """`revision_sources` for this checkout's working tree."""
    csrc = Path(__file__).resolve().parents[1] / "radixrt/attention/csrc"
    headers = {h.name: h.read_text() for h in sorted(csrc.glob("*.h"))}
    return {n: (csrc / n).read_text() for n in names}, headers


def load_baseline(rev: str, source: str = "paged_decode.cpp") -> None:
    """Builds `radixrt/attention/csrc/<source>` as of git `rev` under the op namespace
    `radixrt_baseline` and loads it."""
    sources, headers = revision_sources(rev, (source,))
    build_op_library(sources[source], source, "radixrt_baseline", headers)


def _kv_bytes_per_layer(dname: str, bs: int, ctx: int, prefix: int) -> int:
    """K+V bytes one layer's attention reads (a shared prefix once)."""
    elem = torch.empty((), dtype=POOL_DTYPES[dname]).element_size()
    return (prefix + bs * (ctx - prefix)) * KV_HEADS * HEAD_DIM * 2 * elem


def _op_case(dname: str, bs: int, ctx: int, prefix: int, layers: int
             ) -> tuple[TokenToKVPool, PagedDecodePlan, torch.Tensor]:
    """A pool of `layers` layers of random K/V, the batch's plan (one cascade group over the
    first `prefix` slots when > 0) and its queries, for the op alone."""
    dtype = DTYPES.get(dname, torch.float32)  # the queries' (and the model's) dtype
    tokens = prefix + bs * (ctx - prefix)
    kv = TokenToKVPool(tokens + 8, layers, KV_HEADS, HEAD_DIM, dtype,
                       kv_dtype=POOL_DTYPES[dname])
    fill_random(kv, tokens + 8)
    fb = decode_batch(ReqToTokenPool(bs, ctx + 1), kv, bs, ctx, prefix)
    groups = [SharedPrefixGroup(list(range(bs)), prefix)] if prefix else []
    q = torch.randn(bs, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    return kv, PagedDecodePlan.build(fb, groups), q


def _kernel_case(dname: str, bs: int, ctx: int, prefix: int, reps: int,
                 hot: bool) -> dict[str, Any]:
    """`hot`: one layer's buffers, attended 30 times (K/V from the caches where they fit)."""
    per_layer = _kv_bytes_per_layer(dname, bs, ctx, prefix)
    layers = 1 if hot else min(LAYERS, max(2, math.ceil(FROM_MEMORY_BYTES / per_layer)))
    kv, plan, q = _op_case(dname, bs, ctx, prefix, layers)
    args = (plan.kv_indices, plan.row_start, plan.row_len, plan.group_start, plan.group_len,
            plan.group_row_ptr, plan.group_rows)
    scale = HEAD_DIM**-0.5

    def step(op: Any) -> None:
        for i in range(LAYERS):
            layer = i % layers
            op(q, kv.k_buffer[layer], kv.v_buffer[layer], *args, scale)

    new, old = torch.ops.radixrt.paged_decode, torch.ops.radixrt_baseline.paged_decode
    a, b = new(q, kv.k_buffer[0], kv.v_buffer[0], *args, scale), old(
        q, kv.k_buffer[0], kv.v_buffer[0], *args, scale)
    max_diff = float((a[0].float() - b[0].float()).abs().max())
    med = interleaved({"baseline": lambda: step(old), "kernel": lambda: step(new)}, reps)
    per_step = 1e3
    return {"dtype": dname, "batch": bs, "ctx": ctx, "prefix": prefix, "layers_timed": layers,
            "hot": hot,
            "baseline_ms": med["baseline"] * per_step, "kernel_ms": med["kernel"] * per_step,
            "speedup": med["baseline"] / med["kernel"],
            "baseline_cpu_ms": med["baseline_cpu"] * per_step,
            "kernel_cpu_ms": med["kernel_cpu"] * per_step,
            "kv_mb_per_layer": per_layer / 2**20,
            "kernel_gb_s": per_layer * LAYERS / med["kernel"] / 1e9,
            "baseline_gb_s": per_layer * LAYERS / med["baseline"] / 1e9,
            "max_abs_diff": max_diff}


GROUP_PASSES = {"blocks": 2, "scan": 1 << 30}  # RADIXRT_PD_BLOCK_GROUP_ROWS per variant


def load_group_passes() -> dict[str, Any]:
    """This checkout's paged_decode op built once per GROUP_PASSES variant (namespace
    `radixrt_pass_<name>`), by name."""
    sources, headers = checkout_sources(("paged_decode.cpp",))
    src = sources["paged_decode.cpp"]
    ops = {}
    for name, rows in GROUP_PASSES.items():
        build_op_library(src, "paged_decode.cpp", f"radixrt_pass_{name}", headers,
                         (f"RADIXRT_PD_BLOCK_GROUP_ROWS={rows}",))
        ops[name] = getattr(torch.ops, f"radixrt_pass_{name}").paged_decode
    return ops


def _group_pass_case(ops: dict[str, Any], dname: str, bs: int, ctx: int, prefix: int,
                     reps: int) -> dict[str, Any]:
    """One group of `bs` rows over a `prefix`-key shared prefix, 30 layers from memory: each
    variant's median ms per step, and the blocks' speed over the scan's."""
    per_layer = _kv_bytes_per_layer(dname, bs, ctx, prefix)
    layers = min(LAYERS, max(2, math.ceil(FROM_MEMORY_BYTES / per_layer)))
    kv, plan, q = _op_case(dname, bs, ctx, prefix, layers)
    args, scale = plan.tensors(), HEAD_DIM**-0.5

    def step(op: Any) -> Callable[[], None]:
        def run() -> None:
            for i in range(LAYERS):
                op(q, kv.k_buffer[i % layers], kv.v_buffer[i % layers], *args, scale)
        return run

    outs = [op(q, kv.k_buffer[0], kv.v_buffer[0], *args, scale)[0].float() for op in ops.values()]
    med = interleaved({name: step(op) for name, op in ops.items()}, reps)
    return {"dtype": dname, "batch": bs, "ctx": ctx, "prefix": prefix,
            "blocks_ms": med["blocks"] * 1e3, "scan_ms": med["scan"] * 1e3,
            "blocks_speedup": med["scan"] / med["blocks"],
            "max_abs_diff": float((outs[0] - outs[1]).abs().max())}


def markdown_group_pass(rows: list[dict[str, Any]]) -> str:
    return ("Op alone, ms per 30-layer decode step from memory, one cascade group over its "
            "shared prefix\n\n" + markdown_table(
                ["dtype", "group rows", "ctx", "shared prefix", "blocks ms", "scan ms",
                 "blocks speedup", "max abs diff"],
                ([r["dtype"], r["batch"], r["ctx"], r["prefix"], f"{r['blocks_ms']:.2f}",
                  f"{r['scan_ms']:.2f}", f"{r['blocks_speedup']:.2f}x",
                  f"{r['max_abs_diff']:.1e}"] for r in rows)))


def _prefetch_case(dname: str, bs: int, ctx: int, prefix: int, reps: int,
                   ahead: list[str]) -> dict[str, Any]:
    """The op on 30 layers from memory at each prefetch setting in `ahead` (a distance, with
    `/l1` or `/l2` the level too, else the process's), alternating."""
    per_layer = _kv_bytes_per_layer(dname, bs, ctx, prefix)
    kv, plan, q = _op_case(dname, bs, ctx, prefix, LAYERS)
    setting = torch.ops.radixrt.paged_decode_prefetch
    level = torch.ops.radixrt.paged_decode_prefetch_l1
    default_level = level()

    def at(spec: str) -> Callable[[], None]:
        blocks, _, hint = spec.partition("/")

        def step() -> None:
            setting(int(blocks), int(blocks))
            level({"l1": 1, "l2": 0}.get(hint, default_level))
            for layer in range(LAYERS):
                plan.run(q, kv.k_buffer[layer], kv.v_buffer[layer], HEAD_DIM**-0.5)
        return step

    before = setting()
    try:
        med = interleaved({b: at(b) for b in ahead}, reps)
    finally:
        setting(*before)
        level(default_level)
    row: dict[str, Any] = {"dtype": dname, "batch": bs, "ctx": ctx, "prefix": prefix,
                           "kv_mb_per_layer": per_layer / 2**20, "default_ahead": list(before),
                           "default_l1": default_level}
    for b in ahead:
        row[f"ms_{b}"] = med[b] * 1e3
        row[f"gb_s_{b}"] = per_layer * LAYERS / med[b] / 1e9
        row[f"speedup_{b}"] = med[ahead[0]] / med[b]
    return row


def markdown_prefetch(rows: list[dict[str, Any]], ahead: list[str]) -> str:
    head = ("Op alone, ms per 30-layer decode step from memory, by key blocks prefetched ahead "
            f"(speed against {ahead[0]})\n\n| dtype | batch | ctx | shared prefix | "
            + " | ".join(f"{b} ahead" for b in ahead) + " |\n|---|---|---|---|"
            + "---|" * len(ahead) + "\n")
    body = "".join(
        f"| {r['dtype']} | {r['batch']} | {r['ctx']} | {r['prefix'] or '-'} | "
        + " | ".join(f"{r[f'ms_{b}']:.2f} ({r[f'gb_s_{b}']:.1f} GB/s, {r[f'speedup_{b}']:.2f}x)"
                     for b in ahead) + " |\n"
        for r in rows)
    return head + body


def bench_kernel(batches: list[int], ctxs: list[int], prefixes: list[int], dtypes: list[str],
                 reps: int, hot: bool) -> list[dict[str, Any]]:
    out = []
    for dname in dtypes:
        for bs, ctx, prefix in _cases(batches, ctxs, prefixes):
            row = _kernel_case(dname, bs, ctx, prefix, reps, hot)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def markdown_kernel(rows: list[dict[str, Any]], baseline: str) -> str:
    hot = ", one layer's K/V attended 30 times (hot)" if rows and rows[0]["hot"] else ""
    head = (f"Op alone, ms per 30-layer decode step{hot}: baseline = `{baseline}`\n\n"
            "| dtype | batch | ctx | shared prefix | K+V MB/layer | baseline ms | kernel ms | speedup "
            "| baseline CPU ms | kernel CPU ms | kernel GB/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['dtype']} | {r['batch']} | {r['ctx']} | {r['prefix'] or '-'} | "
        f"{r['kv_mb_per_layer']:.1f} | {r['baseline_ms']:.1f} | {r['kernel_ms']:.1f} | "
        f"{r['speedup']:.2f}x | {r['baseline_cpu_ms']:.1f} | {r['kernel_cpu_ms']:.1f} | "
        f"{r['kernel_gb_s']:.1f} |\n" for r in rows)


def markdown(rows: list[dict[str, Any]], what: str) -> str:
    table = markdown_table(
        ["dtype", "batch", "ctx", "shared prefix", "torch path ms", "kernel ms", "speedup",
         "torch path CPU ms", "kernel CPU ms", "CPU ratio"],
        ([r["dtype"], r["batch"], r["ctx"], r["prefix"] or "-", f"{r['torch_ms']:.1f}",
          f"{r['kernel_ms']:.1f}", f"{r['speedup']:.2f}x", f"{r['torch_cpu_ms']:.1f}",
          f"{r['kernel_cpu_ms']:.1f}", f"{r['torch_cpu_ms'] / r['kernel_cpu_ms']:.2f}x"]
         for r in rows))
    return f"{what}\n\n{table}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("attention", "step", "kernel", "prefetch", "extend",
                                     "extend-kernel", "extend-phases", "group-pass"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 400])
    ap.add_argument("--dtype", nargs="+", choices=tuple(POOL_DTYPES), default=list(DTYPES),
                    help="float16: a half pool under fp32 queries (kernel / prefetch / "
                         "extend-kernel only)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4,
                    help="extend-kernel: layers whose K/V the op reads in turn (more: colder)")
    ap.add_argument("--shape", nargs="+", default=None,
                    help="extend-phases / extend-kernel: only the shapes whose names contain one "
                         "of these")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--baseline", default=None,
                    help="kernel / extend-kernel: git revision of paged_decode.cpp / "
                         "extend_attention.cpp to compare against (default 1e7a68f / HEAD)")
    ap.add_argument("--hot", action="store_true",
                    help="kernel: one layer's K/V attended 30 times (cache-resident where it fits)")
    ap.add_argument("--ahead", nargs="+", default=["1", "2", "3"],
                    help="prefetch: key blocks fetched ahead (N, or N/l1, N/l2 with the cache "
                         "level), the first the reference")
    ap.add_argument("--out", default=None, help="write rows + machine info as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not cpu_kernels.load_cpu_kernels():
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    info = machine()
    print(json.dumps(info), flush=True)
    if a.what == "extend-phases":
        with torch.inference_mode():
            shapes = [k for k in EXTEND_KERNEL_SHAPES
                      if not a.shape or any(f in k for f in a.shape)]
            rows = [r for d in a.dtype
                    for r in bench_extend_phases(shapes, a.reps, DTYPES[d])]
        print(markdown_extend_phases(rows))
        if a.out:
            Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    if a.what == "extend-kernel":
        baseline = a.baseline or "HEAD"
        load_baseline(baseline, "extend_attention.cpp")
        rows = []
        with torch.inference_mode():
            for dname in a.dtype:
                for shape in EXTEND_KERNEL_SHAPES:
                    if a.shape and not any(f in shape for f in a.shape):
                        continue
                    rows.append(_extend_kernel_case(dname, shape, a.reps, a.layers))
                    print(json.dumps(rows[-1]), flush=True)
        print(markdown_extend_kernel(rows, baseline))
        if a.out:
            Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    if a.what == "kernel":
        a.baseline = a.baseline or "1e7a68f"
        load_baseline(a.baseline)
        with torch.inference_mode():
            rows = bench_kernel(a.batch, a.ctx, a.prefix, a.dtype, a.reps, a.hot)
        print(markdown_kernel(rows, a.baseline))
        if a.out:
            Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    if a.what == "group-pass":
        ops = load_group_passes()
        rows = []
        with torch.inference_mode():
            for dname in a.dtype:
                for bs, ctx, prefix in _cases(a.batch, a.ctx, a.prefix):
                    if prefix:
                        rows.append(_group_pass_case(ops, dname, bs, ctx, prefix, a.reps))
                        print(json.dumps(rows[-1]), flush=True)
        print(markdown_group_pass(rows))
        if a.out:
            Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    if a.what == "prefetch":
        with torch.inference_mode():
            rows = []
            for dname in a.dtype:
                for bs, ctx, prefix in _cases(a.batch, a.ctx, a.prefix):
                    rows.append(_prefetch_case(dname, bs, ctx, prefix, a.reps, a.ahead))
                    print(json.dumps(rows[-1]), flush=True)
        print(markdown_prefetch(rows, a.ahead))
        if a.out:
            Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    if a.what == "extend":
        with torch.inference_mode():
            rows = bench_extend(a.dtype, a.reps)
        print(markdown_extend(rows))
        if a.out:
            Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    if a.what == "attention":
        with torch.inference_mode():
            rows = bench_attention(a.batch, a.ctx, a.prefix, a.dtype, a.reps)
        title = "Attention only, ms per 30-layer decode step"
    else:
        rows = bench_step(a.batch, a.ctx, a.prefix, a.dtype, a.reps, a.model, a.threads)
        title = "Whole decode step (ModelRunner.forward), ms"
    print(markdown(rows, title))
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
