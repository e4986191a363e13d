"""Our LlamaForCausalLM (driven through the real pools) against transformers, plus config/RoPE/loaders."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from model_fixtures import PagedRunner, hf_logits, make_tiny_checkpoint, write_tiny_gguf

from radixrt.attention import torch_native
from radixrt.model.loader import (
    SafetensorsLoader,
    _unpermute_rope_rows,
    default_model_path,
    load_model,
)
from radixrt.model.model_config import ModelConfig, RopeParams
from radixrt.model.rope import RotaryEmbedding, rope_inv_freq

ATOL = 1e-4

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-tied-llama3": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3}),
    "llama-bias-linear": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        },
    ),
    "llama-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": False}),
    "mistral-headdim": ("mistral", {"head_dim": 32, "sliding_window": None}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    kind, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_checkpoint(path, kind, seed=len(request.param), **overrides)
    return path, hf


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _check(ours: torch.Tensor, hf: Any, seqs: list[list[int]]) -> None:
    assert ours.dtype == torch.float32 and ours.shape == (len(seqs), 256)
    for row, seq in zip(ours, seqs, strict=True):
        torch.testing.assert_close(row, hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


# -- logits vs transformers --------------------------------------------------------------------
def test_prefill_batch(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    runner = PagedRunner.create(path)
    prompts = _prompts([5, 17, 1, 40, 2])
    rows = [runner.new_request() for _ in prompts]
    _check(runner.extend(rows, prompts), hf, prompts)


def test_batched_decode(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    runner = PagedRunner.create(path)
    seqs = _prompts([3, 11, 1, 25], seed=1)
    rows = [runner.new_request() for _ in seqs]
    logits = runner.extend(rows, seqs)
    for _ in range(4):
        for s, tok in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            s.append(tok)
        logits = runner.decode(rows, [s[-1] for s in seqs])
        _check(logits, hf, seqs)


@pytest.mark.parametrize("waste", [0.0, 1e9], ids=["ragged", "padded"])
def test_chunked_prefill(
    tiny: tuple[Path, Any], waste: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt computed in two extend steps, the second batched with a fresh request."""
    monkeypatch.setattr(torch_native, "PADDED_WASTE_FACTOR", waste)
    path, hf = tiny
    runner = PagedRunner.create(path)
    long, short, single = _prompts([30, 9, 6], seed=2)
    a, b, c = (runner.new_request() for _ in range(3))
    _check(runner.extend([a, c], [long[:12], single[:5]]), hf, [long[:12], single[:5]])
    _check(
        runner.extend([a, b, c], [long[12:], short, single[5:]]),
        hf,
        [long, short, single],
    )


def test_bfloat16_runs_close(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    runner = PagedRunner.create(path, dtype=torch.bfloat16)
    prompts = _prompts([7, 3], seed=3)
    rows = [runner.new_request() for _ in prompts]
    ours = runner.extend(rows, prompts)
    assert ours.dtype == torch.float32
    for row, seq in zip(ours, prompts, strict=True):
        ref = hf_logits(hf, seq)[-1]
        assert (row - ref).abs().max() <= 0.05 * ref.abs().max() + 0.05


# -- config, rope, loaders ---------------------------------------------------------------------
def test_model_config_from_tiny_dirs(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "q", "qwen2", eos_token_id=[2, 7])
    cfg = ModelConfig.from_path(tmp_path / "q")
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias and not cfg.o_proj_bias
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (2, 16, 2)
    assert cfg.sliding_window is None
    assert ModelConfig.from_json(cfg.to_json()) == cfg

    make_tiny_checkpoint(tmp_path / "l", "llama", attention_bias=True, rope_parameters=LLAMA3)
    cfg = ModelConfig.from_path(tmp_path / "l")
    assert cfg.qkv_bias and cfg.o_proj_bias and cfg.rope.rope_type == "llama3"
    assert cfg.rope.factor == 8.0 and cfg.rope.original_max_position_embeddings == 64
    assert cfg.torch_dtype == torch.float32


def test_model_config_v4_style_and_errors() -> None:
    v4 = SimpleNamespace(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_attention_heads=8,
        num_key_value_heads=None,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        vocab_size=100,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        eos_token_id=[5, 6],
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    cfg = ModelConfig.from_hf_config(v4)
    assert cfg.num_kv_heads == 8 and cfg.head_dim == 32
    assert cfg.rope == RopeParams(rope_type="linear", theta=500000.0, factor=4.0)
    assert (
        cfg.eos_token_ids == (5, 6)
        and cfg.bos_token_id is None
        and cfg.torch_dtype == torch.bfloat16
    )
    for bad in (
        SimpleNamespace(**{**vars(v4), "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
        SimpleNamespace(**{**vars(v4), "architectures": ["LlamaForSequenceClassification"]}),
    ):
        with pytest.raises(ValueError, match=bad.architectures[0]):
            ModelConfig.from_hf_config(bad)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        LLAMA3,
        {
            "rope_type": "yarn",
            "rope_theta": 20000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "beta_fast": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_matches_hf(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters=dict(rope),
    )
    cfg = ModelConfig.from_hf_config(hf_cfg)
    ours = RotaryEmbedding(cfg.head_dim, 512, cfg.rope)
    positions = torch.tensor([0, 1, 7, 100, 511])
    x = torch.zeros(1, len(positions), cfg.head_dim)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(x, positions.unsqueeze(0))
    cos, sin = ours.cos_sin(positions)
    half = cfg.head_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin[:, 0, half:], hf_sin[0, :, half:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(-sin[:, 0, :half], hf_sin[0, :, :half], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="rope_type"):
        rope_inv_freq(RopeParams(rope_type="longrope"), 64)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for n_head, rows in ((3, 192), (9, 576)):
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        # llama.cpp convert_hf_to_gguf: reshape(n_head, 2, dim, ...).swapaxes(1, 2)
        permuted = w.reshape(n_head, 2, rows // n_head // 2, 5).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(_unpermute_rope_rows(permuted, n_head), w)


def test_pytorch_bin_fallback(tmp_path: Path) -> None:
    hf = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=False)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    cfg = ModelConfig.from_path(tmp_path)
    names = {n for n, _ in SafetensorsLoader(tmp_path, cfg).iter_weights()}
    assert "lm_head.weight" in names
    runner = PagedRunner.create(tmp_path)
    prompt = _prompts([6])[0]
    _check(runner.extend([runner.new_request()], [prompt]), hf, [prompt])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_matches_source(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GGUF name mapping, q/k un-permutation (llama only) and biases (qwen2) on a tiny model."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_tiny_checkpoint(tmp_path / "hf", kind, tie_word_embeddings=kind == "llama")
    gguf_path = write_tiny_gguf(hf, tmp_path / f"{kind}.gguf", kind)
    cfg = ModelConfig.from_path(gguf_path)
    assert cfg.model_type == kind and cfg.qkv_bias == (kind == "qwen2")
    assert ModelConfig.from_path(gguf_path) == cfg  # second read: from the cache
    runner = PagedRunner.create(gguf_path)
    prompts = _prompts([6, 13], seed=4)
    _check(runner.extend([runner.new_request(), runner.new_request()], prompts), hf, prompts)


def test_sharded_safetensors_with_index(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = make_tiny_checkpoint(tmp_path / "unused", "qwen2")
    hf.save_pretrained(str(tmp_path / "m"), max_shard_size="100KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    save_file(
        {"tok_embeddings.weight": torch.zeros(2)}, tmp_path / "m" / "consolidated.safetensors"
    )
    runner = PagedRunner.create(tmp_path / "m")
    prompt = _prompts([5])[0]
    _check(runner.extend([runner.new_request()], [prompt]), hf, [prompt])


def test_missing_weight_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(tmp_path, "llama")
    st = load_file(tmp_path / "model.safetensors")
    del st["model.layers.1.mlp.up_proj.weight"]
    save_file(st, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        load_model(tmp_path, None, "float32", "cpu")


def test_sentencepiece_tokenizer_dir(tmp_path: Path) -> None:
    """A legacy Llama-2 style directory: only tokenizer.model (SentencePiece) + tokenizer_config."""
    import json

    import sentencepiece as spm

    from radixrt.model.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\nHello world, a test.\n" * 50)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
    )
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, **special})
    )
    tok = load_tokenizer(tok_dir)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    text = "Hello quick fox ü"  # "ü" is unseen: byte fallback
    assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)]
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


# -- the default SmolLM2 GGUF ------------------------------------------------------------------
# "The capital of France is Paris, and the capital of Germany is Berlin. The capital of Italy is"
SMOL_PROMPT = [
    504,
    3575,
    282,
    4649,
    314,
    7042,
    28,
    284,
    260,
    3575,
    282,
    4521,
    314,
    11452,
    30,
    378,
    3575,
    282,
    7158,
    314,
]
# Both sides dequantise the same GGUF to identical fp32 weights; what differs is only summation
# order (fused vs separate matmuls, SDPA and RMSNorm kernels), ~1e-6 relative per op. Over 30
# layers we measured ~2e-6 of the logit range; 1e-3 of it leaves ample margin while still
# catching any real mistake (a wrong permutation or RoPE moves logits by whole units).
SMOL_RTOL = 1e-3


@pytest.fixture(scope="module")
def smol_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smol_path: str, smollm2_hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, cfg = load_model(smol_path, None, "auto", "cpu")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (
        30,
        9,
        3,
        True,
    )
    assert model.dtype == torch.float32
    runner = PagedRunner.for_model(model, kv_size=256, max_reqs=2, max_context=64)
    row = runner.new_request()
    ours = [runner.extend([row], [SMOL_PROMPT])[0]]
    seq = SMOL_PROMPT + [int(ours[0].argmax())]
    ours.append(runner.decode([row], [seq[-1]])[0])

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32).eval()
    for got, ids in zip(ours, (SMOL_PROMPT, seq), strict=True):
        ref = hf_logits(hf, ids)[-1]
        assert (got - ref).abs().max() <= SMOL_RTOL * ref.abs().max()
        assert int(got.argmax()) == int(ref.argmax())


@pytest.mark.slow
def test_gguf_tokenizer_cache_round_trip(
    smol_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixrt.model.tokenizer import load_tokenizer

    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path))
    fresh = load_tokenizer(smol_path)  # converts from the GGUF and publishes the cache entry
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")
    cached = load_tokenizer(smol_path)
    texts = [
        "Hello, world!",
        "  multiple   spaces\nand\ttabs",
        "héllo wörld ☃ 日本語",
        "<|im_start|>user",
    ]
    for text in texts:
        assert cached.encode(text) == fresh.encode(text)
        assert cached.decode(fresh.encode(text)) == fresh.decode(fresh.encode(text))
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    for kwargs in ({"tokenize": False}, {"tokenize": True}):
        assert cached.apply_chat_template(msgs, add_generation_prompt=True, **kwargs) == (
            fresh.apply_chat_template(msgs, add_generation_prompt=True, **kwargs)
        )
    assert "<|im_start|>assistant" in cached.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert (cached.eos_token_id, cached.bos_token_id) == (fresh.eos_token_id, fresh.bos_token_id)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1


@pytest.mark.slow
def test_compiled_dense_decode_matches_eager(tiny_llama_dir):
    """`compile_decode`: the torch.compile'd dense parts give the eager logits (fp32, 1e-4) and
    greedy tokens over decode steps of changing batch size; the layers get their eager methods
    back afterwards. Slow: it pays inductor's compile time."""
    from radixrt.model.compiled_layers import CompiledDense

    eager = PagedRunner.create(tiny_llama_dir)
    comp = PagedRunner.create(tiny_llama_dir)
    compiled = CompiledDense(comp.model.layers)
    prompts = [[5, 9, 13, 17, 21], [3, 4], [40, 41, 42, 43, 44, 45, 46]]
    rows_e = [eager.new_request() for _ in prompts]
    rows_c = [comp.new_request() for _ in prompts]
    nxt = eager.extend(rows_e, prompts).argmax(-1).tolist()
    assert comp.extend(rows_c, prompts).argmax(-1).tolist() == nxt
    for step in range(4):
        n = 3 if step < 2 else 2  # the batch shrinks: a dynamic dimension, no new graph needed
        le = eager.decode(rows_e[:n], nxt[:n])
        with compiled.active():
            lc = comp.decode(rows_c[:n], nxt[:n])
        torch.testing.assert_close(lc, le, atol=1e-4, rtol=1e-4)
        assert lc.argmax(-1).tolist() == le.argmax(-1).tolist()
        nxt = le.argmax(-1).tolist()
    assert all("pre_attention" not in vars(layer) for layer in comp.model.layers)
