"""Where a decode step's time goes, phase by phase, without a profiler's per-op overhead.

    python bench/decode_phases.py --batch-sizes 8 64 --ctx 512 --steps 20
    python bench/decode_phases.py --batch-sizes 4 8 --ctx 4196 --prefix 4096   # cascade decode

This checkout's `decode_layers.cpp` (the one-call decode step) is rebuilt under the op namespace
`radixrt_phases` with a steady-clock lap after each phase of every layer (input norms, qkv
matmul, RoPE + K/V store, paged decode, o matmul, gate_up matmul (with the SiLU-mul where
`amx_linear_silu` runs it), down matmul); the ops it calls
are radixrt's own, so the arithmetic is the step's. The default model, a `ModelRunner` as the
server builds it, `bs` requests over `--ctx` random cached tokens (bench/decode_steps.py). Prints
the median step and, per step, each phase's mean, the layers' sum, and the time outside the
layers (embedding, LM head, logits, argmax, metadata).

torch.profiler's table (bench/vnni_steps.py --profile) adds its own cost to every op call: a
batch-8 step measured 14.6 ms under it against 11.3 ms without. The laps cost ~40 ns each.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import _path

    _path.fix()

import argparse  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

NAMESPACE = "radixrt_phases"
PHASES = ("norms", "qkv", "rope+store", "attention", "o", "gate_up", "down")

# (anchor in decode_layers.cpp's layer loop, lap inserted after it): each anchor must occur once.
_LAPS = (
    ("      std::tie(x, residual) = ops.add_rms_norm.call(h, residual, st.norms[2 * l], "
     "eps);\n    }\n", "LAP(0)"),
    ("    const Tensor qkv = run_linear(ops, x, st.weights, st.meta, lin);\n", "LAP(1)"),
    ("    else ops.kv_store.call(kb, vb, rloc, k, v);\n", "LAP(2)"),
    ("                                    plan.group_rows, st.scale));\n", "LAP(3)"),
    ("    const Tensor attn_out = run_linear(ops, o, st.weights, st.meta, lin + 1);\n", "LAP(4)"),
    ("    std::tie(x, residual) = ops.add_rms_norm.call(attn_out, residual, st.norms[2 * l + 1], "
     "eps);\n", "LAP(0)"),
    ("    const auto [act, activated] = run_gate_up(ops, x, st.weights, st.meta, lin + 2);\n",
     "LAP(5)"),
    ("    h = run_linear(ops, act, st.weights, st.meta, lin + 3, /*silu=*/!activated);\n",
     "LAP(6)"),
)
_PRELUDE = """
#include <chrono>
#include <vector>
namespace {
double g_phase_us[8];
inline double now_us() {
  return std::chrono::duration<double, std::micro>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::vector<double> phase_times(bool reset) {
  std::vector<double> v(g_phase_us, g_phase_us + 8);
  if (reset) for (double& x : g_phase_us) x = 0;
  return v;
}
}  // namespace
#define LAP(i) { const double t1_ = now_us(); g_phase_us[i] += t1_ - t0_; t0_ = t1_; }
"""


def timed_source(src: str) -> str:
    """decode_layers.cpp with the laps (raises if the loop no longer has an anchor)."""
    for anchor, lap in _LAPS:
        if src.count(anchor) != 1:
            raise SystemExit(f"decode_layers.cpp changed: anchor not found once: {anchor!r}")
        src = src.replace(anchor, f"{anchor}    {lap}\n")
    start = "  Tensor h = h0.slice(0, r0, r1), residual;\n"
    if src.count(start) != 1:
        raise SystemExit("decode_layers.cpp changed: no single loop start")
    src = src.replace(start, start + "  double t0_ = now_us();\n")
    first = "#include <torch_headers.h>  // first: precompiled by the build\n"
    if src.count(first) != 1:
        raise SystemExit("decode_layers.cpp changed: no single first include")
    src = src.replace(first, first + _PRELUDE, 1)
    return src + ('\nTORCH_LIBRARY_FRAGMENT(radixrt, m) {\n'
                  '  m.def("phase_times(bool reset) -> float[]", &phase_times);\n}\n')


def build() -> object:
    """The timed op library, loaded; returns its op namespace (every csrc header is copied
    beside it: decode_layers.cpp includes the team's)."""
    from bench.attention_kernel import build_op_sources, checkout_sources

    sources, headers = checkout_sources(("decode_layers.cpp",))
    build_op_sources({"decode_layers.cpp": timed_source(sources["decode_layers.cpp"])},
                     NAMESPACE, headers)
    return getattr(torch.ops, NAMESPACE)


def main() -> None:
    from bench.decode_step_ab import use
    from bench.decode_steps import RandomKVDecoder, add_step_args, bare_runner

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap, [8, 64])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ns = build()
    use(ns.decode_layers)
    runner = bare_runner(a, a.ctx + a.steps + 16)
    # one pass per step: the laps are summed over threads, which micro-batches would mix up
    runner.model.decode_microbatch_rows = 0
    # a region per op: the laps are per thread, a team's threads would interleave them
    runner.model.decode_team = False
    print(f"dtype {runner.dtype}, quant {runner.quant}, KV {runner.token_to_kv_pool.kv_dtype}; "
          f"{a.threads} threads; ctx {a.ctx}" + (f", {a.prefix} shared" if a.prefix else ""))
    for bs in a.batch_sizes:
        d = RandomKVDecoder(runner, bs, a.ctx, prefix=a.prefix).warmed()
        ns.phase_times(True)
        steps = [d.step() for _ in range(a.steps)]
        per = [t / a.steps / 1e3 for t in ns.phase_times(True)][: len(PHASES)]
        layers = sum(per)
        mean = statistics.mean(steps) * 1e3
        print(f"batch {bs:3d}: step {statistics.median(steps) * 1e3:.2f} ms (mean {mean:.2f}); "
              + ", ".join(f"{n} {v:.2f}" for n, v in zip(PHASES, per, strict=True))
              + f"; layers {layers:.2f}, outside {mean - layers:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
