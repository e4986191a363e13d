"""Attention backends behind one seam (`AttentionBackend`) and the factory that picks one."""

from __future__ import annotations

import logging

import torch

from radixrt.attention.base import AttentionBackend
from radixrt.attention.flashinfer import (
    FlashInferBackend,
    FlashInferUnavailableError,
    flashinfer_unavailable_reason,
)
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.mem.memory_pool import TokenToKVPool

__all__ = [
    "AttentionBackend",
    "FlashInferBackend",
    "FlashInferUnavailableError",
    "TorchNativeBackend",
    "create_attention_backend",
]

logger = logging.getLogger(__name__)


def create_attention_backend(
    name: str,
    kv_pool: TokenToKVPool,
    device: torch.device | str | None = None,
    *,
    num_q_heads: int | None = None,
    sm_scale: float | None = None,
    decode_kernel: bool | None = None,
    extend_kernel: bool | None = None,
) -> AttentionBackend:
    """`name` is "auto", "torch" (torch-native SDPA) or "flashinfer" (CUDA only).

    "auto" picks FlashInfer when the device is CUDA, the KV cache is fp16/bf16, `num_q_heads` is
    given and `flashinfer` imports; the torch-native backend otherwise. "flashinfer" raises
    `FlashInferUnavailableError` (saying why) where it cannot run. `sm_scale` (default
    `head_dim ** -0.5`) is the softmax scale FlashInfer plans with. `decode_kernel` goes to
    `TorchNativeBackend` (None: the C++ paged-decode op on CPU when it builds; False: never),
    and so does `extend_kernel` (the same for the C++ extend-attention op).
    """
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; expected auto|torch|flashinfer")
    dev = torch.device(device) if device is not None else kv_pool.device
    if name == "torch":
        return TorchNativeBackend(kv_pool, dev, decode_kernel=decode_kernel,
                                  extend_kernel=extend_kernel)
    reason = flashinfer_unavailable_reason(dev, kv_pool.dtype, num_q_heads)
    if reason is None:
        assert num_q_heads is not None
        return FlashInferBackend(kv_pool, num_q_heads, dev, sm_scale=sm_scale)
    if name == "flashinfer":
        raise FlashInferUnavailableError(f"attention_backend='flashinfer' unavailable: {reason}")
    if dev.type == "cuda":
        logger.info("attention backend: torch-native (%s)", reason)
    return TorchNativeBackend(kv_pool, dev, decode_kernel=decode_kernel,
                                  extend_kernel=extend_kernel)
