"""Peer: Hugging Face transformers `generate`, one request at a time (no cache reuse).

    .venv-bench/bin/python bench/peers/hf_generate.py --workload-file W.json --out R.jsonl \
        --model SmolLM2.gguf --threads 2

The model is loaded from the same GGUF as radixrt (`from_pretrained(dir, gguf_file=...)`,
dequantized to fp32). Greedy; exactly `max_tokens` new tokens (`min_new_tokens` = `max_new_tokens`,
EOS ignored). Requests are served in arrival order, one after another (`common.run_sequential`);
a streamer stamps every token as it is produced.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import peer_argparser, run_peer  # noqa: E402


class _TimingStreamer:
    """`generate`'s streamer protocol: the first `put` is the prompt, then one per new token."""

    def __init__(self, on_tokens):
        self.on_tokens = on_tokens
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.on_tokens(int(value.numel()))

    def end(self) -> None:
        pass


def load_hf(model: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    p = Path(model)
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return m.eval()


def main() -> None:
    a = peer_argparser(__doc__.split("\n\n")[0]).parse_args()
    import torch

    t = time.perf_counter()
    model = load_hf(a.model, a.threads)
    load_s = time.perf_counter() - t

    def generate(prompt, max_tokens, on_tokens):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None,
                                 streamer=_TimingStreamer(on_tokens), pad_token_id=0)
        return out[0, len(prompt):].tolist(), 0

    run_peer(a, "hf-generate", generate, torch_threads=torch.get_num_threads(), load_s=load_s)


if __name__ == "__main__":
    main()
