"""`FlashInferBackend`: CUDA attention through FlashInfer's batch wrappers, page size 1.

Extend (prefill, possibly on top of a cached prefix), per layer:
- ragged pass: the new tokens attend to themselves, causal, via
  `BatchPrefillWithRaggedKVCacheWrapper` (qo_indptr = kv_indptr = `fb.qo_indptr`);
- paged pass (only when some request has a cached prefix): the new tokens attend to the prefix,
  non-causal, via `BatchPrefillWithPagedKVCacheWrapper` over `fb.kv_indptr` / `fb.kv_indices`;
- both return a base-2 log-sum-exp and `flashinfer.merge_state` combines them. A request with
  no prefix has an empty paged part (output 0, LSE -inf), which the merge ignores.
Decode: `BatchDecodeWithPagedKVCacheWrapper` over all of each request's slots (`fb.kv_indices`
includes the slot this step writes), with tensor cores when the GQA group is >= 4.

The pool stores per-layer K and V as `[size + 1, kv_heads, head_dim]`; with page size 1 that is
FlashInfer's NHD paged layout `[num_pages, page_size=1, kv_heads, head_dim]` through
`.unsqueeze(1)` views, passed as a `(k, v)` tuple. No copy is made.

Invariants:
- `plan()` runs once per batch, in `init_forward_metadata`, and every layer reuses it. Plans get
  their indptr / last_page_len arrays as host int32 tensors built from the batch's `*_cpu` lists
  (FlashInfer reads them on the host anyway, so nothing waits on the device); `kv_indices` is
  the batch's device tensor. `forward` launches kernels only: no host-device synchronisation.
- `forward` writes the new tokens' K/V into the pool (`kv_pool.set_kv`) before attending; the
  paged passes read only slots that hold valid K/V at that point.
- The softmax scale is fixed at plan time; `forward` rejects a different `scaling`.
- FlashInfer kernels need fp16 / bf16 K/V; the real module is refused for other pool dtypes.

The `flashinfer` module is injectable: tests pass a pure-torch stand-in with the same call
surface, so the whole backend runs (and its calls are checked against the real signatures) on
CPU.
"""

from __future__ import annotations

import logging
import math
from itertools import accumulate
from types import ModuleType
from typing import Any

import torch

from radixrt.attention.base import AttentionBackend
from radixrt.core.forward_batch import ForwardBatch
from radixrt.mem.memory_pool import TokenToKVPool

logger = logging.getLogger(__name__)

# FlashInfer's recommended float workspace (split-KV partial results); shared by all wrappers.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
# SGLang's rule: tensor-core decode pays off once >= 4 query heads share a KV head.
TENSOR_CORE_MIN_GQA_GROUP = 4
SUPPORTED_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
KV_LAYOUT = "NHD"
PAGE_SIZE = 1


class FlashInferUnavailableError(RuntimeError):
    """`attention_backend="flashinfer"` was asked for where it cannot run."""


def import_flashinfer() -> ModuleType | None:
    """The `flashinfer` package, or None when it is not installed or fails to import."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a broken install raising anything at import
        logger.debug("flashinfer does not import: %s", e)
        return None
    return flashinfer


def flashinfer_unavailable_reason(
    device: torch.device, kv_dtype: torch.dtype, num_q_heads: int | None
) -> str | None:
    """Why the real FlashInfer backend cannot serve this setup, or None when it can.

    Checks the cheap conditions first so CPU runs never import flashinfer.
    """
    if device.type != "cuda":
        return f"FlashInfer needs a CUDA device, got {device}"
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        return f"FlashInfer kernels need a float16/bfloat16 KV cache, got {kv_dtype}"
    if num_q_heads is None:
        return "the number of query heads was not given (create_attention_backend(num_q_heads=))"
    if import_flashinfer() is None:
        return "the flashinfer package does not import (pip install -e '.[cuda]')"
    return None


def decode_use_tensor_cores(kv_dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> bool:
    """Tensor-core (prefill-kernel) decode for fp16/bf16 when the GQA group is large enough."""
    group = num_q_heads // num_kv_heads
    return kv_dtype in SUPPORTED_KV_DTYPES and group >= TENSOR_CORE_MIN_GQA_GROUP


def merge_state_max_heads(head_dim: int, elem_size: int) -> int:
    """Most heads `flashinfer.merge_state` can launch: its block is (head_dim / vec, heads)
    threads, vec = max(16 / elem_size, head_dim / 32), and a block holds at most 1024 threads."""
    vec = max(16 // elem_size, head_dim // 32)
    return 1024 // max(1, head_dim // vec)


def merge_state_torch(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> torch.Tensor:
    """`merge_state`'s output in torch (base-2 LSEs `[n, heads]`, values `[n, heads, dim]`)."""
    s_max = torch.maximum(s_a, s_b)
    w_a = torch.exp2(s_a - s_max).unsqueeze(-1)
    w_b = torch.exp2(s_b - s_max).unsqueeze(-1)
    return ((v_a.float() * w_a + v_b.float() * w_b) / (w_a + w_b)).to(v_a.dtype)


def host_indptr(lengths: list[int]) -> torch.Tensor:
    """int32 `[len(lengths) + 1]` exclusive prefix sum, on the host."""
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)


class FlashInferBackend(AttentionBackend):
    """FlashInfer ragged + paged prefill (merged by `merge_state`) and paged decode."""

    def __init__(
        self,
        kv_pool: TokenToKVPool,
        num_q_heads: int,
        device: torch.device | str | None = None,
        *,
        sm_scale: float | None = None,
        flashinfer: Any = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ):
        """`flashinfer`: the module to call (default: import the real one). `sm_scale`: the
        softmax scale every layer uses (default `head_dim ** -0.5`)."""
        super().__init__(kv_pool)
        fi = flashinfer if flashinfer is not None else import_flashinfer()
        if fi is None:
            raise FlashInferUnavailableError("the flashinfer package does not import")
        if flashinfer is None and kv_pool.dtype not in SUPPORTED_KV_DTYPES:
            raise FlashInferUnavailableError(
                f"FlashInfer kernels need a float16/bfloat16 KV cache, got {kv_pool.dtype}"
            )
        if kv_pool.quantized:
            raise ValueError("kv_cache_dtype=int8 is CPU-only; FlashInfer needs a "
                             "float16/bfloat16 KV cache")
        if kv_pool.head_major:
            raise ValueError("FlashInfer's paged kernels need a slot-major KV pool "
                             "(TokenToKVPool(head_major=False), the default on CUDA)")
        if num_q_heads % kv_pool.num_kv_heads:
            raise ValueError(
                f"{num_q_heads} query heads are not a multiple of {kv_pool.num_kv_heads} KV heads"
            )
        self.fi = fi
        self.device = torch.device(device) if device is not None else kv_pool.device
        self.num_q_heads = num_q_heads
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = kv_pool.head_dim
        self.dtype = kv_pool.dtype
        self.sm_scale = float(sm_scale) if sm_scale is not None else self.head_dim**-0.5
        self.use_tensor_cores = decode_use_tensor_cores(
            self.dtype, num_q_heads, self.num_kv_heads
        )
        # Too many heads for merge_state's launch: merge with torch (same formula, a few kernels).
        self.merge_in_torch = num_q_heads > merge_state_max_heads(
            self.head_dim, torch.empty((), dtype=self.dtype).element_size()
        )
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, KV_LAYOUT)
        self.paged = fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, KV_LAYOUT, backend="fa2"
        )
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, KV_LAYOUT, use_tensor_cores=self.use_tensor_cores, backend="fa2"
        )
        self._planned_for: ForwardBatch | None = None
        self._has_prefix = False  # extend: some request attends to a cached prefix
        self._decode_wrapper: Any = self.decode  # eager wrapper, or a CUDA-graph bucket's
        # CUDA-graph decode state (see `init_cuda_graph_state`).
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._graph_decode: dict[int, Any] = {}

    # -- per step ----------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._planned_for = None  # until the plans below succeed
        if fb.is_decode:
            self._plan_decode(self.decode, fb)
            self._decode_wrapper = self.decode
            self._planned_for = fb
            return
        qo_indptr = host_indptr(fb.extend_lens_cpu)
        self.ragged.plan(
            qo_indptr,
            qo_indptr,  # the ragged K/V are the new tokens themselves
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            causal=True,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self._has_prefix = any(fb.prefix_lens_cpu)
        if self._has_prefix:
            self.paged.plan(
                qo_indptr,
                host_indptr(fb.prefix_lens_cpu),  # == fb.kv_indptr: cached prefix only
                fb.kv_indices,
                torch.ones(fb.batch_size, dtype=torch.int32),
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                PAGE_SIZE,
                causal=False,  # every prefix token precedes every new token
                sm_scale=self.sm_scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
        self._planned_for = fb

    def _plan_decode(self, wrapper: Any, fb: ForwardBatch) -> None:
        wrapper.plan(
            host_indptr(fb.seq_lens_cpu),  # == fb.kv_indptr: every slot, this step's included
            fb.kv_indices,
            torch.ones(fb.batch_size, dtype=torch.int32),
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            PAGE_SIZE,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    # -- CUDA graphs (decode) ----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_kv_tokens: int) -> None:
        """Fixed-address index buffers shared by every captured decode bucket.

        `max_kv_tokens` bounds `sum(seq_lens)` of a padded decode batch (pool size + max_bs).
        """
        dev = self.device
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._graph_indices = torch.zeros(max_kv_tokens, dtype=torch.int32, device=dev)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._graph_decode = {}

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        """Before capturing decode at `fb.batch_size`: a CUDA-graph wrapper bound to the fixed
        buffers, planned for `fb`, used by the `forward` calls being captured."""
        if self._graph_indptr is None or self._graph_indices is None:
            raise RuntimeError("init_cuda_graph_state must run before capture")
        assert self._graph_last_page_len is not None
        if not fb.is_decode:
            raise ValueError("only decode batches are captured")
        bs = fb.batch_size
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
            backend="fa2",
        )
        self._graph_decode[bs] = wrapper
        self._planned_for = None
        self._plan_decode(wrapper, fb)
        self._decode_wrapper = wrapper
        self._planned_for = fb

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        """Before replaying the graph captured at `fb.batch_size` (a padded decode batch):
        re-plan its wrapper, which copies the new indices into the captured buffers."""
        wrapper = self._graph_decode.get(fb.batch_size)
        if wrapper is None or not fb.is_decode:
            raise ValueError(f"no decode graph was captured for batch size {fb.batch_size}")
        self._planned_for = None
        self._plan_decode(wrapper, fb)
        self._decode_wrapper = wrapper
        self._planned_for = fb

    # -- per layer ---------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        if fb is not self._planned_for:
            raise RuntimeError("init_forward_metadata(fb) was not called for this batch")
        if not math.isclose(scaling, self.sm_scale, rel_tol=1e-6):
            raise ValueError(
                f"layer {layer_id} uses softmax scale {scaling}, the plan has {self.sm_scale} "
                "(pass sm_scale= to the backend)"
            )
        pool = self.kv_pool
        k = k.to(pool.dtype).contiguous()
        v = v.to(pool.dtype).contiguous()
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        q = q.contiguous()
        # NHD pages of one token: [size + 1, 1, kv_heads, head_dim] views of the pool.
        kv_cache = (pool.k_buffer[layer_id].unsqueeze(1), pool.v_buffer[layer_id].unsqueeze(1))
        if fb.is_decode:
            return self._decode_wrapper.run(q, kv_cache)
        if not self._has_prefix:
            return self.ragged.run(q, k, v)
        o_new, lse_new = self.ragged.run(q, k, v, return_lse=True)
        o_prefix, lse_prefix = self.paged.run(q, kv_cache, return_lse=True)
        if self.merge_in_torch:
            return merge_state_torch(o_new, lse_new, o_prefix, lse_prefix)
        out, _ = self.fi.merge_state(o_new, lse_new, o_prefix, lse_prefix)
        return out
