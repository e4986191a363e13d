"""`TorchNativeBackend`: attention with `scaled_dot_product_attention` over the paged KV pool.

Execution plans, chosen once per step in `init_forward_metadata`:
- kernel (decode on CPU, when the C++ op is available): `torch.ops.radixrt.paged_decode` reads
  each request's K/V in place from the pool (no gather), cascade groups included; see
  `paged_decode.py`.
- split (extend on CPU with the decode op, when some decode rows compute one token: a mixed
  step's, `ForwardBatch.decode_rows_from`): those rows go to the paged-decode op as a decode sub-batch
  (`ForwardBatch.split_rows`; cascade reads their shared prefix once per group), the others to
  the extend plan of their own sub-batch (one of the three below).
- extend kernel (extend on CPU when the C++ op is available and the step is not
  batch-invariant): `torch.ops.radixrt.extend_attention` reads each request's
  prefix and new K/V in place from the pool, causal limit offset by the prefix length; see
  `extend_attention.py`. Every other case below is the torch path (CUDA, no compiler, or
  disabled).
- padded: the batch becomes `[B, Qmax]` queries against `[B, Kmax]` keys gathered from the pool
  with one `index_select` per layer (slot 0 pads), masked by a float mask built once per step.
  Decode always uses it (Qmax = 1; the query heads of one KV group ride the query-length axis, so
  GQA needs no K/V expansion). Extend uses it when padding wastes at most half the work.
- ragged: one SDPA call per request: its new tokens against its prefix K/V (gathered from the
  pool) concatenated with the new K/V of this pass; the causal mask is offset by the prefix
  length, i.e. query i of a request with prefix P sees keys 0..P+i.
Invariants: every request has >= 1 new token, so no query row is fully masked; the new tokens'
K/V are in the pool (written by `forward`) before any gather reads them; queries have the pool's
dtype (the masks are built in it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.attention.base import MIN_INVARIANT_ROWS, AttentionBackend
from radixrt.attention.cascade import (
    CASCADE_MIN_SHARED,
    SharedPrefixGroup,
    shared_prefix_groups,
)
from radixrt.attention.extend_attention import (
    ExtendAttentionPlan,
    ExtendStepPlan,
    extend_kernel_unavailable_reason,
)
from radixrt.attention.paged_decode import PagedDecodePlan, paged_decode_unavailable_reason
from radixrt.core.forward_batch import ForwardBatch
from radixrt.mem.memory_pool import TokenToKVPool

__all__ = ["CASCADE_MIN_SHARED", "TorchNativeBackend"]

logger = logging.getLogger(__name__)

# Extend runs padded when B * Qmax * Kmax <= this factor times the useful sum(q_b * k_b).
PADDED_WASTE_FACTOR = 2.0
# Batch-invariant extend: keys are processed in blocks of this size, aligned to position 0.
INVARIANT_KEY_BLOCK = 64


@dataclass
class _PaddedPlan:
    kv_index: torch.Tensor  # int64 [B * Kmax]: pool slot per padded key (0 = padding)
    kmax: int
    qmax: int
    mask: torch.Tensor  # float [B, 1, Qmax, Kmax]: 0 where visible, -inf elsewhere
    q_rows: torch.Tensor | None  # int64 [num_tokens]: padded row b * Qmax + i of each token


@dataclass
class _CascadePlan:
    """Decode as two passes merged by log-sum-exp: each group's shared prefix (gathered once for
    the group, all groups in one padded batch), then every request's own suffix (padded; always
    >= 1 key: the token written this step)."""

    num_groups: int
    nmax: int  # largest group
    shared_index: torch.Tensor  # int64 [num_groups * Lmax] (0 = padding)
    shared_mask: torch.Tensor  # float [num_groups, 1, 1, Lmax]
    grouped_rows: torch.Tensor  # int64 [R]: batch rows that belong to a group
    grouped_slots: torch.Tensor  # int64 [R]: their place, group * nmax + rank in group
    suffix_index: torch.Tensor  # int64 [B * Smax] (0 = padding)
    suffix_mask: torch.Tensor  # float [B, 1, 1, Smax]


@dataclass
class _RaggedReq:
    q_start: int
    q_end: int
    prefix_index: torch.Tensor | None  # int64 [P] prefix slots, None when P == 0
    mask: torch.Tensor | None  # float [q, P + q] when P > 0 and q > 1, else None
    causal: bool  # P == 0: SDPA's own (top-left) causal mask is the right one


@dataclass
class _InvariantReq:
    q_start: int
    q_end: int
    rows: int  # padded query rows, >= q_end - q_start
    kv_index: torch.Tensor  # int64 [Lpad]: prefix slots, this step's slots, then 0 (padding)
    hidden: torch.Tensor  # bool [rows, Lpad]: True where the key is not visible to the query


class TorchNativeBackend(AttentionBackend):
    """Portable backend (CPU or CUDA) built on `torch.nn.functional.scaled_dot_product_attention`.

    `batch_invariant=True` runs extend steps through `_extend_invariant` instead (decode is
    unchanged): each token's output is then bitwise the same whatever the batch, the split
    between cached prefix and computed tokens, and the chunking.

    `decode_kernel`: None (default) decodes with the C++ paged-decode op on CPU when it builds
    and supports the pool (else the torch path, with one warning); False always takes the
    torch path; True requires the op (RuntimeError saying why when it cannot run).
    `extend_kernel`: the same for extend steps and the C++ extend-attention op
    (`batch_invariant` steps keep `_extend_invariant`). `extend_kernel_available` says whether
    the op can run here; `extend_kernel` may be switched off (and back on, when available)
    between steps.
    """

    def __init__(self, kv_pool: TokenToKVPool, device: torch.device | str | None = None,
                 batch_invariant: bool = False, decode_kernel: bool | None = None,
                 extend_kernel: bool | None = None):
        super().__init__(kv_pool)
        self.device = torch.device(device) if device is not None else kv_pool.device
        self.batch_invariant = batch_invariant
        self.decode_kernel = self._kernel_usable(
            decode_kernel, "paged decode", "torch gather path",
            functools.partial(paged_decode_unavailable_reason, int8_pool=kv_pool.quantized))
        self.extend_kernel_available = self._kernel_usable(
            extend_kernel, "extend attention", "torch SDPA path",
            extend_kernel_unavailable_reason)
        self.extend_kernel = self.extend_kernel_available
        # The new K/V go into the pool with one C++ op (strided sources, no copies) when the CPU
        # kernels are loaded; else `kv_pool.set_kv` (index_copy_ of contiguous copies).
        self._kv_store = self.device.type == "cpu" and _kv_store_available()
        self._kernel: PagedDecodePlan | None = None
        self._extend: ExtendAttentionPlan | None = None
        self._padded: _PaddedPlan | None = None
        self._cascade: _CascadePlan | None = None
        self._ragged: list[_RaggedReq] | None = None
        self._invariant: list[_InvariantReq] | None = None
        # Mixed extend step: (token rows of the 1-token rows, run by `_kernel`; token rows of
        # the others, run by the extend plan of their sub-batch, or None).
        self._split: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._planned_for: ForwardBatch | None = None  # the batch the plan above describes

    def _kernel_usable(self, requested: bool | None, kind: str, fallback: str,
                       reason_fn: Callable[[torch.dtype, int], str | None]) -> bool:
        """Whether the C++ `kind` op runs here: None = when it can, False = never, True =
        required (RuntimeError saying why when it cannot)."""
        if requested is False:
            return False
        reason = ("device is not the CPU" if self.device.type != "cpu" else
                  reason_fn(self.kv_pool.dtype, self.kv_pool.head_dim))
        if reason is not None and requested:
            raise RuntimeError(f"{kind} kernel unavailable: {reason}")
        if reason is not None and self.device.type == "cpu":
            logger.info("%s: %s (%s)", kind, fallback, reason)
        return reason is None

    # -- per step ----------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._padded, self._cascade, self._ragged, self._invariant = None, None, None, None
        self._kernel, self._extend = None, None
        self._split = None
        self._planned_for = fb
        if fb.is_decode:
            if self.decode_kernel:
                self._kernel = PagedDecodePlan.for_decode(fb, CASCADE_MIN_SHARED)
                return
            self._padded = self._plan_decode(fb)
            self._cascade = self._plan_cascade(fb, self._padded, self._decode_groups(fb))
            return
        if self.batch_invariant or fb.batch_invariant:
            self._invariant = self._plan_invariant(fb)
            return
        first = 0 if fb.decode_rows_from is None else fb.decode_rows_from
        single = [b for b, e in enumerate(fb.extend_lens_cpu) if e == 1 and b >= first]
        if self.decode_kernel and single:
            # A mixed step's 1-token decode rows go to the paged-decode op, as in a decode
            # step: its cascade reads a shared prefix once per group (the extend op reads it per
            # row); padded they would cost Qmax rows each, ragged one SDPA call and gather each.
            # A prompt's last token computed alone (the rest cached) stays on the extend path:
            # the decode op sums in another order, and the prompt's first sampled token would
            # then depend on the cache (stop 50: max |logit| difference 0.87 on SmolLM2).
            dec = fb.split_rows(single, as_decode=True)
            self._kernel = PagedDecodePlan.for_decode(dec, CASCADE_MIN_SHARED)
            dec_rows = set(single)
            multi = [b for b in range(fb.batch_size) if b not in dec_rows]
            starts = fb.qo_indptr.to("cpu", torch.int64)
            ext_tok = None
            if multi:
                self._plan_extend(fb.split_rows(multi))
                ext_tok = torch.cat([torch.arange(int(starts[b]), int(starts[b + 1]))
                                     for b in multi]).to(self.device)
            self._split = (starts[single].to(self.device), ext_tok)
            return
        self._plan_extend(fb)

    def _plan_extend(self, fb: ForwardBatch) -> None:
        """The extend op when on, else padded when padding wastes at most
        `PADDED_WASTE_FACTOR`, else ragged."""
        if self.extend_kernel:
            if not self.extend_kernel_available:
                raise RuntimeError("extend_kernel is on but the extend attention op is "
                                   "unavailable here")
            self._extend = ExtendAttentionPlan.build(fb)
            return
        ext, pre = fb.extend_lens_cpu, fb.prefix_lens_cpu
        qmax = max(ext)
        kmax = max(p + e for p, e in zip(pre, ext, strict=True))
        useful = sum(e * (p + e) for p, e in zip(pre, ext, strict=True))
        if fb.batch_size > 1 and fb.batch_size * qmax * kmax <= PADDED_WASTE_FACTOR * useful:
            self._padded = self._plan_padded_extend(fb)
        else:
            self._ragged = self._plan_ragged(fb)

    def _mask_dtype(self) -> torch.dtype:
        return self.kv_pool.dtype

    def _plan_decode(self, fb: ForwardBatch) -> _PaddedPlan:
        """Decode layout: row b lists all of request b's slots, `kv_indices[kv_indptr[b]:...]`."""
        dev = self.device
        bs = fb.batch_size
        kmax = max(fb.seq_lens_cpu)
        cols = torch.arange(kmax, device=dev)
        valid = cols.unsqueeze(0) < fb.seq_lens.to(dev).unsqueeze(1)  # [B, Kmax]
        index = torch.zeros(bs, kmax, dtype=torch.int64, device=dev)
        index[valid] = fb.kv_indices.to(dev, torch.int64)  # row-major order = request order
        mask = torch.zeros(bs, 1, 1, kmax, dtype=self._mask_dtype(), device=dev)
        mask.masked_fill_(~valid.view(bs, 1, 1, kmax), float("-inf"))
        return _PaddedPlan(index.view(-1), kmax, 1, mask, None)

    @staticmethod
    def _decode_groups(fb: ForwardBatch) -> list[SharedPrefixGroup]:
        starts = [0] * fb.batch_size
        for b in range(1, fb.batch_size):
            starts[b] = starts[b - 1] + fb.seq_lens_cpu[b - 1]
        return shared_prefix_groups(fb.kv_indices, starts, fb.seq_lens_cpu, CASCADE_MIN_SHARED)

    def _plan_cascade(self, fb: ForwardBatch, plan: _PaddedPlan,
                      shared: list[SharedPrefixGroup]) -> _CascadePlan | None:
        """Torch path of the cascade groups (>= 2 requests sharing >= CASCADE_MIN_SHARED
        leading slots): prefixes and suffixes gathered into padded batches."""
        bs, kmax = fb.batch_size, plan.kmax
        index = plan.kv_index.view(bs, kmax)
        seq = fb.seq_lens_cpu
        start = [0] * bs
        groups: list[tuple[list[int], torch.Tensor]] = []
        for grp in shared:
            groups.append((grp.rows, index[grp.rows[0], : grp.shared]))
            for b in grp.rows:
                start[b] = grp.shared
        if not groups:
            return None
        dev = self.device
        ng, nmax = len(groups), max(len(r) for r, _ in groups)
        lmax = max(int(p.numel()) for _, p in groups)
        shared_index = torch.zeros(ng, lmax, dtype=torch.int64, device=dev)
        shared_mask = torch.full((ng, 1, 1, lmax), float("-inf"), dtype=self._mask_dtype(),
                                 device=dev)
        grouped_rows, grouped_slots = [], []
        for gi, (rows, prefix) in enumerate(groups):
            shared_index[gi, : prefix.numel()] = prefix
            shared_mask[gi, ..., : prefix.numel()] = 0
            grouped_rows.extend(rows)
            grouped_slots.extend(gi * nmax + j for j in range(len(rows)))
        smax = max(q - st for q, st in zip(seq, start, strict=True))
        start_t = torch.tensor(start, dtype=torch.int64, device=dev)
        seq_t = torch.tensor(seq, dtype=torch.int64, device=dev)
        cols = torch.arange(smax, device=dev).unsqueeze(0) + start_t.unsqueeze(1)  # [B, Smax]
        valid = cols < seq_t.unsqueeze(1)
        suffix = torch.gather(index, 1, cols.clamp(max=kmax - 1)) * valid
        mask = torch.zeros(bs, 1, 1, smax, dtype=self._mask_dtype(), device=dev)
        mask.masked_fill_(~valid.view(bs, 1, 1, smax), float("-inf"))
        return _CascadePlan(
            ng, nmax, shared_index.view(-1), shared_mask,
            torch.tensor(grouped_rows, dtype=torch.int64, device=dev),
            torch.tensor(grouped_slots, dtype=torch.int64, device=dev),
            suffix.reshape(-1), mask)

    def _plan_padded_extend(self, fb: ForwardBatch) -> _PaddedPlan:
        """Extend layout: keys = prefix slots then this step's slots (already in the pool)."""
        dev = self.device
        bs = fb.batch_size
        pre = torch.tensor(fb.prefix_lens_cpu, dtype=torch.int64, device=dev)
        ext = torch.tensor(fb.extend_lens_cpu, dtype=torch.int64, device=dev)
        seq = pre + ext
        qmax, kmax = max(fb.extend_lens_cpu), max(fb.seq_lens_cpu)
        cols = torch.arange(kmax, device=dev).unsqueeze(0)  # [1, Kmax]
        is_prefix = cols < pre.unsqueeze(1)
        is_new = (cols >= pre.unsqueeze(1)) & (cols < seq.unsqueeze(1))
        index = torch.zeros(bs, kmax, dtype=torch.int64, device=dev)
        index[is_prefix] = fb.kv_indices.to(dev, torch.int64)
        index[is_new] = fb.out_cache_loc.to(dev, torch.int64)
        # Query i of request b sits at position pre_b + i and sees keys j <= pre_b + i (j < seq_b).
        qi = torch.arange(qmax, device=dev).view(1, qmax, 1)
        visible = (cols.unsqueeze(1) <= pre.view(bs, 1, 1) + qi) & (
            cols < seq.unsqueeze(1)
        ).unsqueeze(1)
        mask = torch.zeros(bs, 1, qmax, kmax, dtype=self._mask_dtype(), device=dev)
        mask.masked_fill_(~visible.unsqueeze(1), float("-inf"))
        starts = fb.qo_indptr[:-1].to(dev, torch.int64)
        tok_req = torch.repeat_interleave(torch.arange(bs, device=dev), ext)
        tok_off = torch.arange(fb.num_tokens, device=dev) - starts[tok_req]
        # All-single-token extends have exactly the decode layout (token b is request b's query).
        q_rows = None if qmax == 1 else tok_req * qmax + tok_off
        return _PaddedPlan(index.view(-1), kmax, qmax, mask, q_rows)

    def _plan_ragged(self, fb: ForwardBatch) -> list[_RaggedReq]:
        dev = self.device
        kv_indices = fb.kv_indices.to(dev, torch.int64)
        reqs: list[_RaggedReq] = []
        q_start = kv_start = 0
        for p, e in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, strict=True):
            prefix_index = mask = None
            if p > 0:
                prefix_index = kv_indices[kv_start : kv_start + p]
            if p > 0 and e > 1:  # query i sees keys j <= p + i
                qi = torch.arange(e, device=dev).unsqueeze(1)
                kj = torch.arange(p + e, device=dev).unsqueeze(0)
                mask = torch.zeros(e, p + e, dtype=self._mask_dtype(), device=dev)
                mask.masked_fill_(kj > qi + p, float("-inf"))
            reqs.append(_RaggedReq(q_start, q_start + e, prefix_index, mask, causal=p == 0))
            q_start += e
            kv_start += p
        return reqs

    def _plan_invariant(self, fb: ForwardBatch) -> list[_InvariantReq]:
        dev = self.device
        kv_indices = fb.kv_indices.to(dev, torch.int64)
        loc = fb.out_cache_loc.to(dev, torch.int64)
        blk = INVARIANT_KEY_BLOCK
        reqs: list[_InvariantReq] = []
        q_start = kv_start = 0
        for p, e in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, strict=True):
            lpad = -(-(p + e) // blk) * blk
            index = torch.zeros(lpad, dtype=torch.int64, device=dev)
            index[:p] = kv_indices[kv_start : kv_start + p]
            index[p : p + e] = loc[q_start : q_start + e]
            # Zero query rows up to MIN_INVARIANT_ROWS: short extends (e.g. one new token after
            # a long cached prefix) would otherwise take the GEMMs' small-M kernels.
            rows = max(e, MIN_INVARIANT_ROWS)
            qpos = torch.arange(rows, device=dev).unsqueeze(1) + p
            hidden = torch.arange(lpad, device=dev).unsqueeze(0) > qpos
            reqs.append(_InvariantReq(q_start, q_start + e, rows, index, hidden))
            q_start += e
            kv_start += p
        return reqs

    def paged_decode_plan(self, fb: ForwardBatch) -> PagedDecodePlan | None:
        if fb is not self._planned_for:
            raise RuntimeError("init_forward_metadata(fb) was not called for this batch")
        pool = self.kv_pool
        if (fb.is_decode and self._kernel is not None and self._split is None
                and self._kv_store
                and (pool.quantized or pool.narrowed or pool.k_buffer[0].dtype == pool.dtype)):
            return self._kernel
        return None

    def extend_step_plan(self, fb: ForwardBatch) -> ExtendStepPlan | None:
        if fb is not self._planned_for:
            raise RuntimeError("init_forward_metadata(fb) was not called for this batch")
        pool = self.kv_pool
        if (fb.is_decode or not self._kv_store or pool.quantized
                or not (pool.narrowed or pool.k_buffer[0].dtype == pool.dtype)):
            return None
        if self._split is not None:
            dec_tok, ext_tok = self._split
            if ext_tok is not None and self._extend is None:  # extend rows off the op
                return None
            return ExtendStepPlan(self._extend, self._kernel, dec_tok, ext_tok)
        return None if self._extend is None else ExtendStepPlan(self._extend)

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
        pool = self.kv_pool
        if pool.quantized and self._kv_store:
            torch.ops.radixrt.kv_store_i8(pool.k_buffer[layer_id], pool.v_buffer[layer_id],
                                          pool.k_scale[layer_id], pool.v_scale[layer_id],
                                          fb.out_cache_loc, k, v)
        elif self._kv_store and k.dtype == pool.dtype and v.dtype == pool.dtype:
            torch.ops.radixrt.kv_store(pool.k_buffer[layer_id], pool.v_buffer[layer_id],
                                       fb.out_cache_loc, k, v)
        else:  # contiguous sources: index_put from a strided view is ~100x slower on CPU
            pool.set_kv(layer_id, fb.out_cache_loc, k.contiguous(), v.contiguous())
        if self._split is not None:
            return self._forward_split(q, k, v, layer_id, scaling)
        if self._kernel is not None:
            out, _ = self._kernel.run_pool(q, pool, layer_id, scaling)
            return out
        if self._invariant is not None:
            return self._extend_invariant(q, layer_id, scaling)
        if self._cascade is not None:
            return self._decode_cascade(q, layer_id, scaling)
        if self._padded is not None and self._padded.q_rows is None:
            return self._decode(q, layer_id, scaling)
        return self._run_extend(q, k, v, layer_id, scaling)

    def _run_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    scaling: float) -> torch.Tensor:
        """The extend plan (op, padded or ragged) over its batch's tokens `q`/`k`/`v`."""
        if self._extend is not None:
            return self._extend.run_pool(q, self.kv_pool, layer_id, scaling)
        if self._padded is not None:
            return self._extend_padded(q, layer_id, scaling)
        assert self._ragged is not None
        return self._extend_ragged(q, k, v, layer_id, scaling)

    def _forward_split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       scaling: float) -> torch.Tensor:
        assert self._split is not None and self._kernel is not None
        dec_tok, ext_tok = self._split
        pool = self.kv_pool
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        o, _ = self._kernel.run_pool(q[dec_tok], pool, layer_id, scaling)
        out[dec_tok] = o
        if ext_tok is not None:
            out[ext_tok] = self._run_extend(q[ext_tok], k[ext_tok], v[ext_tok], layer_id,
                                            scaling)
        return out

    def _gather(
        self, layer_id: int, index: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool K/V at `index`, shaped `[rows, len(index) // rows, kv_heads, head_dim]`."""
        pool = self.kv_pool
        shape = (rows, -1, pool.num_kv_heads, pool.head_dim)
        k, v = pool.read_kv(layer_id, index)
        return k.view(shape), v.view(shape)

    def _decode(self, q: torch.Tensor, layer_id: int, scaling: float) -> torch.Tensor:
        plan = self._padded
        assert plan is not None
        bs, heads, dim = q.shape
        kv_heads = self.kv_pool.num_kv_heads
        k, v = self._gather(layer_id, plan.kv_index, bs)  # [B, Kmax, Hkv, D]
        # Query head h uses KV head h // group: fold the group onto the query-length axis.
        qg = q.reshape(bs, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask, scale=scaling
        )
        return out.reshape(bs, heads, dim)

    def _decode_cascade(self, q: torch.Tensor, layer_id: int, scaling: float) -> torch.Tensor:
        """Softmax over prefix ∪ suffix from the parts' outputs and log-sum-exps:
        out = Σ_part out_part · exp(lse_part − lse), lse = log Σ_part exp(lse_part)."""
        plan = self._cascade
        assert plan is not None
        bs, heads, dim = q.shape
        kv_heads = self.kv_pool.num_kv_heads
        group = heads // kv_heads
        qg = q.reshape(bs, kv_heads, group, dim)  # query head h uses KV head h // group
        k, v = self._gather(layer_id, plan.suffix_index, bs)  # [B, Smax, Hkv, D]
        out, lse = _attention_lse(qg, k.transpose(1, 2), v.transpose(1, 2), plan.suffix_mask,
                                  scaling)  # [B, Hkv, G, D], [B, Hkv, G]
        ng, nmax = plan.num_groups, plan.nmax
        # Every group's queries against its shared keys, all groups in one call.
        qs = q.new_zeros(ng * nmax, kv_heads, group, dim)
        qs.index_copy_(0, plan.grouped_slots, qg.index_select(0, plan.grouped_rows))
        qs = qs.view(ng, nmax, kv_heads, group, dim).transpose(1, 2)
        ks, vs = self._gather(layer_id, plan.shared_index, ng)  # [G, Lmax, Hkv, D]
        out_s, lse_s = _attention_lse(qs.reshape(ng, kv_heads, nmax * group, dim),
                                      ks.transpose(1, 2), vs.transpose(1, 2), plan.shared_mask,
                                      scaling)
        out_s = out_s.view(ng, kv_heads, nmax, group, dim).transpose(1, 2).reshape(
            ng * nmax, kv_heads, group, dim).index_select(0, plan.grouped_slots)
        lse_s = lse_s.view(ng, kv_heads, nmax, group).transpose(1, 2).reshape(
            ng * nmax, kv_heads, group).index_select(0, plan.grouped_slots)
        # The merge runs in fp32 whatever the pool's dtype (the LSEs are fp32); one cast back.
        rows = plan.grouped_rows
        lse_x = lse.index_select(0, rows)
        top = torch.maximum(lse_x, lse_s)
        w_x = torch.exp(lse_x - top).unsqueeze(-1)
        w_s = torch.exp(lse_s - top).unsqueeze(-1)
        merged = (out.index_select(0, rows).float() * w_x + out_s.float() * w_s) / (w_x + w_s)
        out = out.index_copy(0, rows, merged.to(out.dtype))
        return out.reshape(bs, heads, dim)

    def _extend_padded(self, q: torch.Tensor, layer_id: int, scaling: float) -> torch.Tensor:
        plan = self._padded
        assert plan is not None and plan.q_rows is not None
        n, heads, dim = q.shape
        bs = plan.mask.shape[0]
        qp = q.new_zeros(bs * plan.qmax, heads, dim)
        qp.index_copy_(0, plan.q_rows, q)
        k, v = self._gather(layer_id, plan.kv_index, bs)
        out = F.scaled_dot_product_attention(
            qp.view(bs, plan.qmax, heads, dim).transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=plan.mask,
            scale=scaling,
            enable_gqa=True,
        )  # [B, H, Qmax, D]
        out = out.transpose(1, 2).reshape(bs * plan.qmax, heads, dim)
        return torch.index_select(out, 0, plan.q_rows)

    def _extend_ragged(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float
    ) -> torch.Tensor:
        assert self._ragged is not None
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        pool = self.kv_pool
        for r in self._ragged:
            # 4-D [1, heads, len, D] inputs: 3-D ones miss the fused CPU kernel.
            qr = q[r.q_start : r.q_end].transpose(0, 1).unsqueeze(0)
            kr, vr = k[r.q_start : r.q_end], v[r.q_start : r.q_end]
            if r.prefix_index is not None:
                kp, vp = pool.read_kv(layer_id, r.prefix_index)
                kr = torch.cat([kp, pool.as_stored(kr)])
                vr = torch.cat([vp, pool.as_stored(vr)])
            o = F.scaled_dot_product_attention(
                qr,
                kr.transpose(0, 1).unsqueeze(0),
                vr.transpose(0, 1).unsqueeze(0),
                attn_mask=r.mask,
                is_causal=r.causal,
                scale=scaling,
                enable_gqa=True,
            )
            out[r.q_start : r.q_end] = o[0].transpose(0, 1)
        return out


    def _extend_invariant(self, q: torch.Tensor, layer_id: int, scaling: float) -> torch.Tensor:
        """Per request, queries (zero-padded to >= MIN_INVARIANT_ROWS rows) against its keys
        gathered from the pool and zero-padded to a multiple of INVARIANT_KEY_BLOCK:
        scores = q @ kᵀ · scale, masked to -inf, softmax over the padded row, then p @ v summed
        block by block in key order.

        Why each row is bitwise a function of its own prefix only: every score is one
        64-long dot product (GEMM rows are M-invariant for M >= MIN_INVARIANT_ROWS); the softmax
        row length is a multiple of the block, and masked keys add exact zeros to its sum; each
        p @ v block is a GEMM with a fixed inner size, and blocks past a row's causal limit add
        exact zeros. SDPA's fused kernels choose tilings by sequence length, hence not used.
        """
        assert self._invariant is not None
        n, heads, dim = q.shape
        pool = self.kv_pool
        kv_heads = pool.num_kv_heads
        group = heads // kv_heads
        blk = INVARIANT_KEY_BLOCK
        out = torch.empty(n, heads, dim, dtype=q.dtype, device=q.device)
        for r in self._invariant:
            e = r.q_end - r.q_start
            rows = r.rows
            qp = q.new_zeros(rows, heads, dim)
            qp[:e] = q[r.q_start : r.q_end]
            # Query head h uses KV head h // group: fold the group onto the row axis.
            qg = qp.view(rows, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(
                kv_heads, rows * group, dim)
            k, v = pool.read_kv(layer_id, r.kv_index)  # [Lpad, Hkv, D]
            s = torch.bmm(qg, k.permute(1, 2, 0)).mul_(scaling)  # [Hkv, rows * group, Lpad]
            s.view(kv_heads, rows, group, -1).masked_fill_(
                r.hidden.view(1, rows, 1, -1), float("-inf"))
            p = torch.softmax(s, dim=-1)
            vt = v.transpose(0, 1)  # [Hkv, Lpad, D]
            o = torch.bmm(p[..., :blk], vt[:, :blk])
            for b0 in range(blk, vt.shape[1], blk):
                o = o + torch.bmm(p[..., b0 : b0 + blk], vt[:, b0 : b0 + blk])
            out[r.q_start : r.q_end] = o.view(kv_heads, rows, group, dim).permute(
                1, 0, 2, 3)[:e].reshape(e, heads, dim)
        return out


def _kv_store_available() -> bool:
    from radixrt.attention import cpu_kernels

    return cpu_kernels.load_cpu_kernels() and hasattr(torch.ops.radixrt, "kv_store")


def _attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention `[..., Lq, D]` in q's dtype and its natural-log log-sum-exp `[..., Lq]` in fp32
    (whatever q's dtype); K/V heads already matched to the query heads. On CPU, the fused flash
    kernel (which accumulates in fp32 and returns an fp32 LSE); elsewhere scores, LSE and
    softmax in fp32."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse.float()
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse
