"""Attention backends behind one seam (`AttentionBackend`) and the factory that picks one."""

from __future__ import annotations

import torch

from radixrt.attention.base import AttentionBackend
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.mem.memory_pool import TokenToKVPool

__all__ = ["AttentionBackend", "TorchNativeBackend", "create_attention_backend"]


def create_attention_backend(
    name: str, kv_pool: TokenToKVPool, device: torch.device | str | None = None
) -> AttentionBackend:
    """`name` is "auto" or "torch" (torch-native SDPA) or "flashinfer" (not available yet)."""
    if name in ("auto", "torch"):
        return TorchNativeBackend(kv_pool, device)
    if name == "flashinfer":
        raise NotImplementedError(
            "the FlashInfer attention backend comes in a later issue; use 'auto' or 'torch'"
        )
    raise ValueError(f"unknown attention backend {name!r}; expected auto|torch|flashinfer")
