"""The two lower cache levels: request rows (`ReqToTokenPool`) and KV storage (`TokenToKVPool`).

Ownership invariant (checked by `radixrt.mem.invariants`): every KV slot in 1..size is owned by
exactly one of the free list, the prefix cache's tree, or one live request's private tail.
Slot 0 is a dummy that padded positions write to and read from; it is never handed out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from radixrt.core.errors import InvariantError
from radixrt.mem.huge_pages import huge_page_buffer
from radixrt.mem.kv_quant import dequantize_rows, quantize_rows

# Up to this many one-slot rows, `ReqToTokenPool.write` stores them in a Python loop: a decode
# step's write runs right after the previous step flushed the caches, where numpy's fancy
# indexing costs ~75 us and the loop ~25-35 us (8-64 rows).
_LOOP_WRITE_MAX = 128

logger = logging.getLogger(__name__)


class ReqToTokenPool:
    """Rows of slot indices: row `r` lists the KV slot of every token of the request holding `r`.

    A request takes a row at admission and returns it when it finishes or is retracted.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self._table = self.req_to_token.numpy() if self.req_to_token.is_cpu else None
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"row {row} out of range")
        self._free_rows.append(row)

    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    def write(self, rows: Sequence[int], starts: Sequence[int], lens: Sequence[int],
              slots: torch.Tensor) -> None:
        """Row `rows[b]` gets the next `lens[b]` of `slots` at columns `starts[b]`, ... (one
        scatter for the whole batch; `slots` is the concatenation in batch order)."""
        lens = list(lens)
        n = sum(lens)
        if int(slots.numel()) != n:
            raise ValueError(f"write: {slots.numel()} slots for {n} positions")
        if n == 0:
            return
        table = self._table
        if table is not None and slots.is_cpu:
            # numpy views of the table: a decode step's one slot per row in microseconds
            if n <= _LOOP_WRITE_MAX and all(ln == 1 for ln in lens):
                for r, st, slot in zip(rows, starts, slots.tolist(), strict=True):
                    table[r, st] = slot  # (a few cold numpy calls cost more)
                return
            src = slots.reshape(-1).numpy()
            if all(ln == 1 for ln in lens):
                table[np.asarray(list(rows), dtype=np.int64),
                      np.asarray(list(starts), dtype=np.int64)] = src
                return
            off = 0
            for r, st, ln in zip(rows, starts, lens, strict=True):
                table[r, st:st + ln] = src[off:off + ln]
                off += ln
            return
        lens_t = torch.tensor(lens, dtype=torch.int64)
        bs = len(lens_t)
        which = torch.repeat_interleave(torch.arange(bs), lens_t)
        first = torch.zeros(bs, dtype=torch.int64)
        torch.cumsum(lens_t[:-1], 0, out=first[1:])
        cols = torch.tensor(list(starts), dtype=torch.int64)[which] + (
            torch.arange(n, dtype=torch.int64) - first[which])
        row_idx = torch.tensor(list(rows), dtype=torch.int64)[which]
        dev = self.req_to_token.device
        self.req_to_token[row_idx.to(dev), cols.to(dev)] = slots.to(dev, torch.int32)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))

    def check_invariants(self) -> None:
        rows = self._free_rows
        if len(set(rows)) != len(rows):
            raise InvariantError("a request row is on the free list twice")
        if not all(0 <= r < self.size for r in rows):
            raise InvariantError("free row out of range")


class TokenToKVPool:
    """Per-layer K and V buffers `[size + 1, kv_heads, head_dim]` plus the free-slot allocator.

    `kv_dtype=torch.int8` (`--kv-cache-dtype int8`, CPU only) stores every (slot, KV head) row
    as int8 codes plus one fp32 scale in `k_scale` / `v_scale` `[size + 1, kv_heads]` (the row
    is codes * scale, `mem/kv_quant.py`); `dtype` stays the compute dtype that `read_kv`
    returns. `kv_dtype=torch.float16` under a float32 `dtype` (`--kv-cache-dtype float16`, CPU
    only; `narrowed`) stores K/V rounded to half and `read_kv` widens them back to float32.
    Otherwise the buffers hold `dtype` and the scale lists are empty.

    Layout: on CPU the buffers are head-major views (`storage[kv_heads, slots, head_dim]`
    transposed, slot stride `head_dim`), so one KV head's keys over a run of slots are contiguous
    and the paged-decode kernel streams them (0.75-0.82x the time from memory of slot-major:
    bench/results/2026-11-24-decode-step-s21.md). On CUDA they are contiguous (slot-major), the
    layout FlashInfer's paged kernels take. Code indexes them by slot either way; kernels read
    the strides.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        huge_pages: bool = True,
        head_major: bool | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        """`huge_pages` (CPU only): every buffer lives in one 2 MiB-aligned allocation advised
        for transparent huge pages (`mem/huge_pages.py`). `head_major`: the layout above; None
        picks it by device (head-major on CPU)."""
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        narrow = dtype == torch.float32 and self.kv_dtype == torch.float16
        if self.kv_dtype not in (dtype, torch.int8) and not narrow:
            raise ValueError(f"kv_dtype must be the compute dtype, torch.int8, or torch.float16 "
                             f"under float32, got {kv_dtype} under {dtype}")
        self.device = torch.device(device)
        if self.quantized and self.device.type != "cpu":
            raise ValueError("an int8 KV cache (kv_cache_dtype=int8) runs on CPU only")
        if narrow and self.device.type != "cpu":
            raise ValueError("a float16 KV cache under a float32 model (kv_cache_dtype=float16) "
                             "runs on CPU only")
        self.head_major = self.device.type == "cpu" if head_major is None else head_major
        storage_shape = ((num_kv_heads, size + 1, head_dim) if self.head_major
                         else (size + 1, num_kv_heads, head_dim))
        # `empty`: pages are committed only when first written. Only slot 0 is ever read before
        # being written (padding), so only it must hold finite values.
        per = (size + 1) * num_kv_heads * head_dim
        store = self.kv_dtype
        if huge_pages and self.device.type == "cpu":
            arena = huge_page_buffer(2 * num_layers * per * store.itemsize).view(store)
            bufs = [arena[i * per:(i + 1) * per].view(storage_shape)
                    for i in range(2 * num_layers)]
        else:
            bufs = [torch.empty(storage_shape, dtype=store, device=device)
                    for _ in range(2 * num_layers)]
        if self.head_major:
            bufs = [b.transpose(0, 1) for b in bufs]
        self.k_buffer, self.v_buffer = bufs[:num_layers], bufs[num_layers:]
        # int8: scales laid out like the codes (head-major: one head's scales over a run of
        # slots are contiguous); zeros, so slot 0 and unwritten slots read as 0.
        scales: list[torch.Tensor] = []
        if self.quantized:
            sshape = storage_shape[:2]
            scales = [torch.zeros(sshape, dtype=torch.float32, device=device)
                      for _ in range(2 * num_layers)]
            if self.head_major:
                scales = [t.transpose(0, 1) for t in scales]
        self.k_scale, self.v_scale = scales[:num_layers], scales[num_layers:]
        for buf in (*self.k_buffer, *self.v_buffer):
            buf[0].zero_()
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size

    # -- allocator -------------------------------------------------------------------------
    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots (int64, on CPU), or None when fewer than `n` are free."""
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        end = self._num_free + n
        if end > self.size:
            raise RuntimeError("freeing more KV slots than the pool holds (double free)")
        self._free[self._num_free : end] = slots.to(torch.int64).flatten().cpu()
        self._num_free = end

    def free_slots(self) -> torch.Tensor:
        return self._free[: self._num_free]

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._num_free = self.size

    # -- storage ---------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.kv_dtype == torch.int8

    @property
    def narrowed(self) -> bool:
        """K/V stored as float16 under a float32 compute dtype (widened as read)."""
        return self.kv_dtype == torch.float16 and self.dtype == torch.float32

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.quantized:
            for buf, sc, x in ((self.k_buffer, self.k_scale, k), (self.v_buffer, self.v_scale, v)):
                codes, scale = quantize_rows(x)
                buf[layer_id].index_copy_(0, loc, codes)
                sc[layer_id].index_copy_(0, loc, scale)
            return
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.kv_dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.kv_dtype))

    def read_kv(self, layer_id: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[len(index), kv_heads, head_dim]` at the slots `index`, in `dtype`
        (dequantized for an int8 pool, widened for a narrowed one)."""
        k = torch.index_select(self.k_buffer[layer_id], 0, index)
        v = torch.index_select(self.v_buffer[layer_id], 0, index)
        if not self.quantized:
            return k.to(self.dtype), v.to(self.dtype)
        ks = torch.index_select(self.k_scale[layer_id], 0, index)
        vs = torch.index_select(self.v_scale[layer_id], 0, index)
        return dequantize_rows(k, ks, self.dtype), dequantize_rows(v, vs, self.dtype)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """K or V rows `x` as `read_kv` returns them once stored: in `dtype`, and through the
        int8 format for an int8 pool, through float16 for a narrowed one."""
        if not self.quantized:
            return x.to(self.kv_dtype).to(self.dtype)
        return dequantize_rows(*quantize_rows(x), self.dtype)

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                  self.kv_dtype)

    def check_invariants(self) -> None:
        free = self.free_slots()
        if int(free.numel()) != self._num_free:
            raise InvariantError("free-slot count disagrees with the free list")
        if self._num_free:
            if int(free.min()) < 1 or int(free.max()) > self.size:
                raise InvariantError("free slot out of range")
            if int(torch.unique(free).numel()) != self._num_free:
                raise InvariantError("a KV slot is free twice")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K + V bytes one token takes in a pool storing `dtype` (int8: codes plus fp32 scales)."""
    elem = torch.empty((), dtype=dtype).element_size()
    row = head_dim * elem + (4 if dtype == torch.int8 else 0)
    return 2 * num_layers * num_kv_heads * row
