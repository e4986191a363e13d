"""`CompiledDense`: the decoder layers' dense parts under `torch.compile`, for decode steps.

Each layer's `pre_attention` (residual add, norm, qkv, RoPE) and `post_attention` (o_proj, norm,
MLP) are compiled once for the layer class (parameters are graph inputs, so all layers share one
graph; batch size is a dynamic dimension). Attention stays eager: it reads the paged KV pool.
On CPU inductor fuses the norms, RoPE and SiLU-mul into C++ kernels and keeps the matmuls
external; it needs a C++ compiler at run time. Measured on the 2-core Zen 4 machine (fp32, CPU
time of a bare decode step, bench/results/*-step-overhead.md): 1.09x / 1.05x *slower* at batch
1 / 8, 0.91x at batch 64, after minutes of compiling; so `ServerArgs.compile_decode` is off by
default.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class CompiledDense:
    """Swaps the compiled dense parts into `layers` for the duration of `active()`."""

    def __init__(self, layers: nn.ModuleList):
        self.layers = list(layers)
        cls = type(self.layers[0])
        self._pre = torch.compile(cls.pre_attention, dynamic=True)
        self._post = torch.compile(cls.post_attention, dynamic=True)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: every layer's `pre_attention` / `post_attention` is the compiled one."""
        for layer in self.layers:
            layer.pre_attention = self._pre.__get__(layer)
            layer.post_attention = self._post.__get__(layer)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.pre_attention, layer.post_attention  # back to the class's methods
