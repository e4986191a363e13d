"""How long each member of a decode team waits at the team's barriers, phase by phase.

    python bench/team_waits.py --batch-sizes 1 8 --ctx 512 --steps 20 --rounds 3

The one-call decode step's team (radixrt/attention/csrc/team.h) splits every op among its
threads by a fixed rule and meets at a spin barrier after most of them; in the matmuls and the
attention a member that has run its share takes the others' last items (`--team-static`: not).
A member waits at a barrier for work split unevenly (3 KV heads of one row on 2 threads), for a
slower core (another tenant on it, a far cache), for an item the other member is still running,
or for the barrier's own round trip; the wait of an owner for items taken from it counts to the
phase too.

The kernel sources are rebuilt under the op namespace `radixrt_waits` with `RADIXRT_TEAM_WAITS=1`
(every op the step calls too, so that all of its barriers are timed); the layer loop names the
phase each op runs in, and every barrier adds its wait to the calling member's entry of that
phase. A barrier inside an op counts to the op's phase; where the attention keeps each member's
rows (decode_layers.cpp `attention_keeps_rows`) it ends without one, and waiting for the other
member's attention shows in the o projection's. The default model, a `ModelRunner` as the server
builds it, `bs` requests over `--ctx` random cached tokens (bench/decode_steps.py); steps of 12
rows or more run as two micro-batches by default (no team, no barriers):
`--decode-microbatch-rows 0` keeps them in the team.
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

NAMESPACE = "radixrt_waits"
# RADIXRT_TEAM_PHASE(k) in decode_layers.cpp's layer loop; kWaitMembers / kWaitPhases in team.h
PHASES = ("outside", "norm", "qkv", "rope", "kv_store", "attention", "o", "norm 2", "gate_up",
          "down")
MEMBERS, PHASE_SLOTS = 4, 16
# the sources of every op the one-call decode step calls, and the step itself
SOURCES = ("fused_ops.cpp", "qgemv.cpp", "qgemm_vnni.cpp", "paged_decode.cpp",
           "extend_attention.cpp", "amx_linear.cpp", "decode_layers.cpp")


def build() -> object:
    """The timed library, loaded; returns its op namespace. The step's op lookups
    (`"radixrt::..."` schemas) are renamed too, so it calls this library's ops."""
    from bench.attention_kernel import build_op_sources, checkout_sources

    texts, headers = checkout_sources(tuple(SOURCES))
    sources = {s: t.replace('"radixrt::', f'"{NAMESPACE}::') for s, t in texts.items()}
    build_op_sources(sources, NAMESPACE, headers, ("RADIXRT_TEAM_WAITS=1",))
    return getattr(torch.ops, NAMESPACE)


def per_step(raw: list[int], steps: int) -> tuple[list[list[float]], list[list[float]]]:
    """team_waits' flat [2, members, phases] counters as (wait us, barriers) per step."""
    n = MEMBERS * PHASE_SLOTS
    us = [[raw[m * PHASE_SLOTS + p] / 1e3 / steps for p in range(len(PHASES))]
          for m in range(MEMBERS)]
    count = [[raw[n + m * PHASE_SLOTS + p] / steps for p in range(len(PHASES))]
             for m in range(MEMBERS)]
    return us, count


def main() -> None:
    from bench.decode_step_ab import use
    from bench.decode_steps import RandomKVDecoder, add_step_args, bare_runner
    from bench.roofline import thread_placement

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap, [1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-microbatch-rows", type=int, default=None,
                    help="ServerArgs.decode_microbatch_rows (default: the server's)")
    ap.add_argument("--team-static", action="store_true",
                    help="each member runs only its own share of every op's items "
                         "(ServerArgs.disable_team_steal)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ns = build()
    use(ns.decode_layers)
    ns.decode_team_steal(0 if a.team_static else 1)
    extra = ({} if a.decode_microbatch_rows is None
             else {"decode_microbatch_rows": a.decode_microbatch_rows})
    runner = bare_runner(a, a.ctx + a.rounds * (a.steps + 3) + 16, **extra)
    print(f"{runner.model.decode_path()}; dtype {runner.dtype}, KV "
          f"{runner.token_to_kv_pool.kv_dtype}; {a.threads} threads; ctx {a.ctx}")
    for bs in a.batch_sizes:
        d = RandomKVDecoder(runner, bs, a.ctx, prefix=a.prefix).warmed()
        for rnd in range(a.rounds):
            place = thread_placement()
            ns.team_waits(True)
            steps = [d.step() for _ in range(a.steps)]
            us, count = per_step(ns.team_waits(True), a.steps)
            step = statistics.median(steps) * 1e3
            members = [m for m in range(MEMBERS) if sum(count[m]) > 0]
            head = (f"batch {bs:3d} round {rnd + 1}: step {step:.2f} ms "
                    f"[{place['placement']}, compute scaling {place['compute_scaling']}]")
            if not members:
                print(head + "; no team barriers (one thread, or micro-batches)", flush=True)
                continue
            print(head + "; waits per step: " + ", ".join(
                f"member {m} {sum(us[m]):.0f} us ({sum(us[m]) / 1e3 / step:.0%} of the step, "
                f"{sum(count[m]):.0f} barriers)" for m in members), flush=True)
            for m in members:
                print(f"    member {m}: " + ", ".join(
                    f"{name} {us[m][p]:.0f}" for p, name in enumerate(PHASES)
                    if count[m][p] > 0) + " us", flush=True)


if __name__ == "__main__":
    main()
