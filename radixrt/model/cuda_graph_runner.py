"""`CudaGraphRunner`: decode steps replayed from CUDA graphs captured at batch-size buckets.

A decode batch of size `bs` runs as the graph of the smallest captured bucket `B >= bs`. The
graph reads fixed-address input buffers (token ids, positions, KV write slots) and the
FlashInfer decode wrapper's fixed index buffers; `replay` copies the live batch into them, pads
rows `bs..B-1` and re-plans the bucket's wrapper (outside the graph), then replays.

Padding invariant: a padded row has token 0 at position 0, writes its K/V to the dummy slot 0
and attends to that one slot (seq_len 1), so it is finite and touches no live slot; its logits
are dropped.

Conservative by design: decode only, FlashInfer backend only (the torch-native plans have
data-dependent shapes), buckets 1, 2, 4, ... up to `max_bs`, eager fallback for larger batches.
Constructed only on CUDA; `ServerArgs.disable_cuda_graph` is meant to skip it entirely.
"""

from __future__ import annotations

import logging

import torch

from radixrt.attention.flashinfer import FlashInferBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Powers of two below `max_bs`, then `max_bs` itself: [1, 2, 4, ..., max_bs]."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes: list[int] = []
    b = 1
    while b < max_bs:
        sizes.append(b)
        b *= 2
    sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captures `model`'s decode forward at each bucket in `capture_batch_sizes(max_bs)`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: FlashInferBackend,
        max_bs: int,
        max_kv_tokens: int,
    ):
        """`max_kv_tokens`: the KV pool size (a decode batch never lists more live slots)."""
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        if not isinstance(backend, FlashInferBackend):
            raise TypeError("CUDA-graph decode needs the FlashInfer attention backend")
        if model.attn_backend is not backend:
            raise ValueError("the model must run with the backend being captured")
        self.model = model
        self.backend = backend
        self.buckets = capture_batch_sizes(max_bs)
        self.max_bs = self.buckets[-1]
        dev = model.device
        n = self.max_bs
        # Fixed-address inputs the graphs read; rows >= the live batch hold padding.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.arange = torch.arange(n, dtype=torch.int64, device=dev)  # decode logits rows
        self.zeros_i64 = torch.zeros(n, dtype=torch.int64, device=dev)
        self.ones_i64 = torch.ones(n, dtype=torch.int64, device=dev)
        self.zeros_i32 = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.ones_i32 = torch.ones(n, dtype=torch.int32, device=dev)
        backend.init_cuda_graph_state(n, max_kv_tokens + n)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.is_decode and fb.batch_size <= self.max_bs

    def _bucket(self, bs: int) -> int:
        return next(b for b in self.buckets if b >= bs)

    def _static_batch(self, bs: int, seq_lens_cpu: list[int], kv_indices: torch.Tensor) -> ForwardBatch:
        """A decode batch of `bs` rows over the fixed input buffers. Only the fields the model
        and the backend read are live; the rest are placeholders of the right shape."""
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.zeros_i64[:bs],
            seq_lens=self.ones_i64[:bs],
            prefix_lens=self.zeros_i64[:bs],
            extend_lens=self.ones_i64[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            qo_indptr=self.zeros_i32[: bs + 1],
            kv_indptr=self.zeros_i32[: bs + 1],
            kv_indices=kv_indices,
            kv_last_page_len=self.ones_i32[:bs],
            logits_indices=self.arange[:bs],
            seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=[s - 1 for s in seq_lens_cpu],
            extend_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            # Every captured row is a padding row (dummy slot 0, seq_len 1).
            self.input_ids[:bs].zero_()
            self.positions[:bs].zero_()
            self.out_cache_loc[:bs].zero_()
            fb = self._static_batch(bs, [1] * bs, self.zeros_i32[:bs])
            self.backend.init_forward_metadata_capture(fb)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: lazy init, allocator, kernel selection
                    self.model(fb)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(fb)
            pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits `[fb.batch_size, vocab]`, as `model(fb)` would return them."""
        if not self.can_run(fb):
            raise ValueError(f"cannot replay a {fb.mode.value} batch of {fb.batch_size}")
        bs = fb.batch_size
        b = self._bucket(bs)
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        kv_indices = fb.kv_indices
        if b > bs:
            self.input_ids[bs:b].zero_()
            self.positions[bs:b].zero_()
            self.out_cache_loc[bs:b].zero_()
            kv_indices = torch.cat([kv_indices, self.zeros_i32[: b - bs]])
        padded = self._static_batch(b, list(fb.seq_lens_cpu) + [1] * (b - bs), kv_indices)
        self.backend.init_forward_metadata_replay(padded)
        self.graphs[b].replay()
        # The output buffer is overwritten by the next replay: hand out a copy.
        return self.outputs[b][:bs].clone()
