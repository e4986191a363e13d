"""FlashInfer on a CUDA GPU (skipped without one): kernels vs the torch-native backend, CUDA-graph
decode vs eager, FlashInfer sampling, and greedy end-to-end equality with Hugging Face.

Run on a GPU machine after `pip install -e '.[cuda]'`:
    pytest -q tests/test_flashinfer_gpu.py            # everything
    pytest -q tests/test_flashinfer_gpu.py -m 'not slow'   # without the SmolLM2 end-to-end
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_flashinfer_reference import EXTEND_CASES, clone_pool, make_batch, random_qkv

from radixrt.attention import create_attention_backend
from radixrt.attention.flashinfer import FlashInferBackend, import_flashinfer
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(import_flashinfer() is None, reason="flashinfer is not installed"),
]

CUDA = "cuda"
HALF = [torch.bfloat16, torch.float16]
TOL = {"atol": 2e-2, "rtol": 2e-2}  # half precision: both backends round differently


def _compare(
    kv: TokenToKVPool, fb: ForwardBatch, heads: int, head_dim: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(FlashInfer, torch-native) outputs for every layer, on twin pools, one plan each."""
    kv_ref = clone_pool(kv)
    fi = create_attention_backend("auto", kv, CUDA, num_q_heads=heads)
    assert isinstance(fi, FlashInferBackend)
    ref = TorchNativeBackend(kv_ref)
    fi.init_forward_metadata(fb)
    ref.init_forward_metadata(fb)
    outs = []
    for layer in range(kv.num_layers):
        q, k, v = random_qkv(fb.num_tokens, heads, kv.num_kv_heads, layer, kv.dtype, head_dim,
                             CUDA)
        scale = head_dim**-0.5
        outs.append((fi.forward(q, k, v, layer, scale, fb), ref.forward(q, k, v, layer, scale, fb)))
    torch.cuda.synchronize()
    for layer in range(kv.num_layers):
        torch.testing.assert_close(kv.k_buffer[layer], kv_ref.k_buffer[layer], atol=0, rtol=0)
    return outs


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: f"p{c[0][:3]}e{c[1][:3]}n{len(c[0])}")
def test_extend_matches_torch_native(
    case: tuple[list[int], list[int]], heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype,
) -> None:
    prefix, ext = case
    kv, fb = make_batch(prefix, ext, heads, kv_heads, ForwardMode.EXTEND, 1, dtype,
                        head_dim=head_dim, device=CUDA)
    for got, want in _compare(kv, fb, heads, head_dim):
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (9, 3, 64), (32, 4, 128)])
@pytest.mark.parametrize("seq_lens", [[1], [300], [1, 9, 33, 2], [1 + (37 * i) % 500 for i in range(64)]],
                         ids=lambda s: f"n{len(s)}")
def test_decode_matches_torch_native(
    seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    kv, fb = make_batch([s - 1 for s in seq_lens], [1] * len(seq_lens), heads, kv_heads,
                        ForwardMode.DECODE, 2, dtype, head_dim=head_dim, device=CUDA)
    for got, want in _compare(kv, fb, heads, head_dim):
        torch.testing.assert_close(got, want, **TOL)


def test_factory_on_cuda() -> None:
    kv = TokenToKVPool(16, 1, 2, 64, torch.bfloat16, CUDA)
    assert isinstance(create_attention_backend("auto", kv, CUDA, num_q_heads=8), FlashInferBackend)
    assert isinstance(create_attention_backend("flashinfer", kv, CUDA, num_q_heads=8),
                      FlashInferBackend)
    fp32 = TokenToKVPool(16, 1, 2, 64, torch.float32, CUDA)
    assert isinstance(create_attention_backend("auto", fp32, CUDA, num_q_heads=8),
                      TorchNativeBackend)


# --- CUDA graphs -----------------------------------------------------------------------------------
def test_cuda_graph_decode_matches_eager(tmp_path: Path) -> None:
    from model_fixtures import make_tiny_checkpoint

    from radixrt.model.cuda_graph_runner import CudaGraphRunner
    from radixrt.model.loader import load_model
    from radixrt.model.model_config import ModelConfig

    make_tiny_checkpoint(tmp_path, hidden_size=512, num_attention_heads=8, num_key_value_heads=2)
    cfg = ModelConfig.from_path(tmp_path)
    model, _ = load_model(tmp_path, None, torch.bfloat16, CUDA, model_config=cfg)
    kv = TokenToKVPool(2048, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, CUDA)
    reqs = ReqToTokenPool(8, 256, CUDA)
    backend = FlashInferBackend(kv, cfg.num_heads, CUDA)
    model.attn_backend = backend
    runner = CudaGraphRunner(model, backend, max_bs=8, max_kv_tokens=kv.size)
    assert runner.buckets == [1, 2, 4, 8]

    rows = [reqs.alloc() for _ in range(3)]
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3]]
    lens = [len(p) for p in prompts]
    loc = kv.alloc(sum(lens))
    reqs.write(rows, [0, 0, 0], lens, loc)  # type: ignore[arg-type]
    fb = ForwardBatch.build(ForwardMode.EXTEND, [t for p in prompts for t in p], rows,
                            [0, 0, 0], lens, reqs.req_to_token, CUDA)
    backend.init_forward_metadata(fb)
    last = model(fb).argmax(-1).tolist()
    for _ in range(4):  # decode steps: eager, then the graph on the very same batch
        loc = kv.alloc(3)
        reqs.write(rows, lens, [1, 1, 1], loc)  # type: ignore[arg-type]
        fb = ForwardBatch.build(ForwardMode.DECODE, last, rows, lens, [1, 1, 1],
                                reqs.req_to_token, CUDA)
        backend.init_forward_metadata(fb)
        eager = model(fb)
        assert runner.can_run(fb)
        graph = runner.replay(fb)  # bucket 4, one padded row
        torch.testing.assert_close(graph, eager, atol=2e-2, rtol=2e-2)
        assert graph.argmax(-1).tolist() == eager.argmax(-1).tolist()
        last = eager.argmax(-1).tolist()
        lens = [n + 1 for n in lens]


# --- sampling --------------------------------------------------------------------------------------
def test_flashinfer_sampling_respects_filters() -> None:
    from radixrt.core.sampling_params import SamplingParams
    from radixrt.sampling.batch_info import SamplingBatchInfo
    from radixrt.sampling.flashinfer_sampler import flashinfer_sample
    from radixrt.sampling.sampler import filter_logits

    vocab = 1000
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_k=20),
              SamplingParams(top_p=0.3), SamplingParams(top_k=50, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=0.5)]
    info = SamplingBatchInfo.build(params, [[1]] * len(params), [[] for _ in params], vocab, CUDA)
    logits = torch.randn(len(params), vocab, device=CUDA) * 4
    allowed = filter_logits(logits, info.temperatures.clamp(min=1e-6), info.top_ks, info.top_ps,
                            info.min_ps).isfinite()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    for _ in range(50):
        ids = flashinfer_sample(logits, info, generator=gen)
        assert ids is not None and ids.dtype == torch.int64
        assert int(ids[0]) == int(logits[0].argmax()) == int(ids[1])
        assert allowed[torch.arange(len(params), device=CUDA), ids][1:].all()


# --- end to end ------------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_greedy_matches_hf_on_smollm2(dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    from radixrt import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=8, temperature=0)
    with Engine(device=CUDA, dtype=dtype, attention_backend="flashinfer",
                max_total_tokens=20000) as eng:
        ids = [eng.tokenize(p) for p in PROMPTS]
        outs = [o.token_ids for o in eng.generate(input_ids=ids, sampling_params=params)]
        path = eng.info["model_path"]
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)
    ).to(CUDA).eval()
    with torch.inference_mode():
        for prompt_ids, got in zip(ids, outs, strict=True):
            x = torch.tensor([prompt_ids], device=CUDA)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8,
                               do_sample=False)
            assert got == y[0, len(prompt_ids):].tolist()
