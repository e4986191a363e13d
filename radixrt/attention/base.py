"""The attention-backend seam: torch-native everywhere, FlashInfer on CUDA."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from radixrt.core.forward_batch import ForwardBatch
from radixrt.mem.memory_pool import TokenToKVPool

if TYPE_CHECKING:
    from radixrt.attention.extend_attention import ExtendStepPlan
    from radixrt.attention.paged_decode import PagedDecodePlan

# Row count below which CPU fp32 GEMMs (MKL) take other kernels: measured on torch 2.13 / MKL
# (AVX512), rows of `x[:n] @ W.T` equal those of the full product except for n in
# {1, 2, 3, 5, 6, 7, 9, 10, 11}. Batch-invariant steps pad every matmul to at least this many rows.
MIN_INVARIANT_ROWS = 16


class AttentionBackend(ABC):
    """Computes attention for every layer of one step from the step's `ForwardBatch`.

    `init_forward_metadata` runs once per step (before layer 0) and may precompute anything
    derived from the batch (plans, padded index tensors, masks); `forward` runs once per layer,
    writes the new tokens' K/V into the pool at `fb.out_cache_loc`, then attends.
    """

    # True when every extend token's attention output is a bitwise-deterministic function of its
    # own token prefix (independent of batch companions, cached-prefix split, chunking); the
    # model then also pads its matmuls to `MIN_INVARIANT_ROWS` rows in extend steps.
    batch_invariant: bool = False

    def __init__(self, kv_pool: TokenToKVPool):
        self.kv_pool = kv_pool

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_id: int,
        scaling: float,
        fb: ForwardBatch,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        ...

    def paged_decode_plan(self, fb: ForwardBatch) -> PagedDecodePlan | None:
        """The plan of step `fb` when its attention, in every layer, is exactly: store the new
        K/V with `radixrt::kv_store`, then `radixrt::paged_decode` over this plan on the pool
        buffers (what a caller running the layers in one C++ call needs); None otherwise."""
        return None

    def extend_step_plan(self, fb: ForwardBatch) -> ExtendStepPlan | None:
        """The plan of extend step `fb` when its attention, in every layer, is exactly what
        `ExtendStepPlan` describes (kv_store, then the extend op, and in a mixed step the
        paged-decode op for its one-token rows) on a pool of the compute dtype; None otherwise
        (the caller then runs its layer loop)."""
        return None
