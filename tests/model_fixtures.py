"""Shared test helpers: tiny random HF checkpoints and a harness driving a model through the pools.

Import from tests with `from model_fixtures import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.loader import load_model
from radixrt.model.model_config import ModelConfig
from radixrt.model.quant import QuantPlan

TINY_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


def make_tiny_checkpoint(
    path: Path,
    kind: str = "llama",
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """Save a random-weight HF model (`kind` = llama | qwen2 | mistral) to `path`; return it (fp32, eval)."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    kwargs = {**TINY_DIMS, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    cfg = cls[0](**kwargs)
    torch.manual_seed(seed)
    model = cls[1](cfg).to(torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(hf_model: Any, path: Path, arch: str, matrix_qtype: str | None = None,
                    embd_qtype: str | None = None) -> Path:
    """Write `hf_model` as a GGUF file the way llama.cpp's converter lays it out: fp32, or with
    every 2-D block weight in `matrix_qtype` and `token_embd` / `output` in `embd_qtype`
    (GGML type names such as "Q4_1", "Q8_0"; quantized with `gguf.quants.quantize`).

    For `arch == "llama"` the q/k rows get llama.cpp's RoPE permutation (which loaders undo).
    """
    import gguf
    import numpy as np

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)

    def permute(x: Any, n_head: int) -> Any:  # llama.cpp convert_hf_to_gguf's `permute`
        return (
            x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
            .swapaxes(1, 2)
            .reshape(x.shape)
        )

    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    tied = bool(getattr(c, "tie_word_embeddings", False))
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        if name in top:
            gname = top[name]
        else:
            parts = name.split(".")  # model.layers.N.<module...>.<weight|bias>
            gname = f"blk.{parts[2]}.{_GGUF_BLOCK_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        arr = t.float().numpy()
        if arch == "llama" and ".attn_q." in gname:
            arr = permute(arr, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            arr = permute(arr, c.num_key_value_heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        qtype = (embd_qtype if gname in ("token_embd.weight", "output.weight") else
                 matrix_qtype if arr.ndim == 2 else None)
        if qtype is None:
            w.add_tensor(gname, arr)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# The one-call steps' parity cases (test_decode_layers, test_extend_step): architecture, dtype
# and the quantized kernel (None: dense weights; Qwen2 has biases).
ONE_CALL_CASES: dict[str, tuple[str, torch.dtype, str | None]] = {
    "qwen2-fp32-dense": ("qwen2", torch.float32, None),
    "qwen2-bf16-dense": ("qwen2", torch.bfloat16, None),
    "llama-bf16-gguf": ("llama", torch.bfloat16, "radixrt"),
    "llama-bf16-gguf-vnni": ("llama", torch.bfloat16, "vnni"),
}


def one_call_case_model(tmp_path: Path, case: str
                        ) -> tuple[Path, torch.dtype, QuantPlan | None]:
    """A 3-layer tiny model of ONE_CALL_CASES[case] (tied embeddings, seed 7): (path, dtype,
    quant plan). GGUF cases: Q4_1 layers and a Q8_0 head on the case's kernel, the dense copy
    above 2 rows (4-bit) / 8 rows (8-bit); skips where the kernel cannot run here."""
    from radixrt.model.quant_matmul import resolve_quant_kernel, vnni_kernel_available

    kind, dtype, quant = ONE_CALL_CASES[case]
    hf = make_tiny_checkpoint(tmp_path / "hf", kind, seed=7, num_hidden_layers=3,
                              tie_word_embeddings=True)
    if quant is None:
        return tmp_path / "hf", dtype, None
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", kind, "Q4_1", "Q8_0")
    if resolve_quant_kernel("auto") != "radixrt":
        pytest.skip("radixrt's qgemv kernel unavailable")
    if quant == "vnni" and not vnni_kernel_available():
        pytest.skip("no AVX512-VNNI here")
    return path, dtype, QuantPlan("gguf", max_rows_int4=2, max_rows_int8=8, kernel=quant)


def make_tiny_runner(path: Path, layers: int = 1, **server_args: Any) -> Any:
    """A `ModelRunner` (fp32, 256 KV slots, 4 rows) on a random tiny Llama saved to `path`,
    with `server_args` laid over those `ServerArgs`."""
    from radixrt.config import ServerArgs
    from radixrt.model.runner import ModelRunner

    make_tiny_checkpoint(path, "llama", seed=1, num_hidden_layers=layers)
    args = {"max_total_tokens": 256, "max_running_requests": 4, "dtype": "float32",
            **server_args}
    return ModelRunner(ServerArgs(model_path=str(path), **args))


def hf_logits(hf_model: Any, ids: Sequence[int]) -> torch.Tensor:
    """HF's full-sequence fp32 logits `[len(ids), vocab]`."""
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    return out.logits[0].float()


@dataclass
class PagedRunner:
    """Drives a model step by step with real pools: `extend` and `decode` return per-request logits.

    Each request is identified by the row `new_request()` returns; the runner remembers how many of
    its tokens are in the KV cache.
    """

    model: LlamaForCausalLM
    req_pool: ReqToTokenPool
    kv_pool: TokenToKVPool
    cached: dict[int, int] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        model_path: str | Path,
        kv_size: int = 4096,
        max_reqs: int = 64,
        max_context: int = 512,
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
    ) -> PagedRunner:
        config = ModelConfig.from_path(model_path)
        model, _ = load_model(model_path, None, dtype, "cpu", model_config=config)
        return cls.for_model(model, kv_size, max_reqs, max_context, kv_dtype)

    @classmethod
    def for_model(
        cls,
        model: LlamaForCausalLM,
        kv_size: int = 4096,
        max_reqs: int = 64,
        max_context: int = 512,
        kv_dtype: torch.dtype | None = None,
    ) -> PagedRunner:
        """`kv_dtype`: what the pool stores (torch.int8: the int8 KV cache)."""
        c = model.config
        kv = TokenToKVPool(kv_size, c.num_layers, c.num_kv_heads, c.head_dim, dtype=model.dtype,
                           kv_dtype=kv_dtype)
        model.attn_backend = TorchNativeBackend(kv)
        return cls(model, ReqToTokenPool(max_reqs, max_context), kv)

    def new_request(self) -> int:
        row = self.req_pool.alloc()
        assert row is not None
        self.cached[row] = 0
        return row

    def _run(
        self,
        mode: ForwardMode,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        all_positions: bool = False,
        row_per_token: bool = False,
        decode_rows_from: int | None = None,
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """A step's logits and its batch. `row_per_token` (decode): each token of a chunk gets
        a decode row of its own."""
        ext = [len(c) for c in chunks]
        loc = self.kv_pool.alloc(sum(ext))
        assert loc is not None
        ids = [t for c in chunks for t in c]
        prefix = [self.cached[r] for r in rows]
        self.req_pool.write(list(rows), prefix, ext, loc)
        batch_rows, batch_prefix, batch_ext = list(rows), prefix, ext
        if row_per_token:
            batch_rows = [r for r, e in zip(rows, ext, strict=True) for _ in range(e)]
            batch_prefix = [p + i for p, e in zip(prefix, ext, strict=True) for i in range(e)]
            batch_ext = [1] * len(ids)
        fb = ForwardBatch.build(mode, ids, batch_rows, batch_prefix, batch_ext,
                                self.req_pool.req_to_token)
        if all_positions:  # logits for every new token, not only each request's last
            fb.logits_indices = torch.arange(fb.num_tokens)
        fb.decode_rows_from = decode_rows_from
        assert self.model.attn_backend is not None
        self.model.attn_backend.init_forward_metadata(fb)
        logits = self.model(fb)
        for r, e in zip(rows, ext, strict=True):
            self.cached[r] += e
        return logits, fb

    def greedy_step(self, mode: ForwardMode, rows: Sequence[int],
                    chunks: Sequence[Sequence[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One step of `chunks` through `model(fb)`, then the same batch through
        `forward_greedy(fb)` (it writes the step's K/V again, the same values): the logits and
        forward_greedy's (logits, ids)."""
        logits, fb = self._run(mode, rows, chunks)
        assert self.model.attn_backend is not None
        self.model.attn_backend.init_forward_metadata(fb)
        lg, ids = self.model.forward_greedy(fb)
        return logits, lg, ids

    def extend(
        self, rows: Sequence[int], chunks: Sequence[Sequence[int]], all_positions: bool = False,
        decode_rows_from: int | None = None,
    ) -> torch.Tensor:
        """Logits `[B, vocab]` (or `[num_tokens, vocab]` with `all_positions`).
        `decode_rows_from`: `ForwardBatch.decode_rows_from` (the scheduler's marking; None
        lets a backend take every 1-token row for a decode row)."""
        return self._run(ForwardMode.EXTEND, rows, chunks, all_positions,
                         decode_rows_from=decode_rows_from)[0]

    def share_prefix(self, src: int, length: int) -> int:
        """A new request whose first `length` tokens are `src`'s cached KV slots (a radix hit)."""
        row = self.new_request()
        self.req_pool.req_to_token[row, :length] = self.req_pool.req_to_token[src, :length]
        self.cached[row] = length
        return row

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self._run(ForwardMode.DECODE, rows, [[t] for t in tokens])[0]

    def decode_rows(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """A decode step in which request `rows[i]` computes every token of `chunks[i]`: one
        decode row per token, consecutive over the request's table row (as the scheduler's
        `BatchBuilder.build_decode` lays out grammar-forced and draft tokens). Logits
        `[num_tokens, vocab]`, one per token."""
        return self._run(ForwardMode.DECODE, rows, chunks, row_per_token=True)[0]


def shared_prefix_greedy(runner: PagedRunner, steps: int = 6,
                         ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Three requests sharing a 40-token cached prefix (tails of 3, 7 and 1 tokens) beside one
    alone (12 tokens), prefilled on `runner`, then `steps` greedy decode steps. Returns each
    request's tokens and the logits of the prefill and of every decode step; the pool's
    invariants are checked at the end."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (40,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7, 1)]
    alone = torch.randint(0, 256, (12,), generator=g).tolist()
    first = runner.new_request()
    runner.extend([first], [prefix])
    rows = [runner.share_prefix(first, len(prefix)) for _ in tails] + [runner.new_request()]
    seqs = [prefix + t for t in tails] + [list(alone)]
    logits = runner.extend(rows, [*tails, alone])
    out = [logits]
    for _ in range(steps):
        for s, tok in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            s.append(tok)
        logits = runner.decode(rows, [s[-1] for s in seqs])
        out.append(logits)
    runner.kv_pool.check_invariants()
    return seqs, out


def serve_staggered(sched: Any, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """Drives `sched` over greedy requests `prompts` (`n` tokens each): the first two at once,
    the rest and a sampled request "s" (4 tokens, on the first prompt) after 3 steps, so that
    mixed prefill + decode steps run; checks the scheduler's invariants after every step and
    returns each request's tokens."""
    from radixrt.core.messages import GenerateReq
    from radixrt.core.sampling_params import SamplingParams

    out: dict[str, list[int]] = {}
    first = next(iter(prompts))
    for rid, ids in list(prompts.items())[:2]:
        sched.handle(GenerateReq(rid, ids, SamplingParams(max_new_tokens=n, temperature=0,
                                                          ignore_eos=True)))
    steps = 0
    while sched.has_work or steps < 3:
        if steps == 3:  # arrive mid-decode: mixed steps
            for rid, ids in list(prompts.items())[2:]:
                sched.handle(GenerateReq(rid, ids, SamplingParams(
                    max_new_tokens=n, temperature=0, ignore_eos=True)))
            sched.handle(GenerateReq("s", prompts[first], SamplingParams(
                max_new_tokens=4, temperature=0.8, seed=5, ignore_eos=True)))
        res = sched.step()
        sched.check_invariants()
        for o in (res.outs if res is not None else []):
            out.setdefault(o.rid, []).extend(o.new_ids)
        steps += 1
    return out
