"""`ModelConfig`: the architecture facts the runtime needs, read once from an HF config or a GGUF file.

Invariants: `num_heads % num_kv_heads == 0`; `head_dim` is explicit (derived as
`hidden_size // num_heads` when the checkpoint leaves it out); `eos_token_ids` is a tuple (possibly
empty) whatever shape the checkpoint used; `torch_dtype` is the checkpoint's float dtype, or None
when it names none (GGUF files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

logger = logging.getLogger(__name__)

_FLOAT_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)

# model_type -> architecture class name; the only checkpoints `LlamaForCausalLM` implements.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
)


@dataclass(frozen=True)
class RopeParams:
    """Rotary-embedding parameters in transformers-5 `rope_parameters` terms.

    `rope_type` is one of "default", "linear", "dynamic", "llama3", "yarn". Fields a type does not
    use stay None.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_position_embeddings: int) -> RopeParams:
        """Build from a `rope_parameters` (v5) or merged `rope_theta` + `rope_scaling` (v4) dict."""
        rope_type = str(d.get("rope_type") or d.get("type") or "default")
        orig = d.get("original_max_position_embeddings")
        if orig is None and rope_type in ("llama3", "yarn"):
            orig = max_position_embeddings  # transformers' standardisation does the same

        def opt_float(key: str) -> float | None:
            v = d.get(key)
            return None if v is None else float(v)

        return cls(
            rope_type=rope_type,
            theta=float(d.get("rope_theta") or 10000.0),
            factor=opt_float("factor"),
            original_max_position_embeddings=None if orig is None else int(orig),
            low_freq_factor=opt_float("low_freq_factor"),
            high_freq_factor=opt_float("high_freq_factor"),
            beta_fast=opt_float("beta_fast"),
            beta_slow=opt_float("beta_slow"),
            attention_factor=opt_float("attention_factor"),
            mscale=opt_float("mscale"),
            mscale_all_dim=opt_float("mscale_all_dim"),
            truncate=bool(d.get("truncate", True)),
            partial_rotary_factor=float(d.get("partial_rotary_factor") or 1.0),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime reads about a decoder-only Llama-family checkpoint."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeParams
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Llama: `attention_bias`
    o_proj_bias: bool  # Llama's `attention_bias` also covers o_proj; Qwen2's o_proj has none
    mlp_bias: bool
    hidden_act: str
    torch_dtype: torch.dtype | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None  # only when the checkpoint actually uses one

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_len(self) -> int:
        """Longest sequence served exactly: the sliding window (not implemented) caps the context."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read an HF model directory (config.json) or a `.gguf` file (via transformers' GGUF parser).

        Parsing a GGUF header takes seconds, so its result is cached (see `gguf_cache_path`);
        transformers is imported only when a config is parsed.
        """
        p = Path(path)
        gguf_file = resolve_gguf_file(p)
        if gguf_file is not None:
            return cls._from_gguf_cached(gguf_file)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} is neither a .gguf file nor a directory with config.json")
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(p))
        extra_eos = _generation_config_eos(p / "generation_config.json")
        return cls.from_hf_config(hf, extra_eos_token_ids=extra_eos)

    @classmethod
    def _from_gguf_cached(cls, gguf_file: Path) -> ModelConfig:
        entry = gguf_cache_path(gguf_file, "configs", salt=_schema()).with_suffix(".json")
        try:
            return cls.from_json(entry.read_text())
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, KeyError) as e:
            logger.warning("ignoring unreadable cached config %s: %s", entry, e)
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        config = cls.from_hf_config(hf)
        try:
            _write_atomic(entry, config.to_json())
        except OSError as e:
            logger.warning("could not cache the GGUF config under %s: %s", entry, e)
        return config

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["torch_dtype"] = None if self.torch_dtype is None else str(self.torch_dtype)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        d["rope"] = RopeParams(**d["rope"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["torch_dtype"] = _float_dtype(d["torch_dtype"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, hf: Any, extra_eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Translate a transformers `PretrainedConfig` (v4 or v5 layout)."""
        model_type = str(getattr(hf, "model_type", "") or "")
        archs = list(getattr(hf, "architectures", None) or [])
        expected = SUPPORTED_ARCHITECTURES.get(model_type)
        if expected is None or (archs and archs[0] != expected):
            name = archs[0] if archs else f"model_type={model_type!r}"
            raise ValueError(
                f"unsupported architecture {name}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES.values())}"
            )
        num_heads = int(hf.num_attention_heads)
        num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
        max_pos = int(hf.max_position_embeddings)
        rope = RopeParams.from_dict(_rope_dict(hf), max_pos)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "llama":
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        else:  # mistral
            qkv_bias = o_bias = False
        act = str(getattr(hf, "hidden_act", "silu"))
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        eos = _as_int_tuple(getattr(hf, "eos_token_id", None))
        eos += tuple(i for i in extra_eos_token_ids if i not in eos)
        bos = getattr(hf, "bos_token_id", None)
        return cls(
            architecture=expected,
            model_type=model_type,
            num_layers=int(hf.num_hidden_layers),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(hf.vocab_size),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope=rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            hidden_act="silu",
            # Read the instance dict: v5's `torch_dtype` alias warns, v4 has only `torch_dtype`.
            torch_dtype=_float_dtype(vars(hf).get("dtype") or vars(hf).get("torch_dtype")),
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            sliding_window=_sliding_window(hf, model_type, max_pos),
        )


def layer_matmul_macs(cfg: Any) -> int:
    """Multiply-adds per token in one decoder layer's four matmuls (qkv, o, gate_up, down),
    biases aside. `cfg`: anything with ModelConfig's shape fields."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return h * (q + 2 * kv) + q * h + h * 2 * i + i * h


def attention_pair_macs(cfg: Any) -> int:
    """Multiply-adds of one (query, key) pair of attention in one layer: QK^T and PV over every
    query head."""
    return 2 * cfg.q_size


def attention_pair_weight(cfg: Any) -> float:
    """FLOPs of one (query, key) pair of attention (QK^T and PV over every query head) per FLOP
    of one token's layer matmuls: what a prefill token over k cached keys costs in attention,
    relative to its matmuls, is about k times this (SmolLM2-135M: 3.3e-4, so 3000 keys double
    a token's FLOPs)."""
    return attention_pair_macs(cfg) / layer_matmul_macs(cfg)


def resolve_gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the only `*.gguf` in a directory without config.json."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def cache_root() -> Path:
    """`$RADIXRT_CACHE_DIR`, default `~/.cache/radixrt`: artifacts derived from model files."""
    env = os.environ.get("RADIXRT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixrt"


def gguf_cache_path(gguf_file: Path, kind: str, salt: str = "") -> Path:
    """`<cache_root>/<kind>/<key>`; `key` hashes the file's absolute path, size, mtime, the
    transformers version and `salt`, so any change to them yields a fresh entry. The version is
    read from the installed metadata: importing transformers takes seconds, and a cached entry
    is there so that the scheduler need not import it."""
    st = gguf_file.stat()
    version = importlib.metadata.version("transformers")
    raw = f"{gguf_file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}|{salt}"
    return cache_root() / kind / hashlib.sha256(raw.encode()).hexdigest()[:24]


def _schema() -> str:
    names = [f.name for f in dataclasses.fields(ModelConfig)] + [
        f.name for f in dataclasses.fields(RopeParams)
    ]
    return "v1:" + ",".join(names)  # bump v1 when a field's meaning changes


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _rope_dict(hf: Any) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and params:
        d = dict(params)
    else:
        d = dict(getattr(hf, "rope_scaling", None) or {})
    d.setdefault("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    prf = getattr(hf, "partial_rotary_factor", None)
    if prf is not None:
        d.setdefault("partial_rotary_factor", prf)
    if getattr(hf, "original_max_position_embeddings", None) is not None:
        d["original_max_position_embeddings"] = hf.original_max_position_embeddings
    return d


def _as_int_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def _float_dtype(dt: Any) -> torch.dtype | None:
    """A checkpoint's dtype (a `torch.dtype` or a name such as "bfloat16"), if it is a float one."""
    if dt is None:
        return None
    return _FLOAT_DTYPES.get(str(dt).removeprefix("torch."))


def _sliding_window(hf: Any, model_type: str, max_pos: int) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if window is None or model_type == "llama":
        return None
    if model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
        return None
    window = int(window)
    return window if window < max_pos else None


def _generation_config_eos(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        return ()
    try:
        return _as_int_tuple(json.loads(path.read_text()).get("eos_token_id"))
    except (OSError, ValueError, TypeError):
        return ()
