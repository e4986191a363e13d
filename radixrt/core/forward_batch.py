"""`ForwardBatch`: one step's batch metadata, built once per step and read by every backend.

Layout follows FlashInfer with page size 1, so the CUDA backend consumes it unchanged:
- extend: `qo_indptr` splits the new tokens per request; `kv_indptr`/`kv_indices` list the
  *cached prefix* slots of each request (the paged part); the new tokens' own K/V come from the
  current forward pass (the ragged part), causal within the request.
- decode: one new token per request; `kv_indptr`/`kv_indices` list *all* of each request's slots,
  including the one this step writes.
The new tokens' K/V are written to `out_cache_loc` before attention reads the pool.

`build` is pure: it only reads the request-to-token table. Whoever allocates the step's slots
(the scheduler's KV owner, or a test) writes them into the rows first, at columns
`prefix_len .. prefix_len + extend_len`; `out_cache_loc` is read back from there.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (or a chunk of it), possibly on top of a cached prefix
    DECODE = "decode"  # one token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [B]
    seq_lens: torch.Tensor  # int64 [B]: tokens in KV after this step
    prefix_lens: torch.Tensor  # int64 [B]: tokens in KV before this step
    extend_lens: torch.Tensor  # int64 [B]: tokens computed this step (1 in decode)
    out_cache_loc: torch.Tensor  # int64 [num_tokens]: where this step's K/V go
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # int32 [B], all ones (page size 1)
    logits_indices: torch.Tensor  # int64 [B]: the token row whose logits each request samples
    # Host copies, so backends never synchronise with the device to read lengths.
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Prompt scoring (extend only; None when no request asks): token rows whose logits score
    # the next prompt token, and that token's id. Set by the scheduler's batch builder.
    score_rows: torch.Tensor | None = None  # int64 [S]
    score_targets: torch.Tensor | None = None  # int64 [S]
    # Run this extend step batch-invariant (every token's K/V and logits a bitwise function of
    # its own token prefix); set when the batch scores prompt tokens. See `AttentionBackend`.
    batch_invariant: bool = False
    # Extend steps: rows from this index on are running requests' decode rows (a mixed step);
    # the rows before it compute prompt tokens, which always take the extend path, even one
    # token (so a prompt token's result does not depend on how much of the prompt was cached).
    # None: not told (a backend may take every 1-token row for a decode row).
    decode_rows_from: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: Sequence[int] | torch.Tensor,
        req_pool_indices: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        req_to_token: torch.Tensor,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Derive every index tensor from the rows of `req_to_token`, which must already hold
        each request's `prefix_len + extend_len` slots. Writes nothing.

        `input_ids` is the concatenation of each request's new tokens, in batch order.
        """
        prefix = list(prefix_lens)
        ext = list(extend_lens)
        if mode is ForwardMode.DECODE and any(e != 1 for e in ext):
            raise ValueError("decode batches compute exactly one token per request")
        if (mode is ForwardMode.DECODE and req_to_token.device.type == "cpu"
                and torch.device(device).type == "cpu"):
            return cls._build_decode_cpu(input_ids, req_pool_indices, prefix, req_to_token)
        return cls._build_general(mode, input_ids, req_pool_indices, prefix, ext, req_to_token,
                                  device)

    @classmethod
    def _build_general(cls, mode: ForwardMode, input_ids: Sequence[int] | torch.Tensor,
                       req_pool_indices: Sequence[int], prefix: list[int], ext: list[int],
                       req_to_token: torch.Tensor, device: torch.device | str) -> ForwardBatch:
        """`build` for any batch and device, in batched torch index ops."""
        bs = len(req_pool_indices)
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        rows = torch.tensor(list(req_pool_indices), dtype=torch.int64)
        prefix_t = torch.tensor(prefix, dtype=torch.int64)
        ext_t = torch.tensor(ext, dtype=torch.int64)
        seq_t = prefix_t + ext_t
        num_tokens = sum(ext)

        qo_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        torch.cumsum(ext_t, 0, out=qo_indptr[1:])
        starts = qo_indptr[:-1]
        # Token t of request b sits at position prefix_b + (t - start_b).
        tok_req = torch.repeat_interleave(torch.arange(bs), ext_t)
        offs = torch.arange(num_tokens, dtype=torch.int64) - starts[tok_req]
        positions = prefix_t[tok_req] + offs

        rtt = req_to_token
        loc = rtt[rows[tok_req].to(rtt.device), positions.to(rtt.device)].to(torch.int64)

        kv_lens = seq_t if mode is ForwardMode.DECODE else prefix_t
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        torch.cumsum(kv_lens, 0, out=kv_indptr[1:])
        kv_req = torch.repeat_interleave(torch.arange(bs), kv_lens)
        kv_cols = torch.arange(int(kv_indptr[-1]), dtype=torch.int64) - kv_indptr[:-1][kv_req]
        kv_indices = rtt[rows[kv_req].to(rtt.device), kv_cols.to(rtt.device)]

        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        dev = torch.device(device)
        return cls(
            mode=mode,
            batch_size=bs,
            input_ids=ids.to(dev),
            positions=positions.to(dev),
            req_pool_indices=rows.to(dev),
            seq_lens=seq_t.to(dev),
            prefix_lens=prefix_t.to(dev),
            extend_lens=ext_t.to(dev),
            out_cache_loc=loc.to(dev),
            qo_indptr=qo_indptr.to(dev, torch.int32),
            kv_indptr=kv_indptr.to(dev, torch.int32),
            kv_indices=kv_indices.to(dev, torch.int32),
            kv_last_page_len=torch.ones(bs, dtype=torch.int32, device=dev),
            logits_indices=(qo_indptr[1:] - 1).to(dev),
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=ext,
        )

    @classmethod
    def _build_decode_cpu(cls, input_ids: Sequence[int] | torch.Tensor,
                          req_pool_indices: Sequence[int], prefix: list[int],
                          req_to_token: torch.Tensor) -> ForwardBatch:
        """`build` for a decode batch whose table and tensors live on the CPU: the same tensors
        (values and dtypes) as `_build_general`. It runs right after the previous step has
        flushed the caches, where each small tensor or numpy op costs ~10 us, so it takes one
        C++ call when the kernel library is loaded (`radixrt::decode_batch_rows`, registered by
        radixrt/attention/cpu_kernels.py and looked up here by name, not imported: ~75 us cold),
        else `_build_decode_numpy` (~180 us)."""
        rows_op = getattr(torch.ops.radixrt, "decode_batch_rows", None)
        if rows_op is None or req_to_token.dtype != torch.int32:
            return cls._build_decode_numpy(input_ids, req_pool_indices, prefix, req_to_token)
        ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids
        longs, ints, kv = rows_op(ids, req_pool_indices, prefix, req_to_token)
        return cls._decode_from_rows(longs, ints, kv, prefix)

    @classmethod
    def _build_decode_numpy(cls, input_ids: Sequence[int] | torch.Tensor,
                            req_pool_indices: Sequence[int], prefix: list[int],
                            req_to_token: torch.Tensor) -> ForwardBatch:
        """`_build_decode_cpu` in numpy: every int64 field a row of one array, every int32
        index pointer a row of another, and the table's rows."""
        bs = len(req_pool_indices)
        table = req_to_token.numpy()
        # int64 rows: input_ids, positions, req_pool_indices, seq_lens, extend_lens,
        # out_cache_loc, logits_indices, prefix_lens (= positions, its own tensor)
        longs = np.empty((8, bs), dtype=np.int64)
        longs[0] = input_ids.numpy() if isinstance(input_ids, torch.Tensor) else input_ids
        longs[1] = prefix
        longs[2] = req_pool_indices
        np.add(longs[1], 1, out=longs[3])
        longs[4] = 1
        longs[5] = table[longs[2], longs[1]]
        longs[6] = np.arange(bs)
        longs[7] = longs[1]
        # int32 rows (bs + 1): qo_indptr, kv_indptr, kv_last_page_len (its first bs)
        ints = np.empty((3, bs + 1), dtype=np.int32)
        ints[0] = np.arange(bs + 1)
        ints[1, 0] = 0
        np.cumsum(longs[3], out=ints[1, 1:])
        ints[2] = 1
        seq = longs[3].tolist()
        if bs:
            kv = np.concatenate([table[r, :n] for r, n in zip(req_pool_indices, seq, strict=True)])
        else:
            kv = np.zeros(0, dtype=table.dtype)
        return cls._decode_from_rows(torch.from_numpy(longs), torch.from_numpy(ints),
                                     torch.from_numpy(kv.astype(np.int32, copy=False)), prefix)

    @classmethod
    def _decode_from_rows(cls, longs: torch.Tensor, ints: torch.Tensor, kv: torch.Tensor,
                          prefix: list[int]) -> ForwardBatch:
        """A CPU decode batch from `_build_decode_cpu`'s arrays: `longs` int64 [8, B] (ids,
        positions, rows, seq_lens, extend_lens, out_cache_loc, logits_indices, prefix_lens),
        `ints` int32 [3, B + 1] (qo_indptr, kv_indptr, ones), `kv` the int32 kv_indices."""
        bs = len(prefix)
        ids, pos, rows, seq_t, ext, loc, last, pre = longs.unbind(0)
        qo, kv_indptr, ones = ints.unbind(0)
        return cls(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=ids,
            positions=pos,
            req_pool_indices=rows,
            seq_lens=seq_t,
            prefix_lens=pre,
            extend_lens=ext,
            out_cache_loc=loc,
            qo_indptr=qo,
            kv_indptr=kv_indptr,
            kv_indices=kv,
            kv_last_page_len=ones[:bs],
            logits_indices=last,
            seq_lens_cpu=[p + 1 for p in prefix],
            prefix_lens_cpu=prefix,
            extend_lens_cpu=[1] * bs,
        )

    def split_rows(self, rows: Sequence[int], as_decode: bool = False) -> ForwardBatch:
        """This extend batch restricted to `rows` (ascending), token rows renumbered from 0.

        With `as_decode`, every row must compute one token, and the result has the decode
        layout: `kv_indices` lists each row's prefix slots followed by the slot it writes this
        step. Used by backends that attend a mixed step's decode rows apart from its prefill
        rows; prompt-scoring fields are not carried (scoring steps never split).
        """
        if self.is_decode:
            raise ValueError("split_rows is for extend batches")
        rows_t = torch.tensor(list(rows), dtype=torch.int64)
        qo = self.qo_indptr.to("cpu", torch.int64)
        kvp = self.kv_indptr.to("cpu", torch.int64)
        ext = [self.extend_lens_cpu[b] for b in rows]
        pre = [self.prefix_lens_cpu[b] for b in rows]
        if as_decode and any(e != 1 for e in ext):
            raise ValueError("as_decode needs rows that compute exactly one token")
        tok = torch.cat([torch.arange(int(qo[b]), int(qo[b + 1])) for b in rows])
        kv_parts = []
        for b in rows:
            kv_parts.append(self.kv_indices[int(kvp[b]):int(kvp[b + 1])])
            if as_decode:
                kv_parts.append(self.out_cache_loc[int(qo[b]):int(qo[b + 1])].to(
                    self.kv_indices.dtype))
        kv_indices = torch.cat(kv_parts)
        kv_lens = torch.tensor([p + e for p, e in zip(pre, ext, strict=True)] if as_decode
                               else pre, dtype=torch.int64)
        ext_t = torch.tensor(ext, dtype=torch.int64)
        dev = self.input_ids.device
        qo_new = torch.zeros(len(ext) + 1, dtype=torch.int64)
        torch.cumsum(ext_t, 0, out=qo_new[1:])
        kv_new = torch.zeros(len(ext) + 1, dtype=torch.int64)
        torch.cumsum(kv_lens, 0, out=kv_new[1:])
        tok_d = tok.to(dev)
        rows_d = rows_t.to(dev)
        return ForwardBatch(
            mode=ForwardMode.DECODE if as_decode else ForwardMode.EXTEND,
            batch_size=len(ext),
            input_ids=self.input_ids[tok_d],
            positions=self.positions[tok_d],
            req_pool_indices=self.req_pool_indices[rows_d],
            seq_lens=self.seq_lens[rows_d],
            prefix_lens=self.prefix_lens[rows_d],
            extend_lens=self.extend_lens[rows_d],
            out_cache_loc=self.out_cache_loc[tok_d],
            qo_indptr=qo_new.to(dev, torch.int32),
            kv_indptr=kv_new.to(dev, torch.int32),
            kv_indices=kv_indices,
            kv_last_page_len=torch.ones(len(ext), dtype=torch.int32, device=dev),
            logits_indices=(qo_new[1:] - 1).to(dev),
            seq_lens_cpu=[p + e for p, e in zip(pre, ext, strict=True)],
            prefix_lens_cpu=pre,
            extend_lens_cpu=ext,
        )
