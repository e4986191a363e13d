"""Constrained decoding overhead per decode step, next to the step itself (SmolLM2, CPU).

For each batch size B, every row constrained by one of bench/grammar_backends.py's JSON
schemas (walking a valid instance, rows at different offsets):
  mask  = `LLGuidanceBackend.fill_bitmasks` for the B rows (what the scheduler does per step);
  apply = `Sampler.sample` with the masks minus without them, on the step's [B, vocab]
          logits (greedy and temperature-1 rows, each measured);
  step  = a decode step of the model at B (forward + unconstrained sampling), interleaved with
          the two above step by step, so a shared machine's load hits both alike.
Also the compile time per schema (backend, cold) and the frontend's tokenizer-free check.

    PYTHONPATH=. python bench/grammar_overhead.py --batch-size 8 64 [--input-len 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.common import cpu_name
from bench.grammar_backends import INSTANCES, SCHEMAS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from radixrt.core.sampling_params import SamplingParams
    from radixrt.grammar import LLGuidanceBackend, check_grammar
    from radixrt.model.loader import default_model_path
    from radixrt.model.tokenizer import load_tokenizer
    from radixrt.sampling.batch_info import SamplingBatchInfo
    from radixrt.sampling.sampler import Sampler

    tok = load_tokenizer(default_model_path())
    vocab = len(tok)
    t = time.perf_counter()
    backend = LLGuidanceBackend(tok, vocab, [tok.eos_token_id])
    setup_s = time.perf_counter() - t
    print(f"CPU: {cpu_name()}, torch threads {args.threads}; vocab {vocab}; "
          f"backend set-up (tokenizer conversion) {setup_s:.2f} s")

    print("\n| schema | frontend check ms | compile ms (cold) |\n|---|---|---|")
    compiled = {}
    for name, schema in SCHEMAS.items():
        src = json.dumps(schema)
        t = time.perf_counter()
        check_grammar("json_schema", src)
        t1 = time.perf_counter()
        compiled[name] = backend.compile("json_schema", src)
        t2 = time.perf_counter()
        print(f"| {name} | {(t1 - t) * 1e3:.1f} | {(t2 - t1) * 1e3:.1f} |")

    walks = {n: tok.encode(json.dumps(INSTANCES[n], separators=(",", ":")),
                           add_special_tokens=False) for n in SCHEMAS}
    names = list(SCHEMAS)
    sampler = Sampler()
    steps = DecodeSteps(args.threads, max(args.batch_size), args.input_len, args.steps + 2)

    print("\n| B | temperature | mask build ms | mask apply ms | total ms | decode step ms "
          "| overhead (median of per-step ratios) |\n|---|---|---|---|---|---|---|")
    for bs in args.batch_size:
        rows = []
        for i in range(bs):
            n = names[i % len(names)]
            m = backend.matcher(compiled[n])
            start = (i * 3) % (len(walks[n]) - 1)
            for t_id in walks[n][:start]:
                assert m.accept_token(t_id)
            rows.append([m, n, start])
        steps.start(bs)
        for temp in (0.0, 1.0):
            params = [SamplingParams(temperature=temp) for _ in range(bs)]
            build, apply, step, ratio = [], [], [], []
            for _ in range(args.steps):
                fwd_s, logits = steps.step()  # the model's step, interleaved with ours
                bitmask = backend.new_bitmask(bs)
                t = time.perf_counter()
                backend.fill_bitmasks([r[0] for r in rows], bitmask)
                build.append(time.perf_counter() - t)
                pair = []
                for mask in ((list(range(bs)), bitmask), None):
                    t = time.perf_counter()
                    info = SamplingBatchInfo.build(params, [[1]] * bs, [[]] * bs, vocab, "cpu",
                                                   (tok.eos_token_id,), mask)
                    sampler.sample(logits, info)
                    pair.append(time.perf_counter() - t)
                apply.append(pair[0] - pair[1])
                step.append(fwd_s + pair[1])  # forward + unconstrained sampling
                ratio.append((build[-1] + apply[-1]) / step[-1])
                for r in rows:  # advance every row along its walk (restart at the end)
                    m, n, pos = r
                    if pos >= len(walks[n]):
                        m, pos = backend.matcher(compiled[n]), 0
                    assert m.accept_token(walks[n][pos])
                    r[:] = [m, n, pos + 1]
            b, a = statistics.median(build) * 1e3, statistics.median(apply) * 1e3
            st = statistics.median(step) * 1e3
            print(f"| {bs} | {temp} | {b:.2f} | {a:.2f} | {b + a:.2f} | {st:.1f} | "
                  f"{statistics.median(ratio) * 100:.1f}% |")


class DecodeSteps:
    """SmolLM2 decode steps at batch B over random prompts (bench/offline.py's one-batch
    recipe: a ModelRunner driven directly with its pools)."""

    def __init__(self, threads: int, max_bs: int, input_len: int, steps: int):
        from radixrt.config import ServerArgs
        from radixrt.model.runner import ModelRunner

        self.input_len, self.ctx = input_len, input_len + 2 * steps + 8
        args = ServerArgs(num_threads=threads, max_running_requests=max_bs,
                          max_total_tokens=max_bs * self.ctx + 64, max_context_len=self.ctx,
                          attention_backend="torch", dtype="float32", log_level="warning")
        self.runner = ModelRunner(args)
        self.gen = torch.Generator().manual_seed(0)

    def start(self, bs: int) -> None:
        from radixrt.core.forward_batch import ForwardBatch, ForwardMode

        r = self.runner
        rp, kp = r.req_to_token_pool, r.token_to_kv_pool
        rp.clear()
        kp.clear()
        self.rows = [rp.alloc() for _ in range(bs)]
        n = self.input_len
        ids = torch.randint(100, r.model_config.vocab_size, (bs * n,), generator=self.gen)
        rp.write(self.rows, [0] * bs, [n] * bs, kp.alloc(bs * n))
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids.tolist(), self.rows, [0] * bs,
                                [n] * bs, rp.req_to_token, r.device)
        self.next = r.forward(fb).argmax(-1).tolist()
        self.seq = n

    def step(self) -> tuple[float, torch.Tensor]:
        """(seconds, logits) of one decode step of every row."""
        from radixrt.core.forward_batch import ForwardBatch, ForwardMode

        r = self.runner
        rp, kp = r.req_to_token_pool, r.token_to_kv_pool
        bs = len(self.rows)
        t = time.perf_counter()
        rp.write(self.rows, [self.seq] * bs, [1] * bs, kp.alloc(bs))
        fb = ForwardBatch.build(ForwardMode.DECODE, self.next, self.rows, [self.seq] * bs,
                                [1] * bs, rp.req_to_token, r.device)
        logits = r.forward(fb)
        dt = time.perf_counter() - t
        self.next = logits.argmax(-1).tolist()
        self.seq += 1
        return dt, logits


if __name__ == "__main__":
    main()
