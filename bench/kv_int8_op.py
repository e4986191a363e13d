"""Paged decode on an int8 KV cache against the bf16 one: the two C++ ops alone.

    python bench/kv_int8_op.py --batch 8 64 --ctx 544 --slots contiguous random [--hot] \
        [--pools bf16 int8 fp32 fp16]

`--pools` picks the caches timed (bf16 and int8 by default): `fp32` and `fp16` are an fp32 pool
and a float16 pool under an fp32 model (`--kv-cache-dtype float16`), both with fp32 queries.

SmolLM2's shape (9 query heads, 3 KV heads, head dim 64): one bf16 pool and one int8 pool per
layer (head-major, as radixrt's CPU pool), 30 layers so K/V comes from memory as in a real step
(`--hot`: 2 layers, the kernels' compute with K/V in the caches), filled with the same random
K/V (`radixrt::kv_store` / `radixrt::kv_store_i8`). Each row attends over `ctx` keys. `--slots
contiguous`: each row's keys are a run of consecutive slots (what the allocator hands one
prompt); `random`: a random permutation (a fragmented pool, where every key is its own cache
lines, scales included). Times are per 30 layers, the best of `--reps`, ops alternating.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def _head_major(slots: int, dtype: torch.dtype, *last: int) -> torch.Tensor:
    return torch.empty((KV_HEADS, slots, *last), dtype=dtype).transpose(0, 1)


def run(batch: int, ctx: int, slots_kind: str, hot: bool, reps: int,
        pools: tuple[str, ...] = ("bf16", "int8")) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    layers = 2 if hot else LAYERS
    slots = batch * ctx + 1
    loc = torch.arange(1, slots)
    bufs: dict[str, list[tuple[torch.Tensor, ...]]] = {name: [] for name in pools}
    store = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    for _ in range(layers):
        k = torch.randn(slots - 1, KV_HEADS, DIM, generator=g).bfloat16()
        v = torch.randn(slots - 1, KV_HEADS, DIM, generator=g).bfloat16()
        for name in pools:
            if name == "int8":
                kc, vc = _head_major(slots, torch.int8, DIM), _head_major(slots, torch.int8, DIM)
                ks, vs = _head_major(slots, torch.float32), _head_major(slots, torch.float32)
                torch.ops.radixrt.kv_store_i8(kc, vc, ks, vs, loc, k, v)
                bufs[name].append((kc, vc, ks, vs))
                continue
            kb, vb = _head_major(slots, store[name], DIM), _head_major(slots, store[name], DIM)
            src = torch.bfloat16 if name == "bf16" else torch.float32
            torch.ops.radixrt.kv_store(kb, vb, loc, k.to(src), v.to(src))
            bufs[name].append((kb, vb))
    order = (loc if slots_kind == "contiguous"
             else loc[torch.randperm(slots - 1, generator=g)])
    idx = order[: batch * ctx].to(torch.int32).contiguous()
    rs = torch.arange(batch, dtype=torch.int64) * ctx
    rl = torch.full((batch,), ctx, dtype=torch.int64)
    e = torch.zeros(0, dtype=torch.int64)
    gp = torch.zeros(1, dtype=torch.int64)
    q32 = torch.randn(batch, HEADS, DIM, generator=g)
    q = q32.bfloat16()
    scale = DIM**-0.5

    def op_for(name: str):  # noqa: ANN202
        if name == "int8":
            return lambda li: torch.ops.radixrt.paged_decode_i8(
                q, *bufs[name][li], idx, rs, rl, e, e, gp, e, scale)
        qq = q if name == "bf16" else q32
        return lambda li: torch.ops.radixrt.paged_decode(qq, *bufs[name][li], idx, rs, rl, e, e,
                                                         gp, e, scale)

    ops = {name: op_for(name) for name in pools}
    best = {name: float("inf") for name in ops}
    for _ in range(reps):
        for name, op in ops.items():
            t = time.perf_counter()
            for _ in range(LAYERS // layers):
                for li in range(layers):
                    op(li)
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: s * 1e3 for name, s in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[544])
    ap.add_argument("--slots", nargs="+", default=["contiguous", "random"],
                    choices=["contiguous", "random"])
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pools", nargs="+", default=["bf16", "int8"],
                    choices=["bf16", "int8", "fp32", "fp16"])
    a = ap.parse_args()
    from radixrt.attention import cpu_kernels
    from radixrt.attention.paged_decode import paged_decode_i8_unavailable_reason

    if not cpu_kernels.load_cpu_kernels():
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    if "int8" in a.pools and (why := paged_decode_i8_unavailable_reason()) is not None:
        raise SystemExit(why)
    torch.set_num_threads(a.threads)
    print(f"{a.threads} threads, {'hot (2 layers)' if a.hot else 'from memory (30 layers)'}; "
          "ms per 30 layers, best of", a.reps)
    for slots_kind in a.slots:
        for b in a.batch:
            for ctx in a.ctx:
                t = run(b, ctx, slots_kind, a.hot, a.reps, tuple(a.pools))
                times = "  ".join(f"{name} {ms:7.2f} ms" for name, ms in t.items())
                first, last = a.pools[0], a.pools[-1]
                print(f"{slots_kind:10s} batch {b:3d} ctx {ctx:5d}: {times}  "
                      f"{first}/{last} {t[first] / t[last]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
