"""Fused C++ layer ops (`model/layer_ops.py`, `attention/csrc/fused_ops.cpp`) against the torch
ops they replace, interleaved in one process on one `ModelRunner` (default SmolLM2).

    python bench/step_fusion.py decode --batch-size 1 8 64 --input-len 512 --rounds 5
    python bench/step_fusion.py prefill --input-len 512 4096 --dtype float32 bfloat16 --rounds 3
    python bench/step_fusion.py compile --dtype bfloat16 --batch-size 8 64 --cpu-time
    python bench/step_fusion.py profile --batch-size 8 --input-len 512 [--torch-ops]
    python bench/step_fusion.py layers --batch-size 1 8 64 --rounds 6

`decode`: bare decode steps over `input-len` random cached tokens per request (random K/V, no
prefill: no op here depends on the values), `--steps` per block; old (torch ops, KV written by
`index_copy_`) and new (fused ops, `kv_store`) blocks alternate `--rounds` times; the first step
of each block is dropped. `prefill`: one request of `input-len` tokens, from an empty cache.
`compile`: torch ops, fused ops and torch ops under torch.compile (`compile_decode`) in turn.
`layers`: decode steps with the fused ops, the layers run by the Python loop vs by one
`radixrt::decode_layers` call (`model/decode_layers.py`), alternating as in `decode`.
Reported: medians in ms (wall, or with `--cpu-time` the process's CPU time, which contention
from other processes inflates far less) and new/old. `profile`: `torch.profiler` table of one decode step.
Speed is never asserted in tests; this script is where it is measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scheduler runs; before torch loads

import torch  # noqa: E402

from bench.decode_steps import RandomKVDecoder  # noqa: E402
from radixrt.config import ServerArgs  # noqa: E402
from radixrt.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixrt.model.layer_ops import FusedCpuLayerOps, TorchLayerOps  # noqa: E402
from radixrt.model.runner import ModelRunner  # noqa: E402

clock = time.perf_counter  # `--cpu-time`: time.process_time


def make_runner(dtype: str, max_bs: int, ctx: int, threads: int) -> ModelRunner:
    torch.set_num_threads(threads)
    return ModelRunner(ServerArgs(
        max_running_requests=max_bs, max_total_tokens=max_bs * (ctx + 80) + 64,
        max_context_len=ctx + 80, attention_backend="torch", log_level="warning", dtype=dtype,
        num_threads=threads))


def use(runner: ModelRunner, fused: bool) -> None:
    """Old (torch ops, set_kv) or new (fused ops, kv_store) for the following steps."""
    if fused and not isinstance(runner.model.ops, FusedCpuLayerOps) and not hasattr(
            torch.ops.radixrt, "rms_norm"):
        raise RuntimeError("fused ops unavailable")
    runner.model.set_layer_ops(FusedCpuLayerOps() if fused else TorchLayerOps())
    runner.attn_backend._kv_store = fused  # type: ignore[attr-defined]


def prefill_once(runner: ModelRunner, n: int, seed: int) -> float:
    rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool
    rp.clear()
    kp.clear()
    row = rp.alloc()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, runner.model_config.vocab_size, (n,), generator=g).tolist()
    rp.write([row], [0], [n], kp.alloc(n))
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [row], [0], [n], rp.req_to_token,
                            runner.device)
    t = clock()
    runner.forward(fb)
    return clock() - t


def report(res: dict[tuple[Any, ...], list[float]], unit: str = "ms") -> None:
    keys = sorted({k[:-1] for k in res})
    for k in keys:
        old, new = (statistics.median(res[(*k, f)]) * 1e3 for f in (False, True))
        print(f"{' '.join(map(str, k)):28s} torch ops {old:8.2f} {unit}  fused {new:8.2f} {unit}"
              f"  new/old {new / old:.3f}  (n={len(res[(*k, True)])})", flush=True)


def alternate(dec: RandomKVDecoder, rounds: int, steps: int,
              switch: Callable[[bool], None]) -> dict[bool, list[float]]:
    """Decode steps with `switch(False)` (old) and `switch(True)` (new) in alternating blocks
    of `steps` (order flipped every round; each block's first step is a dropped warm-up)."""
    out: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for new in ((False, True) if r % 2 == 0 else (True, False)):
            switch(new)
            dec.step()  # warm-up
            out[new] += [dec.step() for _ in range(steps)]
    return out


def decode(a: argparse.Namespace) -> None:
    for dtype in a.dtype:
        runner = make_runner(dtype, max(a.batch_size), a.input_len + a.rounds * 2 * a.steps,
                             a.threads)
        print(f"dtype {runner.dtype}, quantization {runner.quant.mode}, {a.threads} threads, "
              f"kernel ISA {torch.ops.radixrt.fused_ops_isa()}", flush=True)
        res: dict[tuple[Any, ...], list[float]] = {}
        for bs in a.batch_size:
            dec = RandomKVDecoder(runner, bs, a.input_len, clock)
            times = alternate(dec, a.rounds, a.steps,
                              lambda fused, r=runner: use(r, fused))  # type: ignore[misc]
            for fused, ts in times.items():
                res[(dtype, f"batch {bs}", fused)] = ts
            print(f"  (load {os.getloadavg()[0]:.1f})", flush=True)
        report(res)


def layers(a: argparse.Namespace) -> None:
    for dtype in a.dtype:
        runner = make_runner(dtype, max(a.batch_size), a.input_len + a.rounds * 2 * a.steps,
                             a.threads)
        use(runner, True)
        stack = runner.model.decode_layers()
        print(f"dtype {runner.dtype}, quantization {runner.quant.mode}, {a.threads} threads, "
              f"one-call path: {stack if isinstance(stack, str) else 'available'}", flush=True)
        for bs in a.batch_size:
            dec = RandomKVDecoder(runner, bs, a.input_len, clock)
            times = alternate(dec, a.rounds, a.steps,
                              lambda one_call, r=runner: setattr(  # type: ignore[misc]
                                  r.model, "fused_decode", one_call))
            old, new = (statistics.median(times[f]) * 1e3 for f in (False, True))
            print(f"{dtype} batch {bs:3d}  layer loop {old:8.2f} ms  one call {new:8.2f} ms  "
                  f"saved {old - new:6.2f} ms  new/old {new / old:.3f}  "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)


def prefill(a: argparse.Namespace) -> None:
    for dtype in a.dtype:
        runner = make_runner(dtype, 1, max(a.input_len), a.threads)
        print(f"dtype {runner.dtype}, {a.threads} threads", flush=True)
        res: dict[tuple[Any, ...], list[float]] = {}
        for n in a.input_len:
            for r in range(a.rounds):
                for fused in ((False, True) if r % 2 == 0 else (True, False)):
                    use(runner, fused)
                    res.setdefault((dtype, f"prefill {n}", fused), []).append(
                        prefill_once(runner, n, r))
            print(f"  (load {os.getloadavg()[0]:.1f})", flush=True)
        report(res)
        for k, v in sorted(res.items()):
            if k[-1] and clock is time.perf_counter:
                print(f"{k[0]} {k[1]} fused: {int(k[1].split()[1]) / statistics.median(v):.0f} "
                      "tok/s")


def compile_ab(a: argparse.Namespace) -> None:
    """Decode steps: torch ops eager, fused ops eager, torch ops under `compile_decode`'s
    torch.compile (inductor fuses the same element-wise ops into its own C++ loops)."""
    from radixrt.model.compiled_layers import CompiledDense

    dtype = a.dtype[0]
    runner = make_runner(dtype, max(a.batch_size), a.input_len + a.rounds * 3 * a.steps + 8,
                         a.threads)
    compiled = CompiledDense(runner.model.layers)
    use(runner, False)
    t = time.perf_counter()
    with compiled.active():
        for bs in a.batch_size:
            RandomKVDecoder(runner, bs, a.input_len, clock).step()
    print(f"dtype {runner.dtype}: first compiled steps took {time.perf_counter() - t:.0f} s",
          flush=True)
    res: dict[str, list[float]] = {}
    for bs in a.batch_size:
        dec = RandomKVDecoder(runner, bs, a.input_len, clock)
        for _ in range(a.rounds):
            for name in ("torch ops", "fused ops", "compiled torch ops"):
                use(runner, name == "fused ops")
                for i in range(a.steps + 1):
                    if name.startswith("compiled"):
                        with compiled.active():
                            dt = dec.step()
                    else:
                        dt = dec.step()
                    if i:
                        res.setdefault(f"batch {bs} {name}", []).append(dt)
        base = statistics.median(res[f"batch {bs} torch ops"])
        for name in ("torch ops", "fused ops", "compiled torch ops"):
            m = statistics.median(res[f"batch {bs} {name}"])
            print(f"{dtype} batch {bs:3d} {name:20s} {m * 1e3:8.2f} ms  x{m / base:.3f}",
                  flush=True)


def profile(a: argparse.Namespace) -> None:
    from torch.profiler import profile as prof

    runner = make_runner(a.dtype[0], a.batch_size[0], a.input_len + 40, a.threads)
    use(runner, not a.torch_ops)
    dec = RandomKVDecoder(runner, a.batch_size[0], a.input_len, clock)
    for _ in range(3):
        dec.step()
    with prof() as p:
        for _ in range(3):
            dec.step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("decode", "prefill", "compile", "profile", "layers"):
        p = sub.add_parser(name)
        p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
        p.add_argument("--input-len", type=int, nargs="+" if name == "prefill" else None,
                       default=[512] if name == "prefill" else 512)
        p.add_argument("--dtype", nargs="+", default=["auto"])
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--steps", type=int, default=4)
        p.add_argument("--rows", type=int, default=25)
        p.add_argument("--torch-ops", action="store_true", help="profile: the old ops")
        p.add_argument("--cpu-time", action="store_true",
                       help="time steps by this process's CPU time (all its threads) instead of "
                            "wall time: robust when other processes share the cores")
    a = ap.parse_args()
    if a.cpu_time:
        global clock
        clock = time.process_time
    {"decode": decode, "prefill": prefill, "compile": compile_ab, "profile": profile,
     "layers": layers}[a.cmd](a)


if __name__ == "__main__":
    main()
