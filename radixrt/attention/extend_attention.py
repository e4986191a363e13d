"""Copy-free extend (prefill) attention on CPU: one step's plan for
`torch.ops.radixrt.extend_attention`.

The C++ op (`csrc/extend_attention.cpp`, built by `cpu_kernels`) reads every key and value
straight from the pool's per-layer buffers: request b's keys are its prefix slots
`kv_indices[kv_indptr[b]:kv_indptr[b+1]]` followed by this step's slots
`loc[qo_indptr[b]:qo_indptr[b+1]]` (whose K/V `forward` stores before attention runs), and
query i of the request sees keys 0..P_b + i. The plan is built once per step and only converts
the batch's index tensors; no mask and no gathered K/V exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixrt.attention.paged_decode import PagedDecodePlan, queries_for_pool
from radixrt.core.forward_batch import ForwardBatch
from radixrt.mem.memory_pool import TokenToKVPool

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def extend_kernel_unavailable_reason(dtype: torch.dtype, head_dim: int,
                                     build: bool = True) -> str | None:
    """None when the op can run on a CPU pool of this dtype and head_dim (building it if needed
    and `build`), else why not."""
    from radixrt.attention import cpu_kernels  # lazily: `python -m ...cpu_kernels` runs it

    return cpu_kernels.op_unavailable_reason("extend_attention", KERNEL_DTYPES, dtype, head_dim,
                                             build)


@dataclass
class ExtendAttentionPlan:
    kv_indices: torch.Tensor  # int32 [sum P_b]: prefix slots, request by request
    kv_indptr: torch.Tensor  # int64 [B + 1]
    loc: torch.Tensor  # int32 [num_tokens]: this step's slots (K/V already stored)
    qo_indptr: torch.Tensor  # int64 [B + 1]
    # int8 pools: (the slots read, this plan renumbered over them), built on first use
    _compact: tuple[torch.Tensor, ExtendAttentionPlan] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, fb: ForwardBatch) -> ExtendAttentionPlan:
        """Extend layout (mixed batches included: a decode row is a one-token extend)."""
        if fb.is_decode:
            raise ValueError("ExtendAttentionPlan is for extend batches")
        return cls(
            kv_indices=fb.kv_indices.to("cpu", torch.int32).contiguous(),
            kv_indptr=fb.kv_indptr.to("cpu", torch.int64).contiguous(),
            loc=fb.out_cache_loc.to("cpu", torch.int32).contiguous(),
            qo_indptr=fb.qo_indptr.to("cpu", torch.int64).contiguous(),
        )

    def run_pool(self, q: torch.Tensor, pool: TokenToKVPool, layer_id: int,
                 scale: float) -> torch.Tensor:
        """`run` over layer `layer_id` of `pool`. An int8 pool: the rows this step reads
        (prefixes, then the new tokens) are dequantized (`radixrt::kv_read_i8`, one pass) into a
        compact copy, and the op runs on it with the indices renumbered. A narrowed (float16
        under float32) pool is read in place like any other: the op's fp32 path widens each key
        block as it converts it."""
        if not pool.quantized:
            return self.run(q, pool.k_buffer[layer_id], pool.v_buffer[layer_id], scale)
        if self._compact is None:
            slots = torch.cat([self.kv_indices, self.loc]).to(torch.int64)
            n_pre, n_new = int(self.kv_indices.numel()), int(self.loc.numel())
            renumbered = ExtendAttentionPlan(
                torch.arange(n_pre, dtype=torch.int32), self.kv_indptr,
                torch.arange(n_pre, n_pre + n_new, dtype=torch.int32), self.qo_indptr)
            self._compact = (slots, renumbered)
        slots, renumbered = self._compact
        k, v = torch.ops.radixrt.kv_read_i8(pool.k_buffer[layer_id], pool.v_buffer[layer_id],
                                            pool.k_scale[layer_id], pool.v_scale[layer_id],
                                            slots, pool.dtype)
        return renumbered.run(q, k, v, scale)

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            scale: float) -> torch.Tensor:
        """`[num_tokens, H, D]` attention output in q's dtype of the queries `q`
        `[num_tokens, H, D]` over the pool buffers `[slots, kv_heads, D]` (fp32 queries over a
        float16 pool as they are, else in the pool's dtype)."""
        out = torch.ops.radixrt.extend_attention(
            queries_for_pool(q, k_buffer), k_buffer, v_buffer, self.kv_indices,
            self.kv_indptr, self.loc, self.qo_indptr, float(scale))
        return out.to(q.dtype)


@dataclass
class ExtendStepPlan:
    """An extend step's attention in every layer, for a caller running all the layers in one
    C++ call (`radixrt::extend_step`, model/decode_layers.py): store the step's K/V with
    `radixrt::kv_store`, then the extend op over `extend` on the pool buffers; in a mixed step
    (`decode` given) the paged-decode op over `decode` for the one-token rows' queries (token
    rows `dec_tok`) and the extend op for the others' (token rows `ext_tok`; `extend` None when
    there are none). The plans are the backend's own, built once for the step."""

    extend: ExtendAttentionPlan | None
    decode: PagedDecodePlan | None = None
    dec_tok: torch.Tensor | None = None  # int64 [decode rows]
    ext_tok: torch.Tensor | None = None  # int64 [extend tokens]

    def op_args(self) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None,
                               list[torch.Tensor]]:
        """`extend_step`'s (ext, dec_tok, ext_tok, dec_plan)."""
        ext = [] if self.extend is None else [self.extend.kv_indices, self.extend.kv_indptr,
                                              self.extend.loc, self.extend.qo_indptr]
        dec = [] if self.decode is None else list(self.decode.tensors())
        return ext, self.dec_tok, self.ext_tok, dec
