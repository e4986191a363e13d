"""The one-call decode step's paths against each other, alternating step by step in one
process on one `ModelRunner` (default SmolLM2): one pass as a team of threads (`team`; its
norms split by rows or whole on each member as its placement probe picks, or always one way:
`team-split`, `team-whole`, `DecodeLayers.team_norms_whole`; `team-micro`: the team's region
as two micro-batches, as it runs far apart, `DecodeLayers.team_far_split`; `team-static`: the
team without its members taking each other's items, `radixrt::decode_team_steal`), one pass with a
parallel region
per op (`regions`, `--disable-decode-team`), two micro-batches (`split`,
`decode_microbatch_rows`).

    python bench/decode_path_ab.py --batch-sizes 8 12 16 --paths team regions split \
        [--kv-cache-dtype int8]

Each round starts `bs` requests over `--ctx` random cached tokens (bench/decode_steps.py) and
runs the paths in turn every step (the order rotating), so all see the same context lengths;
they give bitwise the same logits (tests/test_decode_layers.py). Prints the medians per batch size,
how many of each team path's steps ran as two micro-batches, and, for each path after the first,
the median ratio of its step to the first path's adjacent step (> 1: the first is faster), which
cancels slow drifts of the machine, and where the two threads ran before and after
(`bench/roofline.py` `thread_placement`). Used to choose `decode_microbatch_rows`' default and the
team's, and to measure the team's norms far (in one process: two processes of equivalent code
differed by ~0.1 ms far, stop 34).
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
import subprocess  # noqa: E402

import torch  # noqa: E402

NEVER = 1 << 30  # decode_microbatch_rows no batch reaches: one pass
PATHS = ("team", "team-static", "team-split", "team-whole", "team-micro", "regions", "split")
NORMS_WHOLE = {"team-split": 0, "team-whole": 1}  # else -1: the team's probe picks


def use(model: object, path: str) -> None:
    """Sets the model's decode path (see the module docstring)."""
    model.decode_microbatch_rows = 2 if path == "split" else NEVER  # type: ignore[attr-defined]
    model.decode_path_tuner = None  # type: ignore[attr-defined]  # each path as named
    model.decode_team = path != "regions"  # type: ignore[attr-defined]
    stack = model.decode_layers()  # type: ignore[attr-defined]
    if not isinstance(stack, str):
        stack.team_norms_whole = NORMS_WHOLE.get(path, -1)
        # team-micro: the team's region runs two micro-batches whatever its placement (what it
        # picks far apart, decode_layers.cpp far_split); else as its probe picks
        stack.team_far_split = 1 if path == "team-micro" else -1
        # team-static: each member runs its own share only (no member takes another's items)
        torch.ops.radixrt.decode_team_steal(0 if path == "team-static" else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 10, 12, 14, 16])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16, help="steps per path per round")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as the server's (auto, int8)")
    ap.add_argument("--paths", nargs="+", default=["team", "split"], choices=PATHS,
                    help="paths to alternate; ratios are against the first")
    ap.add_argument("--busy-neighbour", type=int, nargs=2, metavar=("BUSY_US", "IDLE_US"),
                    help="run a process beside the steps that spins BUSY_US, then sleeps "
                         "IDLE_US, in a loop (as a streaming server's HTTP process and a local "
                         "client take a core now and then)")
    a = ap.parse_args()
    neighbour = busy_neighbour(*a.busy_neighbour) if a.busy_neighbour else None
    try:
        run(a)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def busy_neighbour(busy_us: int, idle_us: int) -> subprocess.Popen[bytes]:
    """A process that spins `busy_us`, then sleeps `idle_us`, until killed."""
    code = ("import time\n"
            f"busy, idle = {busy_us / 1e6!r}, {idle_us / 1e6!r}\n"
            "while True:\n"
            "    t = time.perf_counter()\n"
            "    while time.perf_counter() - t < busy:\n"
            "        pass\n"
            "    time.sleep(idle)\n")
    return subprocess.Popen([sys.executable, "-c", code])


def run(a: argparse.Namespace) -> None:
    torch.set_num_threads(2)  # micro-batches need exactly 2 threads
    from bench.decode_steps import RandomKVDecoder
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    paths = list(dict.fromkeys(a.paths))
    # a round: one warm-up step per path, then every path every step
    bs_max, ctx_max = max(a.batch_sizes), a.ctx + len(paths) * (a.steps + 1) + 8
    runner = ModelRunner(ServerArgs(max_running_requests=bs_max,
                                    max_total_tokens=bs_max * ctx_max + 64,
                                    max_context_len=ctx_max, log_level="warning", num_threads=2,
                                    kv_cache_dtype=a.kv_cache_dtype))
    model = runner.model
    print(f"decode path: {model.decode_path()}; KV {a.kv_cache_dtype}; ctx {a.ctx}", flush=True)
    from bench.roofline import thread_placement

    for bs in a.batch_sizes:
        where = [thread_placement()["placement"]]
        times: dict[str, list[float]] = {p: [] for p in paths}
        ratios: dict[str, list[float]] = {p: [] for p in paths[1:]}
        micro = dict.fromkeys(paths, 0)  # timed steps a team ran as two micro-batches
        for _ in range(a.rounds):
            d = RandomKVDecoder(runner, bs, a.ctx)
            for path in paths:  # warm-up
                use(model, path)
                d.step()
            for i in range(a.steps):
                step = {}
                k = i % len(paths)
                for path in paths[k:] + paths[:k]:
                    use(model, path)
                    before = torch.ops.radixrt.decode_team_microbatch_steps()
                    step[path] = d.step()
                    micro[path] += torch.ops.radixrt.decode_team_microbatch_steps() - before
                    times[path].append(step[path])
                for path in paths[1:]:
                    ratios[path].append(step[path] / step[paths[0]])
        med = "  ".join(f"{p} {statistics.median(times[p]) * 1e3:6.2f} ms" for p in paths)
        rel = "  ".join(f"{p}/{paths[0]} {statistics.median(ratios[p]):.3f}x"
                        for p in paths[1:])
        where.append(thread_placement()["placement"])
        split = ", ".join(f"{p} {micro[p]}" for p in paths if p.startswith("team"))
        print(f"batch {bs:3d}: {med}  paired {rel}  [threads on "
              f"{' -> '.join(dict.fromkeys(where))}; team steps as micro-batches: {split}]",
              flush=True)


if __name__ == "__main__":
    main()
