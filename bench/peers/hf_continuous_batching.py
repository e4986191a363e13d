"""Peer: Hugging Face transformers continuous batching (paged attention, block sharing on).

    .venv-bench/bin/python bench/peers/hf_continuous_batching.py --workload-file W.json \
        --out R.jsonl --model SmolLM2.gguf --threads 2 [--page-size 256 --max-batch-tokens 1024]

The same engine as `model.generate_batch(...)`, driven through its manager
(`model.continuous_batching_context_manager` → `add_request` / `get_result`) so that requests can
arrive over time and a chain's next turn is added when the previous one finished. Greedy, EOS
disabled (`eos_token_id=-1`) so every request generates exactly `max_tokens`; per-token
timestamps from `record_timestamps=True` (time.perf_counter, the clock the driver uses).
Not run under `torch.inference_mode()` (the manager fails inside it). Defaults: page size 256 and
1024 batch tokens, the fastest setting measured on this machine (shared/FACTS.md); block sharing
reuses only whole pages. The cache hit count is not exposed, so `cached_tokens` is not reported.
"""

from __future__ import annotations

import heapq
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (  # noqa: E402
    RequestRecord,
    iter_workloads,
    peer_argparser,
    progress_bar,
    warmup_prompt,
    write_result,
)
from bench.peers.hf_generate import load_hf  # noqa: E402


def run_workload(model, w, cb_kwargs, budget_s, bar):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    max_out = max(t.max_tokens for s in w.sessions for t in s.turns)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_out, eos_token_id=-1,
                               pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=_max_prompt_len(w), max_generated_length=max_out,
                          num_requests=w.num_requests)
    records: list[RequestRecord] = []
    by_id = {s.id: s for s in w.sessions}
    with model.continuous_batching_context_manager(
            generation_config=gen_cfg,
            continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            block=True, timeout=30, workload_hints=hints) as manager:
        t0 = time.perf_counter()
        now = lambda: time.perf_counter() - t0  # noqa: E731
        heap = [(s.arrival, s.id, 0) for s in w.sessions]
        heapq.heapify(heap)
        live: dict[str, tuple[RequestRecord, list[int]]] = {}
        stopped = False
        while heap or live:
            while heap and heap[0][0] <= now() and not stopped:
                if budget_s is not None and now() > budget_s:
                    stopped = True
                    break
                _, sid, k = heapq.heappop(heap)
                s = by_id[sid]
                prompt = s.turns[k].append if k == 0 else None
                if k:
                    prev = next(r for r in records if r.session == sid and r.turn == k - 1)
                    prompt = prev._prompt + prev.output_ids + s.turns[k].append
                rec = RequestRecord(sid, k, len(prompt), s.turns[k].max_tokens, now())
                rec._prompt = prompt
                rid = f"s{sid}t{k}"
                manager.add_request(prompt, request_id=rid, max_new_tokens=rec.max_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                live[rid] = (rec, prompt)
            if stopped and not live:
                break
            wait = 0.05 if not heap or stopped else max(0.0, min(0.05, heap[0][0] - now()))
            res = manager.get_result(timeout=wait) if live else time.sleep(wait)
            if res is None:
                if live and not manager.is_running():
                    for rec, _ in live.values():
                        rec.error = "continuous batching thread died"
                        records.append(rec)
                    break
                continue
            if not res.is_finished() or res.request_id not in live:
                continue
            rec, _ = live.pop(res.request_id)
            if res.error:
                rec.error = str(res.error)
            for ts in res.timestamps or []:
                rec.add_chunk(ts - t0, 1)
            rec.output_ids = list(res.generated_tokens)
            if rec.output_len != len(rec.output_ids):  # timestamps missing: stamp at the end
                rec.chunks, rec.output_len = [], 0
                rec.add_chunk(now(), len(rec.output_ids))
            rec.end = now()
            records.append(rec)
            bar.update(1)
            s = by_id[rec.session]
            if rec.ok and rec.turn + 1 < len(s.turns):
                heapq.heappush(heap, (rec.end, rec.session, rec.turn + 1))
    note = ""
    if len(records) < w.num_requests:
        note = (f"stopped after the {budget_s:.0f} s budget: {len(records)} of "
                f"{w.num_requests} requests served" if stopped
                else f"{len(records)} of {w.num_requests} requests finished")
    for r in records:
        r.__dict__.pop("_prompt", None)
    records.sort(key=lambda r: (r.session, r.turn))
    return records, note


def _max_prompt_len(w) -> int:
    best = 0
    for s in w.sessions:
        n = 0
        for t in s.turns:
            n += len(t.append) + (t.max_tokens if n else 0)
            best = max(best, n)
    return best


def main() -> None:
    ap = peer_argparser(__doc__.split("\n\n")[0])
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    a = ap.parse_args()
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t = time.perf_counter()
    model = load_hf(a.model, a.threads)
    load_s = time.perf_counter() - t
    cb = dict(page_size=a.page_size, max_batch_tokens=a.max_batch_tokens,
              allow_block_sharing=True)
    from bench.common import Session, Turn, Workload

    warm = Workload("warmup", 0, {}, [Session(0, 0.0, [Turn(warmup_prompt(), 4)])])
    run_workload(model, warm, cb, None, progress_bar(1, "warmup", False))
    for w in iter_workloads(a.workload_file):
        bar = progress_bar(w.num_requests, f"hf-cb {w.name}", a.progress)
        records, note = run_workload(model, w, cb, a.budget_s, bar)
        bar.close()
        write_result(a.out, w.name, "hf-continuous-batching", records, note=note,
                     threads=a.threads, torch_threads=torch.get_num_threads(), load_s=load_s,
                     config=cb)


if __name__ == "__main__":
    main()
