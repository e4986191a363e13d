"""Copy-free decode attention on CPU: one step's plan for `torch.ops.radixrt.paged_decode`.

The C++ op (`csrc/paged_decode.cpp`, built by `cpu_kernels`) reads every key and value straight
from the pool's per-layer buffers at the slots the plan lists, so no layer gathers K/V. The plan
is built once per step and is index arithmetic only: row b's keys are
`kv_indices[row_start[b]:][:row_len[b]]`, and a request in a cascade group starts after the
group's shared prefix, `kv_indices[group_start[g]:][:group_len[g]]`, which the op reads once per
group (chunk) and KV head for all of the group's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixrt.attention.cascade import SharedPrefixGroup
from radixrt.core.forward_batch import ForwardBatch
from radixrt.mem.memory_pool import TokenToKVPool

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def queries_for_pool(q: torch.Tensor, k_buffer: torch.Tensor) -> torch.Tensor:
    """q as the C++ attention ops take it over a pool of `k_buffer`'s dtype, contiguous: fp32
    queries over a float16 pool (a narrowed pool) as they are, else in the pool's dtype."""
    narrowed = q.dtype == torch.float32 and k_buffer.dtype == torch.float16
    return (q if narrowed else q.to(k_buffer.dtype)).contiguous()


def paged_decode_unavailable_reason(dtype: torch.dtype, head_dim: int, build: bool = True,
                                    int8_pool: bool = False) -> str | None:
    """None when the op can run on a CPU pool of this dtype and head_dim (building it if needed
    and `build`; `int8_pool`: an int8 KV cache whose compute dtype is `dtype`, which needs
    `paged_decode_i8` too), else why not."""
    from radixrt.attention import cpu_kernels  # lazily: `python -m ...cpu_kernels` runs it

    reason = cpu_kernels.op_unavailable_reason("paged_decode", KERNEL_DTYPES, dtype, head_dim,
                                               build)
    return paged_decode_i8_unavailable_reason() if reason is None and int8_pool else reason


def paged_decode_i8_unavailable_reason() -> str | None:
    """None when `paged_decode_i8` (int8 pools) runs here, else why not."""
    from radixrt.attention import cpu_kernels

    if not cpu_kernels.load_cpu_kernels() or not hasattr(torch.ops.radixrt, "paged_decode_i8"):
        return "the CPU kernels are not loaded"
    if not torch.ops.radixrt.paged_decode_i8_available():
        return "the int8 KV scan needs AVX512-VNNI; this CPU's build has none"
    return None


@dataclass
class PagedDecodePlan:
    kv_indices: torch.Tensor  # int32 [N]: the step's slots, request by request
    row_start: torch.Tensor  # int64 [B]: first own key of each row in kv_indices
    row_len: torch.Tensor  # int64 [B]: own keys (all of them when the row is in no group)
    group_start: torch.Tensor  # int64 [G]
    group_len: torch.Tensor  # int64 [G]: shared prefix length
    group_row_ptr: torch.Tensor  # int64 [G + 1]: group g's rows are group_rows[ptr[g]:ptr[g+1]]
    group_rows: torch.Tensor  # int64 [R]: batch rows, each in at most one group

    @property
    def num_groups(self) -> int:
        return int(self.group_start.numel())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The plan as the C++ ops take it: (kv_indices, row_start, row_len, group_start,
        group_len, group_row_ptr, group_rows)."""
        return (self.kv_indices, self.row_start, self.row_len, self.group_start, self.group_len,
                self.group_row_ptr, self.group_rows)

    @classmethod
    def build(cls, fb: ForwardBatch, groups: Sequence[SharedPrefixGroup] = ()) -> PagedDecodePlan:
        """Decode layout: row b's slots are `fb.kv_indices[kv_indptr[b]:kv_indptr[b+1]]`,
        including the one this step writes."""
        if not fb.is_decode:
            raise ValueError("PagedDecodePlan is for decode batches")
        indptr = fb.kv_indptr.to("cpu", torch.int64)
        start = indptr[:-1].clone()
        length = indptr[1:] - indptr[:-1]
        g_start, g_len, g_ptr, g_rows = [], [], [0], []
        for g in groups:
            g_start.append(int(start[g.rows[0]]))
            g_len.append(g.shared)
            g_rows.extend(g.rows)
            g_ptr.append(len(g_rows))
        if groups:
            rows = torch.tensor(g_rows, dtype=torch.int64)
            shared = torch.repeat_interleave(
                torch.tensor(g_len, dtype=torch.int64),
                torch.tensor([len(g.rows) for g in groups], dtype=torch.int64))
            start[rows] += shared
            length[rows] -= shared
        return cls(
            kv_indices=fb.kv_indices.to("cpu", torch.int32).contiguous(),
            row_start=start,
            row_len=length,
            group_start=torch.tensor(g_start, dtype=torch.int64),
            group_len=torch.tensor(g_len, dtype=torch.int64),
            group_row_ptr=torch.tensor(g_ptr, dtype=torch.int64),
            group_rows=torch.tensor(g_rows, dtype=torch.int64),
        )

    @classmethod
    def for_decode(cls, fb: ForwardBatch, min_shared: int) -> PagedDecodePlan:
        """`build(fb, shared_prefix_groups(...))` for a decode batch on the CPU, groups and plan
        in one C++ call (`radixrt::paged_decode_plan`, the same rules; a step's plan in a few
        microseconds instead of a dozen small tensor ops)."""
        if not fb.is_decode:
            raise ValueError("PagedDecodePlan is for decode batches")
        kv_indices = fb.kv_indices.to("cpu", torch.int32).contiguous()
        parts = torch.ops.radixrt.paged_decode_plan(kv_indices, fb.kv_indptr.to("cpu", torch.int32),
                                                    min_shared)
        return cls(kv_indices, *parts)

    def run_pool(self, q: torch.Tensor, pool: TokenToKVPool, layer_id: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` over layer `layer_id` of `pool`; an int8 pool goes to `paged_decode_i8`
        (queries and output in q's dtype)."""
        if not pool.quantized:
            return self.run(q, pool.k_buffer[layer_id], pool.v_buffer[layer_id], scale)
        return torch.ops.radixrt.paged_decode_i8(
            q.contiguous(), pool.k_buffer[layer_id], pool.v_buffer[layer_id],
            pool.k_scale[layer_id], pool.v_scale[layer_id], *self.tensors(), float(scale))

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(`[B, H, D]` attention output in q's dtype, `[B, H]` natural-log LSE in fp32) of the
        queries `q` `[B, H, D]` over the pool buffers `[slots, kv_heads, D]` (fp32 queries over
        a float16 pool as they are, else in the pool's dtype)."""
        out, lse = torch.ops.radixrt.paged_decode(
            queries_for_pool(q, k_buffer), k_buffer, v_buffer, *self.tensors(), float(scale))
        return out.to(q.dtype), lse
