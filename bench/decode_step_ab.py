"""Whole decode steps of this checkout's one-call decode op against another git revision's, in
one process, step by step alternating (the machine is shared: separate processes differed more
between runs than the change being measured).

    python bench/decode_step_ab.py --rev da3ea05 --batch-sizes 1 8 64

The revision's `decode_layers.cpp`, `qgemm_vnni.cpp` and `fused_ops.cpp` (the ops a change to
the step's matmuls and element-wise ops touches) are built into one library under the op
namespace `radixrt_baseline`, its `decode_layers` calling those; the ops of other files
(`paged_decode`, `qgemv`) come from the current library in both. The default model, a
`ModelRunner` as the server builds it, `bs` requests over `--ctx` random cached tokens
(bench/decode_steps.py); each round starts fresh and alternates old / new every step (in ABBA
order), so both see the same context lengths. A step counts only if this process had both cores (CPU time >=
1.85 x wall at 2 threads). Before timing, one step's logits are compared: the two ops must
agree bitwise. Prints medians per batch size, old / new of the medians, and the median of the
old / new ratios of adjacent step pairs (both kept), which cancels slow drifts of the machine.
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
import time  # noqa: E402

import torch  # noqa: E402

from radixrt.model.decode_layers import DecodeLayers  # noqa: E402

NAMESPACE = "radixrt_baseline"
SOURCES = ("decode_layers.cpp", "qgemm_vnni.cpp", "fused_ops.cpp")
# Ops decode_layers.cpp looks up that the rebuilt files register (the rest stay radixrt's).
REBUILT_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rope_qk", "kv_store", "qgemm_vnni",
               "qgemm_vnni_silu")


def build_rev(rev: str) -> None:
    """The revision's SOURCES as one library under NAMESPACE (bench/attention_kernel.py)."""
    from bench.attention_kernel import build_op_sources, revision_sources

    sources, headers = revision_sources(rev, SOURCES)
    src = sources["decode_layers.cpp"]
    for op in REBUILT_OPS:
        src = src.replace(f'"radixrt::{op}"', f'"{NAMESPACE}::{op}"')
    sources["decode_layers.cpp"] = src
    build_op_sources(sources, NAMESPACE, headers)


def use(op: object) -> None:
    """Make `DecodeLayers.run_step` call `op` (same arguments as radixrt::decode_layers) for the
    layers, the step's ends (embedding, RoPE rows, final norm) done in Python on both sides
    (older revisions have no decode_step): the two differ only in the layers op."""

    def run(self: DecodeLayers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            loc: torch.Tensor, plan: object, k_buffers: list[torch.Tensor],
            v_buffers: list[torch.Tensor], k_scales: list[torch.Tensor] | None = None,
            v_scales: list[torch.Tensor] | None = None, split: int = 0, team: bool = False,
            far_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        p = plan
        schema = str(op.default._schema)  # type: ignore[attr-defined]
        # revisions before the int8 KV cache have no scale lists in the op's schema, those
        # before the micro-batches no split (they run the step as one batch), those before
        # the team no team (a region per op)
        scales = [k_scales or [], v_scales or []] if "k_scales" in schema else []
        tail = [split] if "int split" in schema else []
        if "bool team" in schema:
            tail += [team, self.team_norms_whole]
        if "far_split" in schema:
            tail += [self.team_far_split if far_split is None else far_split]
        return op(h, cos.squeeze(1), sin.squeeze(1), self.norms, self.weights,  # type: ignore
                  self.meta, k_buffers, v_buffers, *scales, loc, p.kv_indices,  # type: ignore
                  p.row_start,  # type: ignore
                  p.row_len, p.group_start, p.group_len, p.group_row_ptr,  # type: ignore
                  p.group_rows, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
                  self.scale, *tail)

    def run_step(self: DecodeLayers, ids: torch.Tensor, positions: torch.Tensor,
                 embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 final_norm: torch.Tensor, final_eps: float, *rest: object,
                 **kw: object) -> torch.Tensor:
        h = torch.nn.functional.embedding(ids, embed)
        cos = torch.index_select(cos_table, 0, positions).unsqueeze(1)
        sin = torch.index_select(sin_table, 0, positions).unsqueeze(1)
        out, res = run(self, h, cos, sin, *rest, **kw)  # type: ignore[arg-type]
        return torch.ops.radixrt.add_rms_norm(out, res, final_norm, final_eps)[0]

    DecodeLayers.run_step = run_step  # type: ignore[method-assign]


def same_logits(runner: object, decoder: object, ops: dict[str, object]) -> bool:
    """One decode step's logits through each op (the step's K/V written twice, identically)."""
    from radixrt.core.forward_batch import ForwardBatch, ForwardMode

    d = decoder
    rp, kp, bs = d.runner.req_to_token_pool, d.runner.token_to_kv_pool, d.bs  # type: ignore
    rp.write(d.rows, [d.seq] * bs, [1] * bs, kp.alloc(bs))  # type: ignore
    fb = ForwardBatch.build(ForwardMode.DECODE, d.nxt, d.rows, [d.seq] * bs,  # type: ignore
                            [1] * bs, rp.req_to_token, d.runner.device)  # type: ignore
    out = []
    for op in ops.values():
        use(op)
        out.append(d.runner.forward(fb))  # type: ignore
    d.seq += 1  # type: ignore
    return all(torch.equal(out[0], o) for o in out[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="git revision of the old kernels")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="steps per op per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", help="as the server's (auto, int8)")
    ap.add_argument("--control", action="store_true",
                    help="A/A control: the old op on both sides (shows the method's own bias)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from bench.decode_steps import RandomKVDecoder
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    bs_max = max(a.batch_sizes)
    ctx_max = a.ctx + 2 * a.steps + 8
    runner = ModelRunner(ServerArgs(max_running_requests=bs_max,
                                    max_total_tokens=bs_max * ctx_max + 64,
                                    max_context_len=ctx_max, log_level="warning",
                                    num_threads=a.threads))
    build_rev(a.rev)
    ops = {"old": getattr(torch.ops, NAMESPACE).decode_layers,
           "new": torch.ops.radixrt.decode_layers}
    if a.control:
        ops["new"] = ops["old"]
    real_run_step = DecodeLayers.run_step
    print(f"old = {a.rev}, new = working tree; dtype {runner.dtype}, quant {runner.quant}; "
          f"{a.threads} threads; ctx {a.ctx}; KV {a.kv_cache_dtype}", flush=True)
    try:
        for bs in a.batch_sizes:
            times: dict[str, list[float]] = {t: [] for t in ops}
            pairs: list[float] = []
            for r in range(a.rounds):
                d = RandomKVDecoder(runner, bs, a.ctx)
                if r == 0 and not same_logits(runner, d, ops):
                    raise SystemExit(f"batch {bs}: the two ops' logits differ")
                for t in ops:  # warm-up
                    use(ops[t])
                    d.step()
                for i in range(a.steps):
                    pair = {}
                    order = list(ops) if i % 2 == 0 else list(ops)[::-1]  # ABBA: no order bias
                    for t in order:
                        op = ops[t]
                        use(op)
                        c0, w0 = time.process_time(), time.perf_counter()
                        dt = d.step()
                        if (time.process_time() - c0) / (time.perf_counter() - w0) >= (
                                0.925 * a.threads):
                            times[t].append(dt)
                            pair[t] = dt
                    if len(pair) == len(ops):
                        pairs.append(pair["old"] / pair["new"])
            med = {t: statistics.median(v) * 1e3 if v else float("nan")
                   for t, v in times.items()}
            kept = " ".join(f"{t} {len(v)}" for t, v in times.items())
            print(f"batch {bs:3d}: " + "  ".join(f"{t} {med[t]:7.2f} ms" for t in ops)
                  + f"  old/new {med['old'] / med['new']:.3f}x, paired "
                  f"{statistics.median(pairs) if pairs else float('nan'):.3f}x  (steps kept: {kept} of "
                  f"{a.rounds * a.steps} each; logits bitwise equal)", flush=True)
    finally:
        DecodeLayers.run_step = real_run_step  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
