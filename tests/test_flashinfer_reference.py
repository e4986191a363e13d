"""The FlashInfer backend's algorithm on CPU: a pure-torch stand-in for the `flashinfer` module.

`TorchFlashInfer` implements the three wrappers and `merge_state` the way FlashInfer defines
them (page-table lookups through indptr / indices / last_page_len, bottom-right-aligned causal
masks, base-2 log-sum-exp, the merge formula of `merge_state`), checking the inputs FlashInfer
would reject (index dtypes, shapes, planned dtypes / head counts, run before plan). Injected into
`FlashInferBackend`, it runs the real two-pass plumbing (ragged causal over the new tokens +
paged non-causal over the cached prefix, merged) on `ForwardBatch` metadata from real pools,
and the result must match `TorchNativeBackend` to 1e-5 (fp32).

`tests/test_flashinfer_conformance.py` reuses it as the value source of its recording fake.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixrt.attention.flashinfer import (
    FlashInferBackend,
    merge_state_max_heads,
    merge_state_torch,
)
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

D = 16
WORKSPACE = 1024  # bytes; the stand-in never touches it
LN2 = math.log(2.0)


# --- the stand-in ------------------------------------------------------------------------------
def _check_index(name: str, t: torch.Tensor, length: int | None = None) -> None:
    assert isinstance(t, torch.Tensor) and t.dim() == 1, f"{name} must be a 1-D tensor"
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
    if length is not None:
        assert t.numel() == length, f"{name} has {t.numel()} entries, expected {length}"


def _check_indptr(name: str, t: torch.Tensor) -> list[int]:
    _check_index(name, t)
    vals = t.tolist()
    assert vals[0] == 0 and all(a <= b for a, b in zip(vals, vals[1:], strict=False)), (
        f"{name} must start at 0 and be non-decreasing"
    )
    return vals


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: (out `[n, Hq, D]` float64, base-2 LSE `[n, Hq]` float64).

    Causal masks are bottom-right aligned (query i sees key j iff j <= i + m - n), FlashInfer's
    convention when qo_len != kv_len. No keys: output 0, LSE -inf.
    """
    n, hq, dim = q.shape
    m, hkv = k.shape[0], k.shape[1]
    if m == 0:
        return (
            torch.zeros(n, hq, v.shape[-1], dtype=torch.float64),
            torch.full((n, hq), -math.inf, dtype=torch.float64),
        )
    group = hq // hkv
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * sm_scale
    if causal:
        visible = torch.arange(m).view(1, -1) <= torch.arange(n).view(-1, 1) + (m - n)
        s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # natural log, [H, n]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    return out, (lse / LN2).transpose(0, 1)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flashinfer.merge_state`: base-2 LSEs, v = (v_a 2^(s_a-m) + v_b 2^(s_b-m)) / (...)."""
    assert v_a.shape == v_b.shape and v_a.dim() == 3, "v: [seq_len, num_heads, head_dim]"
    assert s_a.shape == s_b.shape == v_a.shape[:2], "s: [seq_len, num_heads]"
    assert s_a.dtype == s_b.dtype == torch.float32, "LSEs are float32"
    sa, sb = s_a.double(), s_b.double()
    smax = torch.maximum(sa, sb)
    wa, wb = torch.exp2(sa - smax), torch.exp2(sb - smax)
    v = (v_a.double() * wa.unsqueeze(-1) + v_b.double() * wb.unsqueeze(-1)) / (wa + wb).unsqueeze(-1)
    return v.to(v_a.dtype), (smax + torch.log2(wa + wb)).float()


class _Wrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kw: Any):
        assert float_workspace_buffer.dtype == torch.uint8 and float_workspace_buffer.dim() == 1
        assert kv_layout == "NHD", "the pool's page-size-1 views are NHD"
        self.workspace = float_workspace_buffer
        self.kw = kw
        self.planned: dict[str, Any] | None = None

    def _plan_common(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, kw: dict[str, Any]
    ) -> dict[str, Any]:
        assert num_qo_heads % num_kv_heads == 0
        q_dtype = kw.get("q_data_type", torch.float16)
        return {
            "hq": num_qo_heads,
            "hkv": num_kv_heads,
            "dim": head_dim,
            "sm_scale": kw.get("sm_scale") or head_dim**-0.5,
            "causal": kw.get("causal", False),
            "q_dtype": q_dtype,
            "kv_dtype": kw.get("kv_data_type") or q_dtype,
        }

    def _plan_prefill(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kw: dict[str, Any],
        qo_indptr: torch.Tensor,
        kv_indptr: tuple[str, torch.Tensor],
    ) -> dict[str, Any]:
        """A prefill plan's common part: the query and key/value row offsets of each request
        (`kv_indptr` checked under the caller's argument name)."""
        p = self._plan_common(num_qo_heads, num_kv_heads, head_dim, kw)
        p["qo_indptr"] = _check_indptr("qo_indptr", qo_indptr)
        p["kv_indptr"] = _check_indptr(kv_indptr[0], kv_indptr[1])
        assert len(p["qo_indptr"]) == len(p["kv_indptr"])
        return p

    def _check_q(self, q: torch.Tensor, rows: int) -> dict[str, Any]:
        p = self.planned
        assert p is not None, "run() before plan()"
        assert q.dtype == p["q_dtype"], f"q is {q.dtype}, planned {p['q_dtype']}"
        assert tuple(q.shape) == (rows, p["hq"], p["dim"]), f"q shape {tuple(q.shape)}"
        return p

    def _paged_kv(
        self, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], b: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.planned
        assert p is not None
        kc, vc = paged_kv_cache
        page_size = p["page_size"]
        for c in (kc, vc):
            assert c.dim() == 4 and c.shape[1:] == (page_size, p["hkv"], p["dim"]), (
                f"paged cache must be NHD [pages, {page_size}, {p['hkv']}, {p['dim']}], "
                f"got {tuple(c.shape)}"
            )
            assert c.dtype == p["kv_dtype"]
        start, end = p["kv_indptr"][b], p["kv_indptr"][b + 1]
        pages = p["kv_indices"][start:end].long()
        assert pages.numel() == 0 or int(pages.max()) < kc.shape[0], "page index out of range"
        # FlashInfer's paged_kv_t::get_length: no pages -> 0 tokens.
        length = 0 if end == start else (end - start - 1) * page_size + p["last_page_len"][b]
        k = kc[pages].reshape(-1, p["hkv"], p["dim"])[:length]
        v = vc[pages].reshape(-1, p["hkv"], p["dim"])[:length]
        return k, v

    def _plan_pages(
        self,
        p: dict[str, Any],
        indices: tuple[str, torch.Tensor],
        last_page_len: tuple[str, torch.Tensor],
        page_size: int,
    ) -> None:
        """The paged-KV half of a plan (`p["kv_indptr"]` set): the page indices and each
        request's last-page length, checked under the caller's argument names."""
        bs = len(p["kv_indptr"]) - 1
        _check_index(indices[0], indices[1], p["kv_indptr"][-1])
        _check_index(last_page_len[0], last_page_len[1], bs)
        p["kv_indices"] = indices[1].cpu()
        p["last_page_len"] = last_page_len[1].tolist()
        p["page_size"] = page_size
        self.planned = p

    def _run_rows(
        self,
        q: torch.Tensor,
        qo: list[int],
        kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        causal: bool,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Request b's queries `q[qo[b]:qo[b + 1]]` attend to its keys/values `kv(b)`; computed
        in fp64, the output returned in q's dtype (and the LSE in fp32 when asked for)."""
        assert self.planned is not None
        out = torch.empty(q.shape, dtype=torch.float64)
        lse = torch.empty(q.shape[:2], dtype=torch.float64)
        for b in range(len(qo) - 1):
            o, s = attend(q[qo[b] : qo[b + 1]], *kv(b), causal, self.planned["sm_scale"])
            out[qo[b] : qo[b + 1]], lse[qo[b] : qo[b + 1]] = o, s
        o = out.to(q.dtype)
        return (o, lse.float()) if return_lse else o


class RaggedPrefill(_Wrapper):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        **kw: Any,
    ) -> None:
        self.planned = self._plan_prefill(num_qo_heads, num_kv_heads, head_dim_qk, kw, qo_indptr,
                                          ("kv_indptr", kv_indptr))

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        assert self.planned is not None, "run() before plan()"
        p = self._check_q(q, self.planned["qo_indptr"][-1])
        for t in (k, v):
            assert tuple(t.shape) == (p["kv_indptr"][-1], p["hkv"], p["dim"])
            assert t.dtype == p["kv_dtype"]
        kv = p["kv_indptr"]
        return self._run_rows(q, p["qo_indptr"], lambda b: (k[kv[b] : kv[b + 1]],
                                                            v[kv[b] : kv[b + 1]]),
                              p["causal"], return_lse)


class _PagedWrapper(_Wrapper):
    """`run` over a paged KV cache; a subclass says which query rows each request has."""

    def _rows(self) -> tuple[list[int], bool]:
        """(query row offsets per request, causal)."""
        raise NotImplementedError

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        assert self.planned is not None, "run() before plan()"
        qo, causal = self._rows()
        self._check_q(q, qo[-1])
        return self._run_rows(q, qo, lambda b: self._paged_kv(paged_kv_cache, b), causal,
                              return_lse)


class PagedPrefill(_PagedWrapper):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        **kw: Any,
    ) -> None:
        p = self._plan_prefill(num_qo_heads, num_kv_heads, head_dim_qk, kw, qo_indptr,
                               ("paged_kv_indptr", paged_kv_indptr))
        self._plan_pages(p, ("paged_kv_indices", paged_kv_indices),
                         ("paged_kv_last_page_len", paged_kv_last_page_len), page_size)

    def _rows(self) -> tuple[list[int], bool]:
        assert self.planned is not None
        return self.planned["qo_indptr"], self.planned["causal"]


class PagedDecode(_PagedWrapper):
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **kw: Any,
    ) -> None:
        p = self._plan_common(num_qo_heads, num_kv_heads, head_dim, kw)
        p["kv_indptr"] = _check_indptr("indptr", indptr)
        self._plan_pages(p, ("indices", indices), ("last_page_len", last_page_len), page_size)

    def _rows(self) -> tuple[list[int], bool]:
        assert self.planned is not None
        return list(range(len(self.planned["kv_indptr"]))), False  # one query per request


def torch_flashinfer() -> SimpleNamespace:
    """A `flashinfer`-like module object backed by the reference above."""
    return SimpleNamespace(
        BatchPrefillWithRaggedKVCacheWrapper=RaggedPrefill,
        BatchPrefillWithPagedKVCacheWrapper=PagedPrefill,
        BatchDecodeWithPagedKVCacheWrapper=PagedDecode,
        merge_state=merge_state,
    )


# --- batches -----------------------------------------------------------------------------------
def make_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: int,
    kv_heads: int,
    mode: ForwardMode,
    seed: int,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    head_dim: int = D,
    device: str = "cpu",
    head_major: bool = False,
) -> tuple[TokenToKVPool, ForwardBatch]:
    """Real pools whose prefix slots hold random K/V at scattered slots, and the step's batch.
    Slot-major unless `head_major`: the layout FlashInfer's paged kernels take."""
    g = torch.Generator().manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    kv = TokenToKVPool(total + 8, num_layers, kv_heads, head_dim, dtype=dtype, device=device,
                       head_major=head_major)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    perm = torch.randperm(total + 8, generator=g)[:total] + 1  # never the dummy slot 0
    ctx = max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)) + 1
    reqs = ReqToTokenPool(len(prefix_lens) + 1, ctx)
    rows = [reqs.alloc() for _ in prefix_lens]
    used = 0
    for r, p in zip(rows, prefix_lens, strict=True):
        assert r is not None
        reqs.req_to_token[r, :p] = perm[used : used + p].to(torch.int32)
        used += p
    ids = torch.zeros(sum(extend_lens), dtype=torch.int64)
    reqs.write(rows, prefix_lens, extend_lens, perm[used:])  # type: ignore[arg-type]
    fb = ForwardBatch.build(mode, ids, rows, prefix_lens, extend_lens, reqs.req_to_token, device)
    return kv, fb


def random_qkv(
    n: int,
    heads: int,
    kv_heads: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    head_dim: int = D,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(  # type: ignore[return-value]
        torch.randn(n, h, head_dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads)
    )


def clone_pool(kv: TokenToKVPool) -> TokenToKVPool:
    out = TokenToKVPool(
        kv.size, kv.num_layers, kv.num_kv_heads, kv.head_dim, dtype=kv.dtype, device=kv.device
    )
    for dst, src in zip(out.k_buffer + out.v_buffer, kv.k_buffer + kv.v_buffer, strict=True):
        dst.copy_(src)
    return out


EXTEND_CASES = [
    # (prefix_lens, extend_lens)
    ([0], [9]),  # batch 1, zero prefix: ragged pass alone
    ([40], [7]),  # batch 1, long prefix
    ([13], [1]),  # single-token extend on a prefix
    ([0, 37, 5, 0], [7, 1, 20, 1]),  # mixed: some requests without prefix
    ([0, 3, 60], [1, 1, 1]),  # single-token extends
    ([96, 0, 16], [16, 16, 16]),  # chunked prefill: later chunks of long prompts
    ([i % 5 for i in range(64)], [1 + i % 3 for i in range(64)]),  # batch 64
    ([0] * 64, [1 + i % 4 for i in range(64)]),  # batch 64, no prefix at all
]
DECODE_CASES = [[1], [50], [1, 9, 33, 2], [1 + (7 * i) % 40 for i in range(64)]]


def _case_id(c: Any) -> str:
    return f"p{c[0][:4]}e{c[1][:4]}n{len(c[0])}"


def run_both(
    kv: TokenToKVPool,
    fb: ForwardBatch,
    heads: int,
    kv_heads: int,
    scale: float,
    seed: int,
    merge_in_torch: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(flashinfer-backend output, torch-native output) per layer, on twin pools."""
    kv_ref = clone_pool(kv)
    fi = FlashInferBackend(kv, heads, sm_scale=scale, flashinfer=torch_flashinfer(),
                           workspace_bytes=WORKSPACE)
    fi.merge_in_torch = merge_in_torch
    ref = TorchNativeBackend(kv_ref)
    fi.init_forward_metadata(fb)
    ref.init_forward_metadata(fb)
    outs = []
    for layer in range(kv.num_layers):  # one plan, every layer
        q, k, v = random_qkv(fb.num_tokens, heads, kv_heads, seed + layer, kv.dtype)
        outs.append((fi.forward(q, k, v, layer, scale, fb), ref.forward(q, k, v, layer, scale, fb)))
        for pool in (kv, kv_ref):  # the new tokens' K/V landed in the pool
            torch.testing.assert_close(pool.k_buffer[layer][fb.out_cache_loc], k, atol=0, rtol=0)
            torch.testing.assert_close(pool.v_buffer[layer][fb.out_cache_loc], v, atol=0, rtol=0)
    return outs


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("case", EXTEND_CASES, ids=_case_id)
def test_extend_two_pass_matches_torch_native(
    case: tuple[list[int], list[int]], heads: int, kv_heads: int
) -> None:
    prefix, ext = case
    kv, fb = make_batch(prefix, ext, heads, kv_heads, ForwardMode.EXTEND, seed=len(prefix))
    for got, want in run_both(kv, fb, heads, kv_heads, D**-0.5, seed=11):
        assert got.shape == (fb.num_tokens, heads, D) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("seq_lens", DECODE_CASES, ids=lambda s: f"n{len(s)}max{max(s)}")
def test_decode_matches_torch_native(seq_lens: list[int], heads: int, kv_heads: int) -> None:
    prefix = [s - 1 for s in seq_lens]
    kv, fb = make_batch(prefix, [1] * len(seq_lens), heads, kv_heads, ForwardMode.DECODE, seed=7)
    for got, want in run_both(kv, fb, heads, kv_heads, 0.3, seed=5):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_merge_fallback() -> None:
    """Past merge_state's launch limit the backend merges in torch, with the same result."""
    assert merge_state_max_heads(64, 2) == 128 and merge_state_max_heads(128, 2) == 64
    kv, fb = make_batch([0, 37, 5, 0], [7, 1, 20, 1], 8, 2, ForwardMode.EXTEND, seed=9)
    for got, want in run_both(kv, fb, 8, 2, D**-0.5, seed=4, merge_in_torch=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(3)
    v_a, v_b = torch.randn(2, 6, 4, D, generator=g)
    s_a, s_b = torch.randn(2, 6, 4, generator=g) * 5
    s_b[0] = -math.inf  # an empty paged part
    torch.testing.assert_close(merge_state_torch(v_a, s_a, v_b, s_b), merge_state(v_a, s_a, v_b, s_b)[0])


def test_bf16_two_pass_close_to_torch_native() -> None:
    """Half precision flows through (planned dtypes, merge in the output dtype)."""
    kv, fb = make_batch([0, 37, 5], [7, 1, 20], 8, 2, ForwardMode.EXTEND, 3, torch.bfloat16)
    for got, want in run_both(kv, fb, 8, 2, D**-0.5, seed=2):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_merge_state_formula() -> None:
    """Merging the two halves of a key set equals attending to all of it (base-2 LSE)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, D, generator=g)
    k = torch.randn(12, 2, D, generator=g)
    v = torch.randn(12, 2, D, generator=g)
    o_all, s_all = attend(q, k, v, False, 0.25)
    o_a, s_a = attend(q, k[:7], v[:7], False, 0.25)
    o_b, s_b = attend(q, k[7:], v[7:], False, 0.25)
    o, s = merge_state(o_a.float(), s_a.float(), o_b.float(), s_b.float())
    torch.testing.assert_close(o.double(), o_all, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s.double(), s_all, atol=1e-5, rtol=1e-6)
    # An empty side (LSE -inf, output 0) leaves the other unchanged.
    o_e, s_e = attend(q, k[:0], v[:0], False, 0.25)
    o2, s2 = merge_state(o_a.float(), s_a.float(), o_e.float(), s_e.float())
    torch.testing.assert_close(o2, o_a.float())
    torch.testing.assert_close(s2, s_a.float())


def test_forward_checks_batch_and_scale() -> None:
    kv, fb = make_batch([4], [3], 4, 2, ForwardMode.EXTEND, seed=1)
    _, other = make_batch([4], [3], 4, 2, ForwardMode.EXTEND, seed=2)
    backend = FlashInferBackend(kv, 4, flashinfer=torch_flashinfer(), workspace_bytes=WORKSPACE)
    q, k, v = random_qkv(3, 4, 2, seed=0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, v, 0, D**-0.5, fb)
    backend.init_forward_metadata(other)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, v, 0, D**-0.5, fb)
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="softmax scale"):
        backend.forward(q, k, v, 0, 0.5, fb)
    with pytest.raises(ValueError, match="multiple"):
        FlashInferBackend(kv, 3, flashinfer=torch_flashinfer(), workspace_bytes=WORKSPACE)
