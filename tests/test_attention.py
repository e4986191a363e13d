"""TorchNativeBackend against a naive per-request float64 reference on random K/V."""

from __future__ import annotations

import math

import pytest
import torch

from radixrt.attention import create_attention_backend, torch_native
from radixrt.attention.extend_attention import extend_kernel_unavailable_reason
from radixrt.attention.flashinfer import FlashInferUnavailableError
from radixrt.attention.paged_decode import PagedDecodePlan, paged_decode_unavailable_reason
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool

D = 16
LAYER = 1  # exercise a non-zero layer index


def _setup(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: int,
    kv_heads: int,
    mode: ForwardMode,
    seed: int,
) -> tuple[TokenToKVPool, ForwardBatch, torch.Tensor]:
    """Pools whose prefix slots hold random K/V (at shuffled slots), and the step's batch."""
    g = torch.Generator().manual_seed(seed)
    total = sum(prefix_lens) + sum(extend_lens)
    kv = TokenToKVPool(total + 8, 2, kv_heads, D)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    perm = torch.randperm(total + 8, generator=g)[:total] + 1  # scattered, never slot 0
    reqs = ReqToTokenPool(
        len(prefix_lens) + 1, max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)) + 1
    )
    rows = [reqs.alloc() for _ in prefix_lens]
    assert all(r is not None for r in rows)
    used = 0
    for r, p in zip(rows, prefix_lens, strict=True):
        reqs.req_to_token[r, :p] = perm[used : used + p].to(torch.int32)
        used += p
    out_loc = perm[used:]
    n = sum(extend_lens)
    ids = torch.zeros(n, dtype=torch.int64)
    reqs.write(rows, prefix_lens, extend_lens, out_loc)  # type: ignore[arg-type]
    fb = ForwardBatch.build(mode, ids, rows, prefix_lens, extend_lens, reqs.req_to_token)
    return kv, fb, torch.tensor(rows)


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: TokenToKVPool,
    fb: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Per request: prefix K/V from the pool (read before this step writes), then the new K/V."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    kv_ptr = fb.kv_indptr.tolist()
    qo = fb.qo_indptr.tolist()
    for b, (p, e) in enumerate(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, strict=True)):
        slots = fb.kv_indices[kv_ptr[b] : kv_ptr[b] + p].long()
        kb = torch.cat([kv.k_buffer[LAYER][slots], k[qo[b] : qo[b + 1]]]).double()
        vb = torch.cat([kv.v_buffer[LAYER][slots], v[qo[b] : qo[b + 1]]]).double()
        kb = kb.repeat_interleave(heads // kv_heads, dim=1)
        vb = vb.repeat_interleave(heads // kv_heads, dim=1)
        qb = q[qo[b] : qo[b + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        visible = torch.arange(p + e).view(1, -1) <= (torch.arange(e) + p).view(-1, 1)
        scores = scores.masked_fill(~visible, -math.inf)
        out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb)
    return out


# Decode runs through the C++ paged-decode op ("kernel") or the torch gather path ("torch").
DECODE_PATHS = [pytest.param(False, id="torch"), pytest.param(True, id="kernel")]


def _decode_backend(kv: TokenToKVPool, decode_kernel: bool) -> TorchNativeBackend:
    if decode_kernel:
        reason = paged_decode_unavailable_reason(kv.dtype, kv.head_dim)
        if reason is not None:
            pytest.skip(reason)
    backend = create_attention_backend("auto", kv, decode_kernel=decode_kernel)
    assert isinstance(backend, TorchNativeBackend) and backend.decode_kernel == decode_kernel
    return backend


CASES = [
    # (prefix_lens, extend_lens)
    ([0], [9]),  # batch 1, zero prefix
    ([40], [7]),  # batch 1, long prefix
    ([13], [1]),  # batch 1, single-token extend
    ([0, 37, 5, 0], [7, 1, 20, 1]),  # mixed
    ([0, 3, 60], [1, 1, 1]),  # single-token extends
    ([i % 5 for i in range(64)], [1 + i % 3 for i in range(64)]),  # batch 64
]


def _extend_case(case: tuple[list[int], list[int]], heads: int, kv_heads: int):
    """An extend batch over the pool with random q/k/v and the float64 reference output."""
    prefix, ext = case
    kv, fb, _ = _setup(prefix, ext, heads, kv_heads, ForwardMode.EXTEND, seed=len(prefix))
    g = torch.Generator().manual_seed(1)
    n = fb.num_tokens
    q = torch.randn(n, heads, D, generator=g)
    k = torch.randn(n, kv_heads, D, generator=g)
    v = torch.randn(n, kv_heads, D, generator=g)
    scale = D**-0.5
    return kv, fb, q, k, v, scale, _reference(q, k, v, kv, fb, scale)


@pytest.mark.parametrize("decode_kernel", DECODE_PATHS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"p{c[0][:4]}e{c[1][:4]}")
@pytest.mark.parametrize("path", ["ragged", "padded", "kernel"])
def test_extend_matches_reference(
    case: tuple[list[int], list[int]],
    heads: int,
    kv_heads: int,
    path: str,
    decode_kernel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each extend path (torch ragged / padded SDPA, the C++ extend-attention op) vs float64.
    With the decode op, 1-token rows (a mixed step's decode rows) run through it and the other
    rows through the extend path of their own sub-batch."""
    monkeypatch.setattr(torch_native, "PADDED_WASTE_FACTOR", 1e9 if path == "padded" else 0.0)
    _, ext = case
    kv, fb, q, k, v, scale, ref = _extend_case(case, heads, kv_heads)
    n = fb.num_tokens
    if path == "kernel" and extend_kernel_unavailable_reason(kv.dtype, D) is not None:
        pytest.skip(f"extend kernel unavailable: {extend_kernel_unavailable_reason(kv.dtype, D)}")
    if decode_kernel and paged_decode_unavailable_reason(kv.dtype, D) is not None:
        pytest.skip("paged decode op unavailable")
    backend = TorchNativeBackend(kv, extend_kernel=path == "kernel", decode_kernel=decode_kernel)
    backend.init_forward_metadata(fb)
    split = decode_kernel and 1 in ext
    assert (backend._split is not None) == split
    multi = [e for e in ext if e > 1] if split else ext
    if path == "kernel":
        assert (backend._extend is not None) == bool(multi) and backend._padded is None
    else:
        padded = path == "padded" and len(multi) > 1
        assert (backend._padded is not None) == padded
        assert (backend._ragged is not None) == (not padded and bool(multi))
    out = backend.forward(q, k, v, LAYER, scale, fb)
    assert out.shape == (n, heads, D)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The new tokens' K/V landed in the pool.
    torch.testing.assert_close(kv.k_buffer[LAYER][fb.out_cache_loc], k)
    torch.testing.assert_close(kv.v_buffer[LAYER][fb.out_cache_loc], v)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"p{c[0][:4]}e{c[1][:4]}")
def test_invariant_extend_matches_reference(
    case: tuple[list[int], list[int]], heads: int, kv_heads: int
) -> None:
    kv, fb, q, k, v, scale, ref = _extend_case(case, heads, kv_heads)
    backend = TorchNativeBackend(kv, batch_invariant=True)
    backend.init_forward_metadata(fb)
    assert backend._invariant is not None and backend._padded is None
    out = backend.forward(q, k, v, LAYER, scale, fb)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.k_buffer[LAYER][fb.out_cache_loc], k)


@pytest.mark.parametrize("decode_kernel", DECODE_PATHS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize(
    "seq_lens", [[1], [50], [1, 9, 33, 2], [1 + (7 * i) % 40 for i in range(64)]]
)
def test_decode_matches_reference(seq_lens: list[int], heads: int, kv_heads: int,
                                  decode_kernel: bool) -> None:
    prefix = [s - 1 for s in seq_lens]
    kv, fb, _ = _setup(prefix, [1] * len(seq_lens), heads, kv_heads, ForwardMode.DECODE, seed=7)
    g = torch.Generator().manual_seed(2)
    bs = len(seq_lens)
    q = torch.randn(bs, heads, D, generator=g)
    k = torch.randn(bs, kv_heads, D, generator=g)
    v = torch.randn(bs, kv_heads, D, generator=g)
    scale = 0.3
    ref = _reference_decode(q, k, v, kv, fb, scale)
    backend = _decode_backend(kv, decode_kernel)
    backend.init_forward_metadata(fb)
    assert (backend._kernel is not None) == decode_kernel
    out = backend.forward(q, k, v, LAYER, scale, fb)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _reference_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: TokenToKVPool,
    fb: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    ptr = fb.kv_indptr.tolist()
    for b in range(fb.batch_size):
        # Decode kv_indices include this step's slot; the reference takes the new K/V directly.
        slots = fb.kv_indices[ptr[b] : ptr[b + 1] - 1].long()
        kb = (
            torch.cat([kv.k_buffer[LAYER][slots], k[b : b + 1]])
            .double()
            .repeat_interleave(heads // kv_heads, 1)
        )
        vb = (
            torch.cat([kv.v_buffer[LAYER][slots], v[b : b + 1]])
            .double()
            .repeat_interleave(heads // kv_heads, 1)
        )
        w = (torch.einsum("hd,khd->hk", q[b].double(), kb) * scale).softmax(-1)
        out[b] = torch.einsum("hk,khd->hd", w, vb)
    return out


def test_metadata_is_reused_across_layers() -> None:
    """One `init_forward_metadata`, several layers: each layer reads its own pool buffers."""
    kv, fb, _ = _setup([4, 0], [3, 5], 4, 2, ForwardMode.EXTEND, seed=3)
    backend = TorchNativeBackend(kv)
    backend.init_forward_metadata(fb)
    g = torch.Generator().manual_seed(4)
    for layer in (0, 1):
        q = torch.randn(fb.num_tokens, 4, D, generator=g)
        k = torch.randn(fb.num_tokens, 2, D, generator=g)
        v = torch.randn(fb.num_tokens, 2, D, generator=g)
        out = backend.forward(q, k, v, layer, 0.25, fb)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(kv.k_buffer[layer][fb.out_cache_loc], k)


def test_forward_requires_metadata_for_the_same_batch() -> None:
    kv, fb, _ = _setup([0], [3], 2, 1, ForwardMode.EXTEND, seed=5)
    _, other, _ = _setup([0], [3], 2, 1, ForwardMode.EXTEND, seed=6)
    backend = TorchNativeBackend(kv)
    q, k = torch.zeros(3, 2, D), torch.zeros(3, 1, D)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, k, 0, 1.0, fb)
    backend.init_forward_metadata(other)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, k, 0, 1.0, fb)


def test_factory() -> None:
    kv = TokenToKVPool(4, 1, 1, D)
    assert isinstance(create_attention_backend("torch", kv), TorchNativeBackend)
    with pytest.raises(FlashInferUnavailableError, match="CUDA"):
        create_attention_backend("flashinfer", kv)
    with pytest.raises(ValueError):
        create_attention_backend("nope", kv)


# Decode rows whose leading slots are the same canonical cached prefix (as the radix cache makes
# them), in several groups: the cascade plan gathers each shared prefix once.
SHARED_CASES = [
    # (shared prefix per group, group sizes, private lengths per request beyond the prefix)
    ([40], [2], [3, 9]),
    ([64, 33], [3, 4], [1, 5, 2, 7, 3, 1, 12]),
    ([50, 31], [2, 2], [4, 4, 6, 6]),  # second group below CASCADE_MIN_SHARED: no cascade
    ([70], [5], [0, 2, 2, 8, 1]),  # a request whose own part is only the new token
]


@pytest.mark.parametrize("decode_kernel", DECODE_PATHS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("case", SHARED_CASES, ids=str)
def test_decode_over_shared_prefixes_matches_reference(
    case: tuple[list[int], list[int], list[int]], heads: int, kv_heads: int,
    decode_kernel: bool,
) -> None:
    shared, sizes, private = case
    g = torch.Generator().manual_seed(sum(shared))
    bs = sum(sizes)
    total = sum(shared) + sum(private) + bs + 4
    kv = TokenToKVPool(total, 2, kv_heads, D)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    slots = (torch.randperm(total, generator=g) + 1).tolist()
    reqs = ReqToTokenPool(bs + 1, max(shared) + max(private) + 2)
    rows, prefix_lens = [], []
    b = 0
    for sp, n in zip(shared, sizes, strict=True):
        common = [slots.pop() for _ in range(sp)]
        for _ in range(n):
            own = [slots.pop() for _ in range(private[b])]
            r = reqs.alloc()
            assert r is not None
            reqs.req_to_token[r, : sp + len(own)] = torch.tensor(common + own, dtype=torch.int32)
            rows.append(r)
            prefix_lens.append(sp + len(own))
            b += 1
    out_loc = torch.tensor([slots.pop() for _ in range(bs)])
    reqs.write(rows, prefix_lens, [1] * bs, out_loc)
    fb = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(bs, dtype=torch.int64), rows,
                            prefix_lens, [1] * bs, reqs.req_to_token)
    q = torch.randn(bs, heads, D, generator=g)
    k = torch.randn(bs, kv_heads, D, generator=g)
    v = torch.randn(bs, kv_heads, D, generator=g)
    scale = D**-0.5
    ref = _reference(q, k, v, kv, fb, scale)
    backend = _decode_backend(kv, decode_kernel)
    backend.init_forward_metadata(fb)
    expect = [s for s, n in zip(shared, sizes, strict=True)
              if n >= 2 and s >= torch_native.CASCADE_MIN_SHARED]
    if decode_kernel:
        plan = backend._kernel
        assert plan is not None and backend._cascade is None
        assert plan.num_groups == len(expect) and plan.group_len.tolist() == expect
    else:
        cascade = backend._cascade
        assert cascade is not None
        assert cascade.num_groups == len(expect) and cascade.shared_mask.shape[-1] == max(
            expect)
    out = backend.forward(q, k, v, LAYER, scale, fb)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_mixed_step_decode_rows_share_prefixes() -> None:
    """A mixed extend step whose 1-token rows share a cached prefix: the decode op attends
    the prefix once for the group (cascade), the prefill row runs apart, and all rows match
    the reference."""
    if paged_decode_unavailable_reason(torch.float32, D) is not None:
        pytest.skip("paged decode op unavailable")
    heads, kv_heads, shared = 6, 3, 40
    g = torch.Generator().manual_seed(5)
    private = [2, 0, 7]
    total = shared + sum(private) + 64
    kv = TokenToKVPool(total, 2, kv_heads, D)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    slots = (torch.randperm(total - 1, generator=g) + 1).tolist()
    reqs = ReqToTokenPool(8, shared + 32)
    common = [slots.pop() for _ in range(shared)]
    rows, prefix_lens, ext = [], [], []
    for i, n in enumerate([*private, 5]):
        own = [slots.pop() for _ in range(n)]
        r = reqs.alloc()
        assert r is not None
        pre = common + own if i < len(private) else own  # the last row: a fresh prefill
        reqs.req_to_token[r, : len(pre)] = torch.tensor(pre, dtype=torch.int32)
        rows.append(r)
        prefix_lens.append(len(pre))
        ext.append(1 if i < len(private) else 9)
    out_loc = torch.tensor([slots.pop() for _ in range(sum(ext))])
    reqs.write(rows, prefix_lens, ext, out_loc)
    fb = ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(sum(ext), dtype=torch.int64), rows,
                            prefix_lens, ext, reqs.req_to_token)
    q = torch.randn(fb.num_tokens, heads, D, generator=g)
    k = torch.randn(fb.num_tokens, kv_heads, D, generator=g)
    v = torch.randn(fb.num_tokens, kv_heads, D, generator=g)
    scale = D**-0.5
    ref = _reference(q, k, v, kv, fb, scale)
    backend = _decode_backend(kv, True)
    backend.init_forward_metadata(fb)
    assert backend._split is not None and backend._kernel is not None
    assert backend._kernel.group_len.tolist() == [shared]
    out = backend.forward(q, k, v, LAYER, scale, fb)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode_kernel", DECODE_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cascade_decode_in_half_precision(dtype: torch.dtype, decode_kernel: bool) -> None:
    """bf16/fp16 pools: the cascade path (>= 2 rows sharing >= CASCADE_MIN_SHARED slots) merges
    in fp32 and writes `out` in the pool's dtype; it agrees with the non-cascade decode."""
    shared, private = 40, [3, 9, 0]
    heads, kv_heads = 8, 2
    g = torch.Generator().manual_seed(11)
    bs = len(private)
    total = shared + sum(private) + bs + 4
    kv = TokenToKVPool(total, 2, kv_heads, D, dtype=dtype)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    slots = (torch.randperm(total, generator=g) + 1).tolist()
    reqs = ReqToTokenPool(bs + 1, shared + max(private) + 2)
    common = [slots.pop() for _ in range(shared)]
    rows, prefix_lens = [], []
    for n in private:
        own = [slots.pop() for _ in range(n)]
        r = reqs.alloc()
        assert r is not None
        reqs.req_to_token[r, : shared + n] = torch.tensor(common + own, dtype=torch.int32)
        rows.append(r)
        prefix_lens.append(shared + n)
    out_loc = torch.tensor([slots.pop() for _ in range(bs)])
    reqs.write(rows, prefix_lens, [1] * bs, out_loc)
    fb = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(bs, dtype=torch.int64), rows,
                            prefix_lens, [1] * bs, reqs.req_to_token)
    q = torch.randn(bs, heads, D, generator=g).to(dtype)
    k = torch.randn(bs, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(bs, kv_heads, D, generator=g).to(dtype)
    scale = D**-0.5
    ref = _reference(q, k, v, kv, fb, scale)  # float64 over the same half-precision inputs
    backend = _decode_backend(kv, decode_kernel)
    backend.init_forward_metadata(fb)
    plan = backend._kernel if decode_kernel else backend._cascade
    assert plan is not None and plan.num_groups == 1
    out = backend.forward(q, k, v, LAYER, scale, fb)
    assert out.dtype == dtype and out.shape == (bs, heads, D)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # The non-cascade decode of the same batch, in the same dtype.
    if decode_kernel:
        backend._kernel = PagedDecodePlan.build(fb)
        assert backend._kernel.num_groups == 0
    else:
        backend._cascade = None
    plain = backend.forward(q, k, v, LAYER, scale, fb)
    torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)
