"""Peer: llama.cpp through llama-cpp-python, requests one after another with its prompt cache.

    .venv-bench/bin/python bench/peers/llama_cpp_peer.py --workload-file W.json --out R.jsonl \
        --model SmolLM2.gguf --threads 2

`Llama(model_path=gguf, n_threads=T, n_threads_batch=T, n_ctx=...)` runs the GGUF natively
(Q4_1 weights). `Llama.generate(tokens)` keeps the KV of the previous prompt + output and
evaluates only what follows the longest common prefix with it, so consecutive requests sharing a
prefix reuse it; `cached_tokens` is that common prefix (read from the model's token buffer before
each request). Greedy (`temp=0`), exactly `max_tokens` tokens (the loop stops there, EOS is not
checked). Requests are served in arrival order (`common.run_sequential`). Between workloads
`llm.reset()` drops the cache.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import common_prefix, peer_argparser, run_peer  # noqa: E402


def main() -> None:
    ap = peer_argparser(__doc__.split("\n\n")[0])
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-batch", type=int, default=512)
    a = ap.parse_args()
    import llama_cpp

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=a.model, n_threads=a.threads, n_threads_batch=a.threads,
                          n_ctx=a.n_ctx, n_batch=a.n_batch, verbose=False)
    load_s = time.perf_counter() - t

    def generate(prompt, max_tokens, on_tokens):
        held = list(llm._input_ids[: llm.n_tokens])
        cached = min(common_prefix(held, prompt), len(prompt) - 1)
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            on_tokens(1)
            if len(out) >= max_tokens:
                break
        return out, cached

    run_peer(a, "llama.cpp", generate, llm.reset, load_s=load_s,
             llama_cpp_python=llama_cpp.__version__)


if __name__ == "__main__":
    main()
