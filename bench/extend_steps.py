"""Extend (prefill) steps on the default model: where the time goes, and old vs new attention.

    python bench/extend_steps.py profile [--shapes agent20 agent64 mixed20 mixed64 fresh1 fresh4]
    python bench/extend_steps.py steps --rounds 5
    python bench/extend_steps.py steps --baseline bad92c2 --shapes agentshared20 fresh4
    python bench/extend_steps.py fused --shapes cached1 fresh64t fresh1 mixed20
    python bench/extend_steps.py chunks --sizes 64 128 256 512 --contexts 0 1000 --rounds 5

OpenMP threads wait as the scheduler's do by default (`ServerArgs.thread_wait`).

Shapes (the serving traces' agent waves, `bench/results/2026-11-23-vm-serve-vs-llama-server-c64-raw`):
`agentN`: N requests x 65 new tokens on an 850-token cached prefix of their own;
`agentsharedN`: the same, the first 700 prefix slots shared by all (the tool preamble);
`mixedN`: `agentN` plus 40 one-token decode rows at context 900 (the layout of `BatchBuilder.build_mixed`); `freshB`: B
requests x 512 new tokens, empty cache. The pool holds random K/V (attention's cost does not
depend on the values). `profile`: torch.profiler table of one step, grouped into weight matmuls,
attention, K/V store/gather and the rest. `steps`: the extend attention kernel on and off
(`TorchNativeBackend.extend_kernel`), or with `--baseline REV` the kernel as of REV against this
one (and with its shared-prefix groups off), interleaved `--rounds` times in one process;
medians, and each variant's time over the first's. `fused`: the step's layers in one C++ call
(`radixrt::extend_step`) against the Python layer loop (`LlamaForCausalLM.fused_extend`),
interleaved the same way, with whether their logits are bitwise equal.
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
from collections import defaultdict  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

from radixrt.config import ServerArgs  # noqa: E402  (imports no torch)
from radixrt.core.cpu_policy import omp_env  # noqa: E402

# OpenMP threads wait as the scheduler's do by default (ServerArgs.thread_wait, "brief": spin
# GOMP_SPINCOUNT=3000 / KMP_BLOCKTIME=1, then sleep); set before torch loads OpenMP. A wait
# variable already in the environment wins.
for _var, _val in omp_env(1, ServerArgs.__dataclass_fields__["thread_wait"].default).items():
    if _val is not None and _var in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_WAIT_POLICY"):
        os.environ.setdefault(_var, _val)

import torch  # noqa: E402

from radixrt.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixrt.model.runner import ModelRunner  # noqa: E402

# name -> (extend rows: (prefix, new) pairs)
SHAPES: dict[str, list[tuple[int, int]]] = {
    "agent1": [(850, 75)],
    "agent20": [(850, 65)] * 20,
    "agent64": [(850, 65)] * 64,
    "agentshared20": [(850, 65)] * 20,
    "agentshared64": [(850, 65)] * 64,
    "mixed20": [(850, 65)] * 20 + [(899, 1)] * 40,
    "mixed64": [(850, 65)] * 64 + [(899, 1)] * 40,
    "fresh1": [(0, 512)],
    "cached1": [(850, 1)],  # a prompt's last token alone, the rest cached
    "fresh64t": [(0, 64)],  # a chat turn's new tokens alone
    "fresh2t": [(0, 2)],
    "fresh4": [(0, 512)] * 4,
    "fresh8": [(0, 512)] * 8,
    # long-context preset: a question over a cached 4096-token document, a chunk deep in one
    "doc1": [(4096, 45)],
    "docchunk": [(3584, 256)],
    # long-context random (stop 75): a paced chunk of a 2048-token prompt, early and late
    "chunk100": [(0, 100)],
    "chunk100at1k": [(1000, 100)],
    "chunk400at1k": [(1000, 400)],
}

# Shapes whose requests' prefixes start with the same cached slots (the radix cache's hit on the
# agent's tool preamble): name -> shared prefix tokens.
SHARED: dict[str, int] = {"agentshared20": 700, "agentshared64": 700}

# Profiler op name -> category (the rest is "other").
_CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "radixrt::qgemv",
               "aten::bmm", "qgemm", "quant", "aten::_weight_int4pack_mm",
               "aten::_weight_int8pack_mm"),
    "attention": ("scaled_dot_product", "_flash_attention", "radixrt::extend_attention",
                  "radixrt::paged_decode"),
    "kv gather/store": ("aten::index_select", "radixrt::kv_store", "aten::index_put",
                        "aten::index_copy", "aten::cat"),
}


def make_runner(threads: int, tokens: int, bs: int, ctx: int, dtype: str,
                quant_max_rows: int | None = None) -> ModelRunner:
    torch.set_num_threads(threads)
    return ModelRunner(ServerArgs(
        max_running_requests=bs, max_total_tokens=tokens + 64, max_context_len=ctx + 16,
        attention_backend="torch", log_level="warning", dtype=dtype, num_threads=threads,
        quant_max_rows=quant_max_rows))


class ExtendStep:
    """One extend step of `rows` ((prefix, new) per request) over random cached K/V; `run()`
    can be repeated (the step's slots are reused)."""

    def __init__(self, runner: ModelRunner, rows: list[tuple[int, int]], shared: int = 0):
        rp, kp = runner.req_to_token_pool, runner.token_to_kv_pool
        rp.clear()
        kp.clear()
        self.runner = runner
        self.reqs = [rp.alloc() for _ in rows]
        pre = [p for p, _ in rows]
        ext = [e for _, e in rows]
        common = kp.alloc(shared)  # the first `shared` slots of every row
        own = kp.alloc(sum(p + e - shared for p, e in rows))
        slots = torch.cat([torch.cat([common, part]) for part in
                           own.split([p + e - shared for p, e in rows])])
        rp.write(self.reqs, [0] * len(rows), [p + e for p, e in rows], slots)
        g = torch.Generator().manual_seed(0)
        for buf in (*kp.k_buffer, *kp.v_buffer):
            buf[slots] = torch.randn(slots.numel(), *buf.shape[1:], generator=g).to(buf.dtype)
        ids = torch.randint(100, 1000, (sum(ext),), generator=g)
        self.fb = ForwardBatch.build(ForwardMode.EXTEND, ids, self.reqs, pre, ext,
                                     rp.req_to_token, runner.device)

    def run(self) -> float:
        t = time.perf_counter()
        self.runner.forward(self.fb)
        return time.perf_counter() - t


def set_kernel(runner: ModelRunner, on: bool) -> bool:
    """Turns the extend attention kernel on/off; False when this build has none."""
    backend = runner.attn_backend
    if not hasattr(backend, "extend_kernel"):
        return not on
    if on and not getattr(backend, "extend_kernel_available", False):
        return False
    backend.extend_kernel = on
    return True


def _runner_for(rows: list[tuple[int, int]], args: argparse.Namespace,
                shared: int = 0) -> ModelRunner:
    """A runner whose pools hold every (prefix, new) row of the shape."""
    return make_runner(args.threads, shared + sum(p + e - shared for p, e in rows), len(rows),
                       max(p + e for p, e in rows), args.dtype, args.quant_max_rows)


def profile(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for name in args.shapes:
        rows, shared = SHAPES[name], SHARED.get(name, 0)
        runner = _runner_for(rows, args, shared)
        for kernel in ((False, True) if args.both else (args.kernel,)):
            if not set_kernel(runner, kernel):
                continue
            step = ExtendStep(runner, rows, shared)
            step.run()
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                wall = step.run()
            cats: dict[str, float] = defaultdict(float)
            for ev in prof.key_averages():
                # Self CPU time of the ops actually doing the work (children counted once).
                cat = next((c for c, keys in _CATEGORIES.items()
                            if any(k in ev.key for k in keys)), "other")
                cats[cat] += ev.self_cpu_time_total / 1e3
            total = sum(cats.values())
            n_new = sum(e for _, e in rows)
            parts = "  ".join(f"{c} {v:7.1f} ms ({v / total:4.0%})" for c, v in
                              sorted(cats.items(), key=lambda kv: -kv[1]))
            print(f"{name:8s} kernel={int(kernel)} wall {wall * 1e3:7.1f} ms "
                  f"({n_new / wall:5.0f} new tok/s) | {parts}", flush=True)
            if args.table:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        del runner


@contextmanager
def extend_op(op: Any, groups: bool = True) -> Iterator[None]:
    """Steps run `op` as `torch.ops.radixrt.extend_attention` (what `ExtendAttentionPlan.run`
    calls), with the kernel's shared-prefix groups on or off."""
    ns = torch.ops.radixrt
    saved = ns.extend_attention
    previous = ns.extend_attention_groups(groups)
    setattr(ns, "extend_attention", op)  # noqa: B010 - the namespace caches ops as attributes
    try:
        yield
    finally:
        setattr(ns, "extend_attention", saved)  # noqa: B010
        ns.extend_attention_groups(previous)


def steps(args: argparse.Namespace) -> None:
    """Without `--baseline`: the torch path vs the kernel. With it: the kernel built from
    `extend_attention.cpp` at that revision vs this one (groups on and off)."""
    if args.baseline:
        from bench.attention_kernel import load_baseline

        load_baseline(args.baseline, "extend_attention.cpp")
    for name in args.shapes:
        rows, shared = SHAPES[name], SHARED.get(name, 0)
        runner = _runner_for(rows, args, shared)
        step = ExtendStep(runner, rows, shared)
        if args.baseline:
            new = torch.ops.radixrt.extend_attention
            old = torch.ops.radixrt_baseline.extend_attention
            variants = {"baseline": (True, old, True), "kernel": (True, new, True),
                        "groups off": (True, new, False)}
        else:
            variants = {"torch path": (False, None, True), "kernel": (True, None, True)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for label, (kernel, op, groups) in variants.items():
                if not set_kernel(runner, kernel):
                    continue
                with extend_op(op or torch.ops.radixrt.extend_attention, groups):
                    step.run()  # warm-up of this path
                    times[label].append(step.run())
        n_new = sum(e for _, e in rows)
        first = statistics.median(times[next(iter(variants))])
        parts = [f"{label} {med * 1e3:7.1f} ms ({n_new / med:5.0f} tok/s, {med / first:.2f})"
                 for label, med in ((k, statistics.median(v)) for k, v in times.items() if v)]
        print(f"{name:13s} " + "  ".join(parts), flush=True)
        del runner


def fused(args: argparse.Namespace) -> None:
    """The one-call extend step against the Python layer loop (kernel on in both)."""
    for name in args.shapes:
        rows, shared = SHAPES[name], SHARED.get(name, 0)
        runner = _runner_for(rows, args, shared)
        set_kernel(runner, True)
        step = ExtendStep(runner, rows, shared)
        model = runner.model
        times: dict[bool, list[float]] = {True: [], False: []}
        logits = {}
        for _ in range(args.rounds):
            for on in (False, True):
                model.fused_extend = on
                logits[on] = runner.forward(step.fb)  # warm-up of this path
                times[on].append(step.run())
        model.fused_extend = True
        loop, one = statistics.median(times[False]), statistics.median(times[True])
        same = torch.equal(logits[True], logits[False])
        print(f"{name:13s} layer loop {loop * 1e3:7.1f} ms  one call {one * 1e3:7.1f} ms "
              f"({one / loop:.2f})  bitwise {same}", flush=True)
        del runner


def chunks(args: argparse.Namespace) -> None:
    """A prompt's chunk of n new tokens after p cached ones, for each n of `--sizes` and p of
    `--contexts`: seconds per new token, the sizes interleaved in rounds in one process (this
    host's speed drifts by tens of percent over minutes), medians. Says whether a paced step's
    chunk size costs throughput: the pacer cuts long prompts into ~250 ms chunks."""
    sizes, contexts = args.sizes, args.contexts
    runner = make_runner(args.threads, max(contexts) + max(sizes), 1,
                         max(contexts) + max(sizes), args.dtype, args.quant_max_rows)
    set_kernel(runner, True)
    times: dict[tuple[int, int], list[float]] = {(p, n): [] for p in contexts for n in sizes}
    for _ in range(args.rounds):
        for key in times:
            step = ExtendStep(runner, [key])
            step.run()
            times[key].append(min(step.run() for _ in range(2)) / key[1])
    for p in contexts:
        base = statistics.median(times[(p, sizes[-1])])
        parts = [f"{n}: {statistics.median(times[(p, n)]) * 1e3:6.2f} ms/tok "
                 f"({statistics.median(times[(p, n)]) / base:.2f})" for n in sizes]
        print(f"after {p:5d} cached  " + "  ".join(parts), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("profile", "steps", "fused", "chunks"))
    ap.add_argument("--sizes", nargs="+", type=int, default=[64, 128, 256, 512],
                    help="chunks: new tokens per step (the last is the reference)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[0, 1000],
                    help="chunks: cached tokens before the chunk")
    ap.add_argument("--quant-max-rows", type=int, default=None,
                    help="ServerArgs.quant_max_rows (a GGUF model's rows up to which matmuls take "
                         "the quantized kernels)")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernel", action="store_true", help="profile: with the extend kernel")
    ap.add_argument("--both", action="store_true", help="profile: without, then with the kernel")
    ap.add_argument("--table", action="store_true", help="profile: print the op table too")
    ap.add_argument("--baseline", default=None,
                    help="steps: git revision of extend_attention.cpp to compare the kernel "
                         "against (instead of the torch path)")
    args = ap.parse_args()
    {"profile": profile, "steps": steps, "fused": fused, "chunks": chunks}[args.mode](args)


if __name__ == "__main__":
    main()
