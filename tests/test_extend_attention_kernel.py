"""The C++ extend-attention op (`torch.ops.radixrt.extend_attention`) and its backend wiring.

The op against a float64 reference (softmax over each request's prefix + new keys, query i of
a request with prefix P seeing keys 0..P+i) over random pools: prefixes 0 / 1 / many, one new
token, lengths off the 64-key and query blocks, many requests, GQA 1 and 3, head_dim 16 / 32 / 64 / 96 / 128,
fp32 / bf16 / fp16 pools, fp32 queries over an fp16 pool (a float32 model's float16 KV cache, read
in place: bitwise the fp32 pool of the widened values), slots scattered and shared between
requests; shared-prefix groups (the
bf16 vdpbf16ps path attends a prefix several requests share once per group): groups of several
sizes, of one, two groups, shared lengths on and off the key block, bitwise the same as each
request alone and as with groups off; the AMX tile path (where usable) against the reference and
the other bf16 paths, bitwise the same in a batch, alone, at any thread count and cached or not;
thread-count invariance;
bad input; the backend's plan choice and switch; mixed batches through the backend against the
torch SDPA path; other instruction sets built in a subprocess; a tiny model's extend steps with
the kernel on vs HF (fp32 greedy tokens identical).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from kernel_isa import run_isa_check
from model_fixtures import PagedRunner, hf_logits, make_tiny_checkpoint

from radixrt.attention import cpu_kernels
from radixrt.attention.extend_attention import (
    ExtendAttentionPlan,
    extend_kernel_unavailable_reason,
)
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.core.forward_batch import ForwardBatch, ForwardMode
from radixrt.mem.memory_pool import ReqToTokenPool, TokenToKVPool


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
             torch.Tensor, torch.Tensor]


def _case(seed: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
          rows: list[tuple[int, int]], shared: int = 0, slots: int = 6000) -> Case:
    """Random pool and batch: `rows` = (prefix, new) per request. Slots are a random permutation
    (never contiguous); the first `shared` prefix slots are the same for every request."""
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    vb = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)
    common = perm[:shared]
    free = perm[shared:]
    pre, new, kptr, qptr = [], [], [0], [0]
    used = 0
    for p, e in rows:
        own = p - min(p, shared)
        take = free[used : used + own + e]
        used += own + e
        pre.append(torch.cat([common[: min(p, shared)], take[:own]]))
        new.append(take[own:])
        kptr.append(kptr[-1] + p)
        qptr.append(qptr[-1] + e)
    assert used <= free.numel()
    q = torch.randn(qptr[-1], heads, dim, generator=g).to(dtype)
    return (q, kb, vb, torch.cat(pre).to(torch.int32), torch.tensor(kptr, dtype=torch.int64),
            torch.cat(new).to(torch.int32), torch.tensor(qptr, dtype=torch.int64))


def _reference(case: Case, scale: float) -> torch.Tensor:
    q, kb, vb, kvi, kptr, loc, qptr = case
    group = q.shape[1] // kb.shape[1]
    outs = []
    for b in range(kptr.numel() - 1):
        p, e = int(kptr[b + 1] - kptr[b]), int(qptr[b + 1] - qptr[b])
        idx = torch.cat([kvi[kptr[b] : kptr[b + 1]], loc[qptr[b] : qptr[b + 1]]]).long()
        k = kb[idx].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, P+E, D]
        v = vb[idx].double().repeat_interleave(group, 1).transpose(0, 1)
        s = q[qptr[b] : qptr[b + 1]].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        hidden = torch.arange(p + e).unsqueeze(0) > torch.arange(e).unsqueeze(1) + p
        s.masked_fill_(hidden, float("-inf"))
        outs.append((s.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

SHAPES = {
    "one-fresh-token": [(0, 1)],
    "one-token-on-prefix": [(1, 1), (37, 1), (300, 1)],
    "fresh-causal": [(0, 130)],
    "prefix-1": [(1, 66)],
    "agent-like": [(850, 65)] * 3,
    "ragged": [(0, 3), (63, 64), (64, 65), (129, 7), (1, 200), (5, 1)],
    "many": [(i * 7 % 90, 1 + i % 9) for i in range(40)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_reference(shape: str, dtype: torch.dtype) -> None:
    case = _case(1, dtype, 9, 3, 64, SHAPES[shape])
    out = torch.ops.radixrt.extend_attention(*case, 0.125)
    assert out.dtype == dtype and out.shape == case[0].shape
    torch.testing.assert_close(out.double(), _reference(case, 0.125), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("bf16_dot", [True, False], ids=["bf16-dot", "fp32-fma"])
@pytest.mark.parametrize("shape", ["ragged", "agent-like", "many"])
def test_bf16_paths_match_reference(shape: str, bf16_dot: bool) -> None:
    """bf16 pools through vdpbf16ps (where the build has AVX512-BF16) and through fp32 FMA."""
    previous = torch.ops.radixrt.extend_attention_bf16_dot(bf16_dot)
    try:
        case = _case(8, torch.bfloat16, 9, 3, 64, SHAPES[shape])
        out = torch.ops.radixrt.extend_attention(*case, 0.125)
    finally:
        torch.ops.radixrt.extend_attention_bf16_dot(previous)
    torch.testing.assert_close(out.double(), _reference(case, 0.125), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 4, 64), (6, 2, 128), (8, 2, 32), (4, 2, 16), (6, 3, 96)])
def test_gqa_and_head_dims(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    case = _case(2, dtype, heads, kv_heads, dim, SHAPES["ragged"], shared=40)
    out = torch.ops.radixrt.extend_attention(*case, dim ** -0.5)
    torch.testing.assert_close(out.double(), _reference(case, dim ** -0.5), atol=TOL[dtype],
                               rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", ["ragged", "agent-like"])
def test_head_major_pool_gives_the_same_bits(shape: str, dtype: torch.dtype) -> None:
    """A head-major pool (the CPU default: one head's slots contiguous) and a slot-major one
    holding the same values give bitwise the same outputs."""
    q, kb, vb, *rest = _case(4, dtype, 9, 3, 64, SHAPES[shape], shared=30)
    hkb, hvb = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (kb, vb))
    assert hkb.stride() == (64, kb.shape[0] * 64, 1)
    want = torch.ops.radixrt.extend_attention(q, kb, vb, *rest, 0.125)
    got = torch.ops.radixrt.extend_attention(q, hkb, hvb, *rest, 0.125)
    assert torch.equal(got, want)


def test_shared_prefix_slots() -> None:
    """Requests reading the same prefix slots (a radix-cache hit) each see them whole."""
    case = _case(3, torch.bfloat16, 9, 3, 64, [(200, 20), (200, 1), (150, 33)], shared=150)
    assert torch.equal(case[3][:150], case[3][200:350])
    out = torch.ops.radixrt.extend_attention(*case, 0.125)
    torch.testing.assert_close(out.double(), _reference(case, 0.125), atol=2e-2, rtol=0)


def _grouped_case(seed: int, dtype: torch.dtype,
                  groups: list[tuple[int, list[tuple[int, int]]]], kv_heads: int = 3,
                  heads: int = 9, dim: int = 64) -> Case:
    """Like `_case`, with several prefix groups: `groups` = (shared, rows) pairs, each group's
    requests starting with the same `shared` slots (their own slots after that). Requests are
    interleaved across groups in the batch, as a scheduler's batch may order them."""
    g = torch.Generator().manual_seed(seed)
    need = sum(s + sum(p - s + e for p, e in rows) for s, rows in groups)
    kb = torch.randn(need + 1, kv_heads, dim, generator=g).to(dtype)
    vb = torch.randn(need + 1, kv_heads, dim, generator=g).to(dtype)
    free = iter((torch.randperm(need, generator=g) + 1).tolist())  # slot 0 stays unused
    reqs: list[tuple[list[int], list[int]]] = []
    for shared, rows in groups:
        common = [next(free) for _ in range(shared)]
        for p, e in rows:
            assert p >= shared
            own = [next(free) for _ in range(p - shared + e)]
            reqs.append((common + own[: p - shared], own[p - shared:]))
    order = sorted(range(len(reqs)), key=lambda i: (i * 7919) % len(reqs))
    pre, new, kptr, qptr = [], [], [0], [0]
    for i in order:
        p_slots, n_slots = reqs[i]
        pre += p_slots
        new += n_slots
        kptr.append(kptr[-1] + len(p_slots))
        qptr.append(qptr[-1] + len(n_slots))
    q = torch.randn(qptr[-1], heads, dim, generator=g).to(dtype)
    return (q, kb, vb, torch.tensor(pre, dtype=torch.int32), torch.tensor(kptr),
            torch.tensor(new, dtype=torch.int32), torch.tensor(qptr))


def _request_alone(case: Case, b: int) -> Case:
    """Request b of a batch as a batch of its own (same pool)."""
    q, kb, vb, kvi, kptr, loc, qptr = case
    k0, k1, q0, q1 = int(kptr[b]), int(kptr[b + 1]), int(qptr[b]), int(qptr[b + 1])
    return (q[q0:q1].contiguous(), kb, vb, kvi[k0:k1].contiguous(), torch.tensor([0, k1 - k0]),
            loc[q0:q1].contiguous(), torch.tensor([0, q1 - q0]))


def _bf16_dot_compiled() -> bool:
    """Whether this build has the vdpbf16ps path (its switch reads back False otherwise)."""
    op = torch.ops.radixrt.extend_attention_bf16_dot
    previous = op(True)
    compiled = op(previous)
    return compiled


GROUPS = {
    # agent wave: a 700-token preamble (off the 64-key block), own histories, 65 new tokens
    "agent-wave": [(700, [(850, 65), (760, 65), (910, 65), (700, 65), (851, 64)])],
    "two-groups-and-loners": [(128, [(128, 5), (200, 33), (129, 1)]),
                              (300, [(310, 20), (300, 17)]), (0, [(90, 40), (0, 70)])],
    "group-of-one": [(500, [(520, 30)]), (0, [(64, 12), (65, 9)])],
    "shared-below-a-block": [(63, [(63, 10), (100, 10), (63, 1)])],
    "shared-one-block": [(64, [(64, 3), (65, 3), (200, 50)])],
    "many-small": [(192, [(192 + i, 1 + i % 7) for i in range(24)])],
    "long-extends": [(256, [(256, 300), (300, 140)])],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("groups", list(GROUPS))
def test_shared_prefix_groups_match_reference(groups: str, dtype: torch.dtype) -> None:
    case = _grouped_case(11, dtype, GROUPS[groups])
    out = torch.ops.radixrt.extend_attention(*case, 0.125)
    torch.testing.assert_close(out.double(), _reference(case, 0.125), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("groups", ["agent-wave", "two-groups-and-loners", "long-extends"])
def test_groups_do_not_change_results(groups: str) -> None:
    """bf16 vdpbf16ps path: each request's rows are bitwise the same with shared-prefix groups on
    or off, at 1 or more threads, and run alone (a row's arithmetic depends only on its keys)."""
    if not _bf16_dot_compiled():
        pytest.skip("this build has no vdpbf16ps path (no AVX512-BF16)")
    case = _grouped_case(12, torch.bfloat16, GROUPS[groups])
    op = torch.ops.radixrt.extend_attention
    toggle = torch.ops.radixrt.extend_attention_groups
    threads = torch.get_num_threads()
    previous = toggle(True)
    amx = torch.ops.radixrt.extend_attention_amx(False)  # the vdpbf16ps path, not AMX tiles
    try:
        grouped = op(*case, 0.125)
        assert toggle(False) is True  # the switch reads back the previous setting
        alone_batch = op(*case, 0.125)
        toggle(True)
        torch.set_num_threads(1)
        one_thread = op(*case, 0.125)
        torch.set_num_threads(max(2, threads))
        qptr = case[6]
        alone = torch.cat([op(*_request_alone(case, b), 0.125) for b in range(qptr.numel() - 1)])
    finally:
        toggle(previous)
        torch.ops.radixrt.extend_attention_amx(amx)
        torch.set_num_threads(threads)
    assert torch.equal(grouped, alone_batch)
    assert torch.equal(grouped, one_thread)
    assert torch.equal(grouped, alone)


def _amx_usable() -> bool:
    """Whether bf16 pools can run on AMX tiles here (its switch reads back False otherwise: no
    AMX in the build or the CPU, or the kernel refused the tile state)."""
    op = torch.ops.radixrt.extend_attention_amx
    previous = op(True)
    return op(previous)


@pytest.mark.parametrize("shape", ["one-fresh-token", "fresh-causal", "prefix-1", "ragged",
                                   "agent-like", "many"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 32), (6, 2, 96),
                                                        (8, 2, 128)], ids=lambda v: str(v))
def test_amx_path_matches_reference_and_the_other_bf16_paths(shape: str, heads: int,
                                                             kv_heads: int, dim: int) -> None:
    """AMX tiles (the default for bf16 pools where usable) against the float64 reference, and
    against the vdpbf16ps / fp32 FMA path: only the bf16 rounding of P and of the output differ.
    Head dims 32 and 96 take a two-tile slice of P·V, 128 two four-tile slices; a scale that is
    no power of two rounds s * scale - m once."""
    if not _amx_usable():
        pytest.skip("no AMX tiles in this process (CPU, build, hypervisor or kernel)")
    case = _case(13, torch.bfloat16, heads, kv_heads, dim, SHAPES[shape])
    scale = dim**-0.5
    toggle = torch.ops.radixrt.extend_attention_amx
    previous = toggle(True)
    try:
        tiles = torch.ops.radixrt.extend_attention(*case, scale)
        toggle(False)
        other = torch.ops.radixrt.extend_attention(*case, scale)
    finally:
        toggle(previous)
    torch.testing.assert_close(tiles.double(), _reference(case, scale), atol=2e-2, rtol=0)
    torch.testing.assert_close(tiles.float(), other.float(), atol=8e-3, rtol=0)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128)],
                         ids=lambda v: str(v))
def test_amx_results_do_not_depend_on_batch_threads_or_the_cached_split(heads: int, kv_heads: int,
                                                                        dim: int) -> None:
    """AMX path: a request's rows are bitwise the same in a batch, alone, at 1 or 2 threads, and
    whether its first keys were cached (prefix slots) or computed in the same step (new slots):
    a radix-cache hit does not change a prompt's outputs. Alone, the 77- and 130-token requests
    are cut into 3+ parts and their key blocks packed once ahead for all of them; in the batch
    each of their items packs its own."""
    if not _amx_usable():
        pytest.skip("no AMX tiles in this process (CPU, build, hypervisor or kernel)")
    rows = [(100, 30), (0, 77), (850, 65), (5, 1), (64, 64)]
    case = _case(14, torch.bfloat16, heads, kv_heads, dim, rows)
    scale = dim**-0.5
    op = torch.ops.radixrt.extend_attention
    threads = torch.get_num_threads()
    try:
        batch = op(*case, scale)
        torch.set_num_threads(1)
        one_thread = op(*case, scale)
        torch.set_num_threads(max(2, threads))
        qptr = case[6]
        alone = torch.cat([op(*_request_alone(case, b), scale) for b in range(len(rows))])
        # request 0 with its 100 prefix keys computed in the step instead of cached
        q, kb, vb, kvi, kptr, loc, _ = _request_alone(case, 0)
        g = torch.Generator().manual_seed(15)
        q_pre = torch.randn(100, heads, dim, generator=g).to(torch.bfloat16)
        uncached = op(torch.cat([q_pre, q]), kb, vb, kvi[:0], torch.tensor([0, 0]),
                      torch.cat([kvi, loc]), torch.tensor([0, 130]), scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    assert torch.equal(batch, alone)
    assert torch.equal(uncached[100:], batch[: int(qptr[1])])


@pytest.mark.parametrize("rise", [3.0, 30.0])
def test_amx_running_max_slack_keeps_the_softmax(rise: float) -> None:
    """Scores that climb along the keys (by `rise` in all, in natural-log units): a row's
    running max moves only when a block's max passes it by more than the slack (e^8), so its
    probabilities go above 1 between moves; the outputs still match the float64 softmax."""
    if not _amx_usable():
        pytest.skip("no AMX tiles in this process (CPU, build, hypervisor or kernel)")
    heads, kv_heads, dim = 9, 3, 64
    case = list(_case(16, torch.bfloat16, heads, kv_heads, dim, [(700, 130), (0, 300)]))
    q, kb = case[0], case[1]
    g = torch.Generator().manual_seed(17)
    u = torch.randn(dim, generator=g)
    u /= u.norm()
    scale = dim**-0.5
    # every query along u; key slot s gets a component along u rising with its position in
    # its request, so scores rise by about `rise` over the keys
    q = (u * 8.0 + 0.1 * torch.randn(q.shape, generator=g)).to(torch.bfloat16)
    order = torch.cat([case[3], case[5]]).long()
    pos = torch.zeros(kb.shape[0])
    pos[order] = torch.linspace(0.0, 1.0, order.numel())
    along = (rise / (8.0 * scale)) * pos
    kb = (0.3 * kb.float() + along[:, None, None] * u).to(torch.bfloat16)
    case[0], case[1] = q, kb
    out = torch.ops.radixrt.extend_attention(*case, scale)
    torch.testing.assert_close(out.double(), _reference(tuple(case), scale), atol=2e-2, rtol=0)


def test_thread_count_does_not_change_results() -> None:
    """120 new tokens: 64-token query blocks at 1 thread, 32-token blocks at 2 (more items for
    more threads); each row's arithmetic (key blocks from position 0, fixed order) is the same."""
    case = _case(4, torch.float32, 9, 3, 64, [(0, 100), (37, 20)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.radixrt.extend_attention(*case, 0.125)
        torch.set_num_threads(max(2, before))
        many = torch.ops.radixrt.extend_attention(*case, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # each item's arithmetic is fixed; only who runs it changes


def test_query_blocks_keep_the_threads_evenly_busy() -> None:
    """The query block for one 75-token extend on 850 cached keys (9 query heads on 3 KV heads).
    Rows-in-lanes path: 2 threads get 2 blocks a head (6 items, 3 each, not 9 split 5 / 4), 1 or
    3 threads one block a head; 20 such extends keep whole requests; a fresh 512-token prompt
    goes in 128-token blocks. fp32-FMA path (64-token blocks at most): 2 blocks a head at 2
    threads (not 3), 32-token blocks for two short requests that would leave a thread idle."""
    block = torch.ops.radixrt.extend_attention_block
    assert [block([850], [75], 3, 3, t, True) for t in (1, 2, 3)] == [128, 64, 128]
    assert block([850] * 20, [65] * 20, 3, 3, 2, True) == 128
    assert block([0], [512], 3, 3, 2, True) == 128
    assert block([850], [75], 3, 3, 2, False) == 64
    assert block([0, 37], [100, 20], 3, 3, 1, False) == 64
    assert block([0, 37], [100, 20], 3, 3, 2, False) == 32
    with pytest.raises(RuntimeError, match="one cached count per request"):
        block([850, 3], [75], 3, 3, 2, True)


def test_lanes_path_results_do_not_depend_on_threads() -> None:
    """The 75-token extend above on the rows-in-lanes path at 1, 2 and 3 threads (128-, 64- and
    128-token blocks): bitwise the same output."""
    if not _bf16_dot_compiled():
        pytest.skip("the rows-in-lanes path needs AVX512-BF16")
    case = _case(5, torch.bfloat16, 9, 3, 64, [(850, 75)], slots=2000)
    before = torch.get_num_threads()
    amx = torch.ops.radixrt.extend_attention_amx(False)
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(torch.ops.radixrt.extend_attention(*case, 0.125))
    finally:
        torch.set_num_threads(before)
        torch.ops.radixrt.extend_attention_amx(amx)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].double(), _reference(case, 0.125), atol=2e-2, rtol=0)


@pytest.mark.parametrize("shape", ["ragged", "agent-like", "many", "one-token-on-prefix"])
def test_fp32_queries_over_a_half_pool(shape: str) -> None:
    """A float16 pool under fp32 queries (narrowed) is read in place: bitwise the output over
    an fp32 pool holding the same values widened, in either layout, fp32 out; near the float64
    reference of those values."""
    q, kb, vb, *rest = _case(9, torch.float32, 9, 3, 64, SHAPES[shape], shared=40)
    hkb, hvb = kb.half(), vb.half()
    got = torch.ops.radixrt.extend_attention(q, hkb, hvb, *rest, 0.125)
    assert got.dtype == torch.float32
    want = torch.ops.radixrt.extend_attention(q, hkb.float(), hvb.float(), *rest, 0.125)
    assert torch.equal(got, want)
    head_major = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (hkb, hvb)]
    assert torch.equal(torch.ops.radixrt.extend_attention(q, *head_major, *rest, 0.125), want)
    widened = (q, hkb.float(), hvb.float(), *rest)
    torch.testing.assert_close(got.double(), _reference(widened, 0.125), atol=2e-5, rtol=0)  # type: ignore[arg-type]


def test_bad_input_names_the_problem() -> None:
    q, kb, vb, kvi, kptr, loc, qptr = _case(5, torch.float32, 9, 3, 64, [(10, 5)])
    op = torch.ops.radixrt.extend_attention
    with pytest.raises(RuntimeError, match="loc must have one slot per query token"):
        op(q, kb, vb, kvi, kptr, loc[:4], qptr, 0.125)
    with pytest.raises(RuntimeError, match="kv slot 999999 out of range"):
        bad = kvi.clone()
        bad[3] = 999999
        op(q, kb, vb, bad, kptr, loc, qptr, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q.bfloat16(), kb, vb, kvi, kptr, loc, qptr, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):  # only fp32 queries over a half pool
        op(q.bfloat16(), kb.half(), vb.half(), kvi, kptr, loc, qptr, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q, kb.half(), vb, kvi, kptr, loc, qptr, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(q[:, :8].contiguous(), kb, vb, kvi, kptr, loc, qptr, 0.125)
    with pytest.raises(RuntimeError, match="indptrs"):
        op(q, kb, vb, kvi, kptr + 1, loc, qptr, 0.125)
    with pytest.raises(RuntimeError, match="kv_indices must be a contiguous 1-D Int"):
        op(q, kb, vb, kvi.long(), kptr, loc, qptr, 0.125)


def test_unsupported_pool_is_reported() -> None:
    assert "dtype" in (extend_kernel_unavailable_reason(torch.float64, 64) or "")
    assert "head_dim 80" in (extend_kernel_unavailable_reason(torch.float32, 80) or "")
    assert extend_kernel_unavailable_reason(torch.bfloat16, 64) is None
    with pytest.raises(RuntimeError, match="extend attention kernel unavailable"):
        TorchNativeBackend(TokenToKVPool(8, 1, 2, 80), extend_kernel=True)


# -- through the backend ------------------------------------------------------------------------
def _mixed_batch(dtype: torch.dtype) -> tuple[TokenToKVPool, ForwardBatch, torch.Tensor]:
    """Two prefills on cached prefixes, one fresh prefill and three one-token decode rows (the
    layout of `BatchBuilder.build_mixed`), over a pool filled with random K/V."""
    rows = [(90, 17), (300, 65), (0, 40), (120, 1), (77, 1), (300, 1)]
    kv = TokenToKVPool(2048, 1, 3, 64, dtype)
    rp = ReqToTokenPool(8, 512)
    g = torch.Generator().manual_seed(6)
    reqs = [rp.alloc() for _ in rows]
    slots = kv.alloc(sum(p + e for p, e in rows))
    perm = slots[torch.randperm(slots.numel(), generator=g)]
    rp.write(reqs, [0] * len(rows), [p + e for p, e in rows], perm)
    kv.k_buffer[0][:] = torch.randn(kv.k_buffer[0].shape, generator=g).to(dtype)
    kv.v_buffer[0][:] = torch.randn(kv.v_buffer[0].shape, generator=g).to(dtype)
    ext = [e for _, e in rows]
    fb = ForwardBatch.build(ForwardMode.EXTEND, torch.zeros(sum(ext), dtype=torch.int64), reqs,
                            [p for p, _ in rows], ext, rp.req_to_token)
    q = torch.randn(sum(ext), 9, 64, generator=g).to(dtype)
    return kv, fb, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_mixed_batch_matches_torch_path(dtype: torch.dtype) -> None:
    kv, fb, q = _mixed_batch(dtype)
    k_new = kv.k_buffer[0][fb.out_cache_loc].clone()
    v_new = kv.v_buffer[0][fb.out_cache_loc].clone()
    outs = {}
    for kernel in (True, False):
        backend = TorchNativeBackend(kv, extend_kernel=kernel)
        backend.init_forward_metadata(fb)
        assert (backend._extend is not None) == kernel
        outs[kernel] = backend.forward(q, k_new, v_new, 0, 0.125, fb)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[True].float(), outs[False].float(), atol=tol, rtol=0)


def test_backend_switch_and_batch_invariant_steps() -> None:
    kv, fb, q = _mixed_batch(torch.float32)
    backend = TorchNativeBackend(kv)
    assert backend.extend_kernel and backend.extend_kernel_available
    backend.init_forward_metadata(fb)
    assert backend._extend is not None
    backend.extend_kernel = False
    backend.init_forward_metadata(fb)
    assert backend._extend is None
    invariant = TorchNativeBackend(kv, batch_invariant=True)
    invariant.init_forward_metadata(fb)
    assert invariant._extend is None and invariant._invariant is not None
    assert not TorchNativeBackend(kv, extend_kernel=False).extend_kernel
    with pytest.raises(ValueError, match="extend batches"):
        ExtendAttentionPlan.build(ForwardBatch.build(
            ForwardMode.DECODE, [1], [0], [4], [1], torch.zeros(1, 8, dtype=torch.int64)))


_SUBPROCESS_CHECK = textwrap.dedent("""
    import torch
    from radixrt.attention import cpu_kernels
    assert cpu_kernels.load_cpu_kernels(), cpu_kernels.unavailable_reason()
    print(torch.ops.radixrt.extend_attention_isa())
    g = torch.Generator().manual_seed(0)
    rows = [(0, 70), (130, 1), (64, 33)]
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
        kb = torch.randn(600, 3, 64, generator=g).to(dtype)
        vb = torch.randn(600, 3, 64, generator=g).to(dtype)
        perm = torch.randperm(600, generator=g)
        q = torch.randn(104, 9, 64, generator=g).to(dtype)
        pre, new, used, kp, qp = [], [], 0, [0], [0]
        for p, e in rows:
            pre.append(perm[used:used + p]); new.append(perm[used + p:used + p + e]); used += p + e
            kp.append(kp[-1] + p); qp.append(qp[-1] + e)
        out = torch.ops.radixrt.extend_attention(q, kb, vb, torch.cat(pre).int(),
            torch.tensor(kp), torch.cat(new).int(), torch.tensor(qp), 0.125)
        for b, (p, e) in enumerate(rows):
            idx = torch.cat([pre[b], new[b]])
            k = kb[idx].double().repeat_interleave(3, 1).transpose(0, 1)
            v = vb[idx].double().repeat_interleave(3, 1).transpose(0, 1)
            s = q[qp[b]:qp[b + 1]].double().transpose(0, 1) @ k.transpose(1, 2) * 0.125
            s.masked_fill_(torch.arange(p + e)[None] > torch.arange(e)[:, None] + p, -torch.inf)
            ref = (s.softmax(-1) @ v).transpose(0, 1)
            assert (out[qp[b]:qp[b + 1]].double() - ref).abs().max() < tol, dtype
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_instruction_sets_build_and_agree(isa: str) -> None:
    """The AVX2 and generic builds against the reference in a fresh process (cached builds)."""
    assert run_isa_check(isa, _SUBPROCESS_CHECK).split() == [isa.upper(), "ok"]


# -- through a model ----------------------------------------------------------------------------
def test_tiny_model_extend_kernel_matches_hf(tmp_path: Path) -> None:
    """fp32: a prompt prefilled in two chunks (the second on a cached prefix) plus a second
    request sharing its prefix, extended together through the kernel; then greedy decode.
    Logits match HF to 1e-4 and the greedy tokens equal HF's argmax; the kernel ran."""
    hf = make_tiny_checkpoint(tmp_path, "llama", seed=7)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (90,), generator=g).tolist()
    other = torch.randint(0, 256, (13,), generator=g).tolist()
    runner = PagedRunner.create(tmp_path, dtype=torch.float32)
    backend = TorchNativeBackend(runner.kv_pool, extend_kernel=True)
    runner.model.attn_backend = backend
    first = runner.new_request()
    runner.extend([first], [prompt[:50]])
    second = runner.share_prefix(first, 50)
    logits = runner.extend([first, second], [prompt[50:], other])
    assert backend._extend is not None
    seqs = [list(prompt), prompt[:50] + other]
    for _ in range(4):
        for row, seq in zip(logits, seqs, strict=True):
            torch.testing.assert_close(row, hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)
            seq.append(int(row.argmax()))
        logits = runner.extend([first, second], [[s[-1]] for s in seqs])  # one-token extends
        # One-token rows take the paged-decode op when it is on (the split plan).
        assert (backend._split is not None if backend.decode_kernel
                else backend._extend is not None)
    for seq in seqs:
        assert int(hf_logits(hf, seq[:-1])[-1].argmax()) == seq[-1]
