"""The C++ paged-decode op (`torch.ops.radixrt.paged_decode`) and its builder.

The op against a float64 reference over random pools (scattered and repeated slots, shared
prefixes, lengths around the 16-key block, rows long enough to be split into key-range parts,
built in and forced), LSE included; cascade equal to non-cascade; thread count invariance; the same bits wherever the
keys lie in the pool (scattered, one run, runs broken anywhere); bad input; the builder's ISA choice, cache key and failure fallback; other
instruction sets built in a subprocess; a tiny model decoding through it vs the torch path and HF.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_isa import run_isa_check
from model_fixtures import PagedRunner, hf_logits, make_tiny_checkpoint

from radixrt.attention import cpu_kernels
from radixrt.attention.cascade import shared_prefix_groups
from radixrt.attention.paged_decode import PagedDecodePlan, paged_decode_unavailable_reason
from radixrt.attention.torch_native import TorchNativeBackend
from radixrt.mem.memory_pool import TokenToKVPool


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _case(seed: int, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
          own_lens: list[int], groups: list[tuple[int, list[int]]]) -> dict[str, Any]:
    """A random pool and plan: rows with `own_lens` own keys; `groups` = (shared prefix length,
    member rows). Slots are random (repeats allowed) and never contiguous by construction."""
    g = torch.Generator().manual_seed(seed)
    slots = 3000
    kb = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    vb = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    bs = len(own_lens)
    q = torch.randn(bs, heads, dim, generator=g).to(dtype)
    pieces, row_start, g_start, g_len, g_ptr, g_rows = [], [], [], [], [0], []
    offset = 0
    for n in own_lens:
        pieces.append(torch.randint(0, slots, (n,), generator=g))
        row_start.append(offset)
        offset += n
    for shared, rows in groups:
        pieces.append(torch.randint(0, slots, (shared,), generator=g))
        g_start.append(offset)
        g_len.append(shared)
        offset += shared
        g_rows.extend(rows)
        g_ptr.append(len(g_rows))
    idx = torch.cat(pieces).to(torch.int32) if pieces else torch.zeros(0, dtype=torch.int32)
    return dict(q=q, kb=kb, vb=vb, idx=idx, row_start=_i64(row_start), row_len=_i64(own_lens),
                g_start=_i64(g_start), g_len=_i64(g_len), g_ptr=_i64(g_ptr), g_rows=_i64(g_rows))


def _run(c: dict[str, Any], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.radixrt.paged_decode(c["q"], c["kb"], c["vb"], c["idx"], c["row_start"],
                                          c["row_len"], c["g_start"], c["g_len"], c["g_ptr"],
                                          c["g_rows"], scale)


def _reference(c: dict[str, Any], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: each row's keys = its group's shared prefix, then its own."""
    q, kb, vb, idx = c["q"], c["kb"], c["vb"], c["idx"].long()
    bs, heads, dim = q.shape
    rep = heads // kb.shape[1]
    keys: list[list[int]] = [[] for _ in range(bs)]
    ptr = c["g_ptr"].tolist()
    for gi, (s, n) in enumerate(zip(c["g_start"].tolist(), c["g_len"].tolist(), strict=True)):
        for r in c["g_rows"][ptr[gi]: ptr[gi + 1]].tolist():
            keys[r] += idx[s: s + n].tolist()
    out = torch.zeros(bs, heads, dim, dtype=torch.float64)
    lse = torch.full((bs, heads), -math.inf, dtype=torch.float64)
    for b, (s, n) in enumerate(zip(c["row_start"].tolist(), c["row_len"].tolist(), strict=True)):
        sl = torch.tensor(keys[b] + idx[s: s + n].tolist(), dtype=torch.int64)
        if sl.numel() == 0:
            continue
        k = kb[sl].double().repeat_interleave(rep, 1)
        v = vb[sl].double().repeat_interleave(rep, 1)
        sc = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        out[b] = torch.einsum("hk,khd->hd", sc.softmax(-1), v)
        lse[b] = sc.logsumexp(-1)
    return out, lse


def _head_major(t: torch.Tensor) -> torch.Tensor:
    """The same values laid out as radixrt's CPU pool: one head's slots contiguous."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LENS = [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 300]  # around the op's 8- or 16-key block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 16), (8, 1, 32),
                                                (6, 3, 80), (4, 2, 96), (2, 1, 256), (10, 2, 64)])
def test_op_matches_float64_reference(dtype: torch.dtype, heads: int, kv_heads: int,
                                      dim: int) -> None:
    c = _case(dim + heads, dtype, heads, kv_heads, dim, LENS, [])
    scale = dim**-0.5
    out, lse = _run(c, scale)
    ref_out, ref_lse = _reference(c, scale)
    assert out.dtype == dtype and out.shape == c["q"].shape
    assert lse.dtype == torch.float32 and lse.shape == c["q"].shape[:2]
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    # The LSE is computed in fp32 from the inputs as given, whatever their dtype.
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


# (own lengths per row, groups as (shared length, rows)); rows in no group attend their own keys.
CASCADE_CASES = [
    ([3, 9, 1, 40], [(40, [0, 1, 2])]),
    ([1, 5, 2, 7, 3, 1, 12, 33], [(64, [0, 1, 2]), (33, [3, 4, 5, 6])]),
    ([0, 4, 2], [(70, [0, 1])]),  # a row whose keys are all in the shared prefix
    ([1 + i % 5 for i in range(40)], [(100, list(range(40)))]),  # one group, several chunks
    ([2] * 12, [(35, [11, 0, 5]), (300, [1, 2, 3, 4, 6, 7, 8, 9, 10])]),  # unsorted rows
    ([1, 0, 16, 3], [(1, [0, 1]), (2, [2, 3])]),  # one- and two-key prefixes
    ([5, 1, 17, 0, 31], [(1037, [0, 1, 2, 3, 4])]),  # a long prefix, not a multiple of 16
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASCADE_CASES, ids=lambda c: f"b{len(c[0])}g{len(c[1])}")
def test_cascade_matches_reference_and_flat(case: tuple[list[int], list[tuple[int, list[int]]]],
                                            dtype: torch.dtype) -> None:
    own, groups = case
    heads, kv_heads, dim = 9, 3, 64
    c = _case(len(own), dtype, heads, kv_heads, dim, own, groups)
    scale = 0.125
    out, lse = _run(c, scale)
    ref_out, ref_lse = _reference(c, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    # The same keys as flat rows (prefix copied in front of each row's own keys): no groups.
    idx, pieces, starts, lens = c["idx"], [], [], []
    member = {r: gi for gi, (_, rows) in enumerate(groups) for r in rows}
    offset = 0
    for b, n in enumerate(own):
        s = int(c["row_start"][b])
        row = idx[s: s + n]
        if b in member:
            gs, gl = int(c["g_start"][member[b]]), int(c["g_len"][member[b]])
            row = torch.cat([idx[gs: gs + gl], row])
        pieces.append(row)
        starts.append(offset)
        lens.append(int(row.numel()))
        offset += int(row.numel())
    empty = _i64([])
    flat = dict(c, idx=torch.cat(pieces), row_start=_i64(starts), row_len=_i64(lens),
                g_start=empty, g_len=empty, g_ptr=_i64([0]), g_rows=empty)
    flat_out, flat_lse = _run(flat, scale)
    torch.testing.assert_close(out.float(), flat_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, flat_lse, atol=1e-5, rtol=1e-5)


# Rows long enough to be split into key-range parts (>= 2 x 256 keys while the batch has fewer
# than two (row, KV head) items per thread: built in, only the batch of one on 3 KV heads; every
# such row with the parts forced), next to rows of 0 and 1 key and lengths that are not a
# multiple of the key block.
SPLIT_CASES = [
    ([0, 1, 17, 513, 1100, 2049], []),
    ([515], []),  # batch of one: parts only
    ([600, 3, 0, 1031], [(45, [0, 1, 2])]),  # split rows inside a cascade group
]
# paged_decode_row_parts settings that split every row of 64+ keys into 32-key parts or more,
# whatever the batch and the threads.
FORCED_PARTS = (32, 8, 1 << 20)


@pytest.fixture
def row_parts() -> object:
    """Restores the op's row-part settings (`radixrt::paged_decode_row_parts`) after the test."""
    before = torch.ops.radixrt.paged_decode_row_parts()
    yield
    torch.ops.radixrt.paged_decode_row_parts(*before)


@pytest.mark.parametrize("forced", [False, True], ids=["built-in", "forced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"b{len(c[0])}g{len(c[1])}")
def test_split_rows_merge_to_the_reference(case: tuple[list[int], list[tuple[int, list[int]]]],
                                           dtype: torch.dtype, forced: bool,
                                           row_parts: object) -> None:
    """Rows whose own keys go in parts (each part's state merged by log-sum-exp, the first
    continuing from the cascade prefix's state) give the float64 reference's output and LSE."""
    if forced:
        torch.ops.radixrt.paged_decode_row_parts(*FORCED_PARTS)
    own, groups = case
    c = _case(len(own) + 100, dtype, 9, 3, 64, own, groups)
    out, lse = _run(c, 0.125)
    ref_out, ref_lse = _reference(c, 0.125)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    if 0 in own and not any(own.index(0) in rows for _, rows in groups):
        assert (lse[own.index(0)] == -math.inf).all() and (out[own.index(0)] == 0).all()


def test_a_lone_long_row_splits_only_when_the_threads_would_idle(row_parts: object) -> None:
    """Built in, a batch of one long row on 3 KV heads (3 items for 2 threads) goes in parts:
    near the unsplit result and the reference, not bitwise the unsplit one; a batch of two such
    rows (6 items) stays whole, bitwise as with parts off; one thread never splits."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for own in ([2049], [2049, 1500]):
            c = _case(7, torch.float32, 9, 3, 64, own, [])
            parts = _run(c, 0.125)
            torch.ops.radixrt.paged_decode_row_parts(-1, 1)
            whole = _run(c, 0.125)
            torch.ops.radixrt.paged_decode_row_parts(-1, 8)
            ref_out, ref_lse = _reference(c, 0.125)
            for out, lse in (parts, whole):
                torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
                torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
            same = torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1])
            assert same == (len(own) == 2), own
        torch.set_num_threads(1)
        c = _case(7, torch.float32, 9, 3, 64, [2049], [])
        one = _run(c, 0.125)
        torch.ops.radixrt.paged_decode_row_parts(-1, 1)
        assert all(torch.equal(a, b) for a, b in zip(one, _run(c, 0.125), strict=True))
    finally:
        torch.set_num_threads(before)


def _assert_same_on_one_and_two_threads(cases: list[dict[str, Any]]) -> None:
    """Each case's output and LSE are bitwise the same on 1 thread and on 2 (or more)."""
    before = torch.get_num_threads()
    for c in cases:
        try:
            torch.set_num_threads(1)
            one = _run(c, 0.125)
            torch.set_num_threads(max(2, before))
            many = _run(c, 0.125)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_forced_parts_do_not_depend_on_thread_count(row_parts: object) -> None:
    """With every long row in parts whatever the batch, the parts and their merge order are
    the same on 1 and 2 threads: bitwise the same outputs, cascade groups included."""
    torch.ops.radixrt.paged_decode_row_parts(*FORCED_PARTS)
    cases = [_case(10, torch.float32, 9, 3, 64, [700, 1300, 5, 2000], [(300, [1, 2])]),
             _case(13, torch.float16, 8, 1, 64, [515, 64, 63], [])]
    _assert_same_on_one_and_two_threads(cases)


def test_row_parts_settings_are_checked(row_parts: object) -> None:
    """paged_decode_row_parts refuses values out of range, naming its arguments, and keeps
    the settings; -1 keeps a setting, and the call returns the previous three."""
    before = torch.ops.radixrt.paged_decode_row_parts()
    assert len(before) == 3
    for bad in ((-2, -1, -1), (-1, 65, -1), (-1, -1, -5)):
        with pytest.raises(RuntimeError, match="min_keys and items_per_thread"):
            torch.ops.radixrt.paged_decode_row_parts(*bad)
    assert torch.ops.radixrt.paged_decode_row_parts() == before
    assert torch.ops.radixrt.paged_decode_row_parts(100, -1, -1) == before
    assert torch.ops.radixrt.paged_decode_row_parts() == [100, *before[1:]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (8, 1)])
def test_row_result_does_not_depend_on_the_batch(dtype: torch.dtype, heads: int,
                                                 kv_heads: int) -> None:
    """A row's output and LSE are bitwise the same alone and inside a batch, in or out of a
    cascade group of any size (query tiles then mix heads of several rows). (Its rows are too
    short to go in parts, which a lone long row does: see the test above.)"""
    own = [1, 7, 16, 40, 3, 129, 2]
    big = _case(77, dtype, heads, kv_heads, 64, own, [(45, [0, 2, 3, 5, 6])])
    out, lse = _run(big, 0.125)
    for b in range(len(own)):
        s, n = int(big["row_start"][b]), own[b]
        grouped = b in (0, 2, 3, 5, 6)
        idx = torch.cat([big["idx"][s: s + n], big["idx"][len(big["idx"]) - 45:]])
        alone = dict(big, q=big["q"][b: b + 1].clone(), idx=idx, row_start=_i64([0]),
                     row_len=_i64([n]), g_start=_i64([n] if grouped else []),
                     g_len=_i64([45] if grouped else []), g_ptr=_i64([0, 1] if grouped else [0]),
                     g_rows=_i64([0] if grouped else []))
        one_out, one_lse = _run(alone, 0.125)
        assert torch.equal(one_out[0], out[b]) and torch.equal(one_lse[0], lse[b]), b


def test_large_and_uneven_scores_stay_finite() -> None:
    """Scores far apart (the running max jumps late in a row) and all-equal keys: softmax
    weights still match the reference."""
    c = _case(3, torch.float32, 4, 2, 64, [1, 33, 200], [])
    c["kb"] = c["kb"] * 6.0
    c["kb"][c["idx"][-1].long()] *= 4.0  # the last key of the last row dominates
    out, lse = _run(c, 0.125)
    ref_out, ref_lse = _reference(c, 0.125)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=2e-6)
    same = dict(c, kb=torch.ones_like(c["kb"]))
    out, lse = _run(same, 0.125)
    ref_out, ref_lse = _reference(same, 0.125)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_row_without_keys_gives_zero_and_minus_inf() -> None:
    c = _case(5, torch.float32, 4, 2, 16, [0, 3], [])
    out, lse = _run(c, 0.25)
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    assert torch.isfinite(lse[1]).all()


def test_result_does_not_depend_on_thread_count() -> None:
    """Each (row or group chunk, KV head) is computed by one thread in key order: bitwise the
    same output whatever the number of threads, where every batch has two (row, KV head) items
    per thread (no row goes in parts; forced parts: the test above)."""
    cases = [_case(9, torch.bfloat16, 9, 3, 64, [1 + (7 * i) % 90 for i in range(24)],
                   [(50, [0, 3, 5, 7, 9, 11, 13])]),
             # few long rows
             _case(10, torch.float32, 9, 3, 64, [700, 1300, 5, 2000], [(300, [1, 2])]),
             # a 4-row group: one chunk on 1 thread, two 2-row chunks on 2 (3 KV heads)
             _case(11, torch.bfloat16, 9, 3, 64, [3, 40, 7, 1, 90, 2, 11], [(700, [1, 2, 4, 6])]),
             # an 8-row group (rows in vector lanes with AVX512-BF16): one 24-query chunk per KV
             # head on 1 thread, two of 12 on 2
             _case(12, torch.bfloat16, 9, 3, 64, [5 + 13 * i for i in range(10)],
                   [(900, [0, 1, 2, 3, 5, 6, 8, 9])])]
    _assert_same_on_one_and_two_threads(cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_large_group_matches_reference_and_keeps_each_rows_bits(dtype: torch.dtype) -> None:
    """A cascade group of 16+ rows (on pools scanned without a dot-product instruction it passes
    over its prefix in register-tiled key blocks, the rows' own keys then by the scan): the
    float64 reference, and each row's bits the same in a 20-row group and in a 17-row one, on 1
    and on 2 threads (the chunks differ)."""
    own = [1 + (5 * i) % 37 for i in range(22)]
    members = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21]
    big = _case(12, dtype, 9, 3, 64, own, [(300, members)])
    out, lse = _run(big, 0.125)
    ref_out, ref_lse = _reference(big, 0.125)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    fewer = dict(big, g_rows=_i64(members[:17]), g_ptr=_i64([0, 17]))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            sub_out, sub_lse = _run(fewer, 0.125)
            for b in members[:17]:
                assert torch.equal(sub_out[b], out[b]) and torch.equal(sub_lse[b], lse[b]), (n, b)
    finally:
        torch.set_num_threads(threads)


def _amx_switch(toggle: Any) -> bool:
    """The setting of an AMX on/off op (`paged_decode_amx`, `paged_decode_amx_rows`), or a skip
    where this process has no AMX tiles."""
    previous = toggle(True)
    if not toggle(previous):
        pytest.skip("no AMX tiles in this process (CPU, build, hypervisor or kernel)")
    return previous


def _tiles_against_scan(c: dict[str, Any], scale: float, toggle: Any,
                        previous: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """`c` run with `toggle` on and off (then back to `previous`): both results, after checking
    the tiles' against the float64 reference and the scan's (P's bf16 rounding apart)."""
    try:
        toggle(True)
        tiles = _run(c, scale)
        toggle(False)
        scan = _run(c, scale)
    finally:
        toggle(previous)
    ref_out, ref_lse = _reference(c, scale)
    torch.testing.assert_close(tiles[0].double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(tiles[1].double(), ref_lse, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(tiles[0].float(), scan[0].float(), atol=8e-3, rtol=0)
    torch.testing.assert_close(tiles[1], scan[1], atol=1e-5, rtol=1e-5)
    return tiles, scan


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 32), (6, 2, 96),
                                                        (8, 2, 128)], ids=lambda v: str(v))
def test_amx_groups_match_reference_and_the_scan(heads: int, kv_heads: int, dim: int) -> None:
    """bf16 cascade groups on AMX tiles (the default where usable) against the float64 reference
    and against the vdpbf16ps / fp32 scan (switched off): only P's bf16 rounding differs. The
    LSE comes from the same fp32 scores and sums, so it agrees closely too."""
    toggle = torch.ops.radixrt.paged_decode_amx
    previous = _amx_switch(toggle)
    for own, groups in CASCADE_CASES:
        c = _case(21, torch.bfloat16, heads, kv_heads, dim, own, groups)
        _tiles_against_scan(c, dim**-0.5, toggle, previous)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 32),
                                                        (6, 3, 96), (8, 2, 64), (10, 2, 64),
                                                        (6, 3, 80)],
                         ids=lambda v: str(v))
def test_amx_rows_match_reference_and_the_scan(heads: int, kv_heads: int, dim: int) -> None:
    """A bf16 row's own keys on AMX tiles (amx_decode.h, the default where usable) against the
    float64 reference and the vdpbf16ps scan (switched off): the scores' sums run in another
    order and the softmax steps over 32 keys instead of 16, so outputs agree to P's bf16
    rounding and the LSE closely. 1-4 query heads per KV head and head dims that are multiples
    of 32 up to 128 take the tiles from 256 own keys (their bits differ from the scan's
    somewhere); rows with fewer, 5 query heads and head dim 80 keep the scan (bitwise). Flat
    rows and cascade rows (their own keys after the group's prefix), slots scattered, in one
    run, or in broken runs."""
    toggle = torch.ops.radixrt.paged_decode_amx_rows
    previous = _amx_switch(toggle)
    takes_tiles = heads // kv_heads <= 4 and dim % 32 == 0 and dim <= 128
    scale = dim**-0.5
    differed = False
    cases = [(LENS + [255, 256, 544], []), ([260, 5, 300, 33], [(40, [0, 1, 2])]),
             *CASCADE_CASES[:2]]
    for seed, (own, groups) in enumerate(cases):
        c = _case(30 + seed, torch.bfloat16, heads, kv_heads, dim, own, groups)
        c = dict(c, kb=_head_major(c["kb"]), vb=_head_major(c["vb"]))
        for name, pos in _positions(c["idx"].numel(), seed).items():
            moved = _relocated(c, pos, ("kb", "vb"))
            tiles, scan = _tiles_against_scan(moved, scale, toggle, previous)
            same = torch.equal(tiles[0], scan[0]) and torch.equal(tiles[1], scan[1])
            assert same or takes_tiles, (name, seed)
            for b, n in enumerate(own):  # short rows keep the scan
                if n < 256:
                    assert torch.equal(tiles[0][b], scan[0][b]), (name, seed, b)
            differed = differed or not same
    assert differed == takes_tiles


def test_amx_rows_default_follows_the_environment() -> None:
    """RADIXRT_PD_AMX_ROWS=0 starts a process with rows on the scan (a server A/B); any other
    value, or none, on the tiles where they are usable."""
    _amx_switch(torch.ops.radixrt.paged_decode_amx_rows)
    code = ("import torch; from radixrt.attention import cpu_kernels; "
            "assert cpu_kernels.load_cpu_kernels(); "
            "print(torch.ops.radixrt.paged_decode_amx_rows(True))")
    for env, want in (({"RADIXRT_PD_AMX_ROWS": "0"}, "False"),
                      ({"RADIXRT_PD_AMX_ROWS": "1"}, "True")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (env, out.stdout, out.stderr)


def test_amx_rows_keep_each_rows_bits_whatever_the_batch() -> None:
    """On the tiles too, a row's output and LSE are bitwise the same alone, in a batch of 64
    and with one or two threads."""
    toggle = torch.ops.radixrt.paged_decode_amx_rows
    previous = _amx_switch(toggle)
    lens = [200 + (37 * i) % 200 for i in range(64)]  # around the tiles' 256 keys
    c = _case(44, torch.bfloat16, 9, 3, 64, lens, [(50, [3, 8, 20])])
    threads = torch.get_num_threads()
    try:
        toggle(True)
        out, lse = _run(c, 0.125)
        for n in (1, 2):
            torch.set_num_threads(n)
            again = _run(c, 0.125)
            assert torch.equal(again[0], out) and torch.equal(again[1], lse), n
        for b in (0, 5, 63):
            alone = dict(c, q=c["q"][b: b + 1], row_start=c["row_start"][b: b + 1],
                         row_len=c["row_len"][b: b + 1], g_start=c["g_start"][:0],
                         g_len=c["g_len"][:0], g_ptr=c["g_ptr"][:1], g_rows=c["g_rows"][:0])
            got = _run(alone, 0.125)
            assert torch.equal(got[0][0], out[b]) and torch.equal(got[1][0], lse[b]), b
    finally:
        torch.set_num_threads(threads)
        toggle(previous)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 32), (6, 2, 96),
                                                        (8, 2, 128), (2, 1, 256), (4, 1, 16),
                                                        (6, 3, 80)],
                         ids=lambda v: str(v))
def test_lane_groups_match_reference_and_the_scan(heads: int, kv_heads: int, dim: int) -> None:
    """bf16 cascade groups with their query rows in vector lanes (lane_attention.h, on
    AVX512-BF16 CPUs where AMX tiles are not used) against the float64 reference and against
    the scan: only P's bf16 rounding, the exp polynomial and the order of the fp32 sums differ,
    so the outputs agree to P's rounding and the LSE closely, and a long group's bits do differ
    (the lanes ran). Head dims 16 and 80 leave a half 32-dim chunk in the V pairs."""
    toggle = torch.ops.radixrt.paged_decode_lane_groups
    default = toggle(-1)
    if default < 0:
        pytest.skip("this build has no rows-in-lanes attention (no AVX512-BF16)")
    amx_before = torch.ops.radixrt.paged_decode_amx(False)  # AMX tiles take groups first
    scale = dim**-0.5
    try:
        for own, groups in CASCADE_CASES:
            c = _case(21, torch.bfloat16, heads, kv_heads, dim, own, groups)
            toggle(1)
            lanes = _run(c, scale)
            toggle(0)
            scan = _run(c, scale)
            ref_out, ref_lse = _reference(c, scale)
            torch.testing.assert_close(lanes[0].double(), ref_out, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lanes[1].double(), ref_lse, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lanes[0].float(), scan[0].float(), atol=8e-3, rtol=0)
            torch.testing.assert_close(lanes[1], scan[1], atol=1e-5, rtol=1e-5)
            if max(n for n, _ in groups) >= 300:
                assert not torch.equal(lanes[1], scan[1])
    finally:
        toggle(default)
        torch.ops.radixrt.paged_decode_amx(amx_before)


def test_lane_groups_start_at_their_row_threshold() -> None:
    """With the default threshold a group below it keeps the scan's bits and one at it gets the
    lanes' (a row's bits depend only on its group's size class); a bad threshold is refused."""
    toggle = torch.ops.radixrt.paged_decode_lane_groups
    default = toggle(-1)
    if default < 0:
        pytest.skip("this build has no rows-in-lanes attention (no AVX512-BF16)")
    assert default == 8
    amx_before = torch.ops.radixrt.paged_decode_amx(False)
    try:
        for rows in (default - 1, default):
            c = _case(5, torch.bfloat16, 9, 3, 64, [3] * rows, [(200, list(range(rows)))])
            got = _run(c, 0.125)
            toggle(0)
            scan = _run(c, 0.125)
            toggle(1)
            lanes = _run(c, 0.125)
            toggle(default)
            want = lanes if rows >= default else scan
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
            assert not torch.equal(lanes[1], scan[1])
        with pytest.raises(RuntimeError, match="rows must be >= 0"):
            toggle(-2)
    finally:
        toggle(default)
        torch.ops.radixrt.paged_decode_amx(amx_before)


def test_result_does_not_depend_on_the_one_thread_threshold() -> None:
    """Whether an attention phase (a group's shared prefix, the rows' own keys) runs on one
    thread or is split over two (`radixrt::attention_parallel_work`, the regions' threshold
    here: no team) changes no bit; the setter returns the previous [team, regions] and leaves a
    negative argument's value as it is."""
    op = torch.ops.radixrt.attention_parallel_work
    c = _case(11, torch.bfloat16, 9, 3, 64, [200] * 8, [(400, list(range(8)))])
    before, threads = op(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert op(-1, 0) == before
        assert op(7, -1) == [before[0], 0]
        assert op() == [7, 0]
        split = _run(c, 0.125)
        op(-1, 1 << 40)
        alone = _run(c, 0.125)
    finally:
        op(*before)
        torch.set_num_threads(threads)
    assert op() == before
    assert torch.equal(split[0], alone[0]) and torch.equal(split[1], alone[1])
    ref_out, ref_lse = _reference(c, 0.125)
    torch.testing.assert_close(split[0].double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(split[1].double(), ref_lse, atol=1e-3, rtol=1e-3)


def _cpu_vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefetch_into_l1_or_l2_changes_no_bit(dtype: torch.dtype) -> None:
    """Whether the scan prefetches into L1 or L2 (`radixrt::paged_decode_prefetch_l1`) moves
    only loads: the same bits either way, cascade groups included. The default is L1 on Intel
    CPUs and L2 elsewhere (RADIXRT_PD_PREFETCH_L1 unset); the setter returns the setting before,
    keeps it on -1 and refuses anything but -1, 0, 1."""
    import os

    op = torch.ops.radixrt.paged_decode_prefetch_l1
    c = _case(17, dtype, 9, 3, 64, [300, 3, 77, 1, 160, 33], [(150, [1, 3, 5]), (40, [0, 4])])
    before = op()
    if "RADIXRT_PD_PREFETCH_L1" not in os.environ and Path("/proc/cpuinfo").exists():
        assert before == (1 if _cpu_vendor() == "GenuineIntel" else 0)
    try:
        with pytest.raises(RuntimeError, match="paged_decode_prefetch_l1: must be"):
            op(2)
        results = []
        for l1 in (0, 1):
            op(l1)
            assert op() == l1
            results.append(_run(c, 0.125))
    finally:
        op(before)
    assert op() == before
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefetch_distance_changes_no_bit(dtype: torch.dtype) -> None:
    """How many key blocks the scans prefetch ahead (`radixrt::paged_decode_prefetch`: calls
    sharing their items among threads, calls alone) moves only loads: the same bits on one and
    two threads, none to several blocks ahead, cascade groups included. The setter returns the
    previous pair, keeps a -1's value and refuses a distance out of [0, 16]."""
    op = torch.ops.radixrt.paged_decode_prefetch
    c = _case(13, dtype, 9, 3, 64, [300, 3, 77, 1, 160, 33], [(150, [1, 3, 5]), (40, [0, 4])])
    before, threads = op(), torch.get_num_threads()
    assert all(0 <= b <= 16 for b in before)
    try:
        assert op(3, -1) == before
        assert op(-1, 5) == [3, before[1]]
        assert op() == [3, 5]
        with pytest.raises(RuntimeError, match="paged_decode_prefetch: blocks ahead"):
            op(17, -1)
        with pytest.raises(RuntimeError, match="paged_decode_prefetch: blocks ahead"):
            op(-1, -2)
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            for ahead in (0, 1, 2, 6):
                op(ahead, ahead)
                results.append(_run(c, 0.125))
    finally:
        op(*before)
        torch.set_num_threads(threads)
    assert op() == before
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    ref_out, ref_lse = _reference(c, 0.125)
    torch.testing.assert_close(results[0][0].double(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(results[0][1].double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_bad_input_raises_naming_the_argument() -> None:
    c = _case(1, torch.float32, 4, 2, 16, [3, 4], [])
    bad_slot = dict(c, idx=c["idx"].clone())
    bad_slot["idx"][2] = 10**6
    with pytest.raises(RuntimeError, match="kv slot 1000000 out of range"):
        _run(bad_slot, 0.25)
    with pytest.raises(RuntimeError, match="kv_indices must be a contiguous 1-D int32"):
        _run(dict(c, idx=c["idx"].long()), 0.25)
    with pytest.raises(RuntimeError, match="row 1 keys out of kv_indices"):
        _run(dict(c, row_len=_i64([3, 5])), 0.25)
    with pytest.raises(RuntimeError, match="one dtype"):
        _run(dict(c, q=c["q"].half()), 0.25)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        _run(dict(c, q=torch.zeros(2, 3, 16)), 0.25)
    with pytest.raises(RuntimeError, match="unsupported head_dim 24"):
        _run(dict(c, q=torch.zeros(2, 4, 24), kb=torch.zeros(9, 2, 24), vb=torch.zeros(9, 2, 24)),
             0.25)
    dup = dict(c, g_start=_i64([0]), g_len=_i64([2]), g_ptr=_i64([0, 2]), g_rows=_i64([1, 1]))
    with pytest.raises(RuntimeError, match="distinct batch rows"):
        _run(dup, 0.25)


def test_plan_splits_rows_after_the_shared_prefix() -> None:
    """PagedDecodePlan.build: grouped rows start after their group's prefix, in kv_indices."""
    from radixrt.attention.cascade import SharedPrefixGroup
    from radixrt.core.forward_batch import ForwardBatch, ForwardMode
    from radixrt.mem.memory_pool import ReqToTokenPool

    reqs = ReqToTokenPool(4, 64)
    common = list(range(1, 41))
    rows = [reqs.alloc() for _ in range(3)]
    seqs = [common + [100, 101], common + [102], list(range(200, 205))]
    for r, s in zip(rows, seqs, strict=True):
        reqs.req_to_token[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    fb = ForwardBatch.build(ForwardMode.DECODE, [0, 0, 0], rows, [len(s) - 1 for s in seqs],
                            [1, 1, 1], reqs.req_to_token)
    plan = PagedDecodePlan.build(fb, [SharedPrefixGroup([0, 1], 40)])
    assert plan.group_start.tolist() == [0] and plan.group_len.tolist() == [40]
    assert plan.group_rows.tolist() == [0, 1] and plan.group_row_ptr.tolist() == [0, 2]
    assert plan.row_start.tolist() == [40, 42 + 40, 42 + 41]
    assert plan.row_len.tolist() == [2, 1, 5]
    own = [plan.kv_indices[s: s + n].tolist()
           for s, n in zip(plan.row_start.tolist(), plan.row_len.tolist(), strict=True)]
    assert own == [[100, 101], [102], list(range(200, 205))]


def _plan_fields(plan: PagedDecodePlan) -> list[list[int]]:
    return [t.tolist() for t in (plan.kv_indices, plan.row_start, plan.row_len, plan.group_start,
                                 plan.group_len, plan.group_row_ptr, plan.group_rows)]


@pytest.mark.parametrize("seed", range(40))
def test_cpp_plan_is_the_python_groups_and_plan(seed: int) -> None:
    """`PagedDecodePlan.for_decode` (one C++ call) = `build(fb, shared_prefix_groups(...))` on
    random decode batches: families of rows sharing prefixes that diverge at random points
    (some below `min_shared`, some rows shorter than the rest), unrelated rows, rows keyed by
    the dummy slot 0, short rows, batches of 0-1 rows (21 of the 40 seeds form 1-4 groups)."""
    from radixrt.attention.cascade import CASCADE_MIN_SHARED
    from radixrt.core.forward_batch import ForwardBatch, ForwardMode
    from radixrt.mem.memory_pool import ReqToTokenPool

    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    min_shared = (CASCADE_MIN_SHARED, 4, 1)[seed % 3]
    reqs = ReqToTokenPool(24, 160)
    next_slot = [1]

    def fresh(n: int) -> list[int]:
        next_slot[0] += n
        return list(range(next_slot[0] - n, next_slot[0]))

    seqs: list[list[int]] = []
    for _ in range(rand(0, 5) if seed % 7 else 0):  # families
        base = fresh(rand(1, 120))
        for _ in range(rand(1, 5)):
            keep = rand(0, len(base) + 1) if rand(0, 3) else len(base)
            seqs.append(base[:keep] + fresh(rand(1, 30)))
    for _ in range(rand(0, 4)):  # unrelated, some keyed by the dummy slot
        s = fresh(rand(1, 100))
        if rand(0, 3) == 0 and len(s) >= min_shared:
            s[min_shared - 1] = 0
        seqs.append(s)
    seqs = seqs[:reqs.size]
    order = torch.randperm(len(seqs), generator=g).tolist()
    seqs = [seqs[i] for i in order]
    rows = [reqs.alloc() for _ in seqs]
    for r, s in zip(rows, seqs, strict=True):
        reqs.req_to_token[r, : len(s)] = torch.tensor(s, dtype=torch.int32)
    fb = ForwardBatch.build(ForwardMode.DECODE, [0] * len(seqs), rows,
                            [len(s) - 1 for s in seqs], [1] * len(seqs), reqs.req_to_token)
    starts = fb.kv_indptr[:-1].tolist()
    groups = shared_prefix_groups(fb.kv_indices, starts, fb.seq_lens_cpu, min_shared)
    expected = PagedDecodePlan.build(fb, groups)
    got = PagedDecodePlan.for_decode(fb, min_shared)
    assert _plan_fields(got) == _plan_fields(expected)
    assert {t.dtype for t in (got.row_start, got.row_len, got.group_start, got.group_len,
                              got.group_row_ptr, got.group_rows)} == {torch.int64}


def test_cpp_plan_refuses_bad_input() -> None:
    op = torch.ops.radixrt.paged_decode_plan
    kv = torch.arange(1, 9, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="kv_indptr must rise"):
        op(kv, torch.tensor([0, 5, 3], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="kv_indptr must rise"):
        op(kv, torch.tensor([0, 9], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="kv_indices must be 1-D int32"):
        op(kv.long(), torch.tensor([0, 8], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="min_shared must be >= 1"):
        op(kv, torch.tensor([0, 8], dtype=torch.int32), 0)


# -- builder ------------------------------------------------------------------------------------
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c", "sse2"})


def test_isa_choice_follows_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXRT_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    assert cpu_kernels.choose_isa(AVX512) == "avx512"
    assert cpu_kernels.choose_isa(AVX512 - {"avx512bw"}) == "avx2"  # Zen 3 / older Xeons
    assert cpu_kernels.choose_isa(frozenset({"avx2", "fma"})) == "default"  # no F16C
    assert cpu_kernels.choose_isa(AVX512, requested="avx2") == "avx2"
    assert cpu_kernels.choose_isa(frozenset({"avx2", "fma", "f16c"}), "avx512") == "avx2"
    monkeypatch.setenv("RADIXRT_CPU_ISA", "default")
    assert cpu_kernels.choose_isa(AVX512) == "default"
    monkeypatch.setenv("RADIXRT_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="RADIXRT_CPU_ISA"):
        cpu_kernels.choose_isa(AVX512)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert cpu_kernels.choose_isa(AVX512, requested="avx512") == "default"


def test_cache_key_covers_cpu_flags_torch_and_isa(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("RADIXRT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("RADIXRT_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX512)
    base = cpu_kernels.build_spec()
    assert base.directory.parent == tmp_path and base.isa == "avx512"
    assert "-mavx512f" in base.cflags and "-DCPU_CAPABILITY_AVX512" in base.cflags
    assert not any(f.startswith("-march") for f in base.cflags)
    assert cpu_kernels.build_spec().key == base.key  # stable
    lower = cpu_kernels.build_spec("avx2")
    assert lower.key != base.key and "-mavx512f" not in lower.cflags
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX512 | {"amx_tile"})
    assert cpu_kernels.build_spec().key != base.key  # another CPU
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(cpu_kernels.torch, "__version__", "9.9.9")
    assert cpu_kernels.build_spec().key != base.key  # another torch
    monkeypatch.setattr(cpu_kernels.torch, "__version__", torch.__version__)
    assert base.cflags[0] == "-O3"
    monkeypatch.setenv("RADIXRT_KERNEL_OPT", "-O1")  # the tests' lower-ISA builds
    quick = cpu_kernels.build_spec()
    assert quick.cflags[0] == "-O1" and "-O3" not in quick.cflags and quick.key != base.key
    monkeypatch.setenv("RADIXRT_KERNEL_OPT", "-Ofast")
    with pytest.raises(ValueError, match="RADIXRT_KERNEL_OPT"):
        cpu_kernels.build_spec()


def test_a_stale_extension_lock_is_removed_before_building(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A build killed mid-way leaves torch's cpp_extension `lock` file in the build directory;
    the next build (under radixrt's own flock, so no other build of the key runs) removes it
    instead of waiting on it forever."""
    monkeypatch.setenv("RADIXRT_KERNEL_CACHE", str(tmp_path))
    spec = cpu_kernels.build_spec()
    spec.directory.mkdir(parents=True)
    (spec.directory / "lock").write_text("")
    seen = []

    def compile_(s: object, verbose: bool) -> None:
        seen.append((spec.directory / "lock").exists())
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_kernels, "_compile", compile_)
    with pytest.raises(RuntimeError, match="no compiler here"):
        cpu_kernels._build_and_load(spec, force=False, verbose=False)
    assert seen == [False]


def _flags_without_paths(args: list[str]) -> list[str]:
    """Compiler flags less include paths (`-I dir`, `-Idir`, `-isystem dir`)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-I", "-isystem"):
            skip = True
        elif not a.startswith("-I"):
            out.append(a)
    return out


def test_precompiled_header_gets_the_flags_every_source_gets(tmp_path: Path) -> None:
    """GCC uses the precompiled torch headers only under the macros, language, target and
    optimisation flags of the source that includes them: the precompile command carries exactly
    those `cpp_extension` wrote into this machine's build.ninja (a torch that changes them would
    silently slow every build back down). Its ~0.4 GB output is gone once the library is built."""
    spec = cpu_kernels.build_spec()
    ninja = spec.directory / "build.ninja"
    if not ninja.exists():
        pytest.skip("this machine's kernel library was not built here by ninja")
    line = next(x for x in ninja.read_text().splitlines() if x.startswith("cflags = "))
    built = [f for f in _flags_without_paths(shlex.split(line[len("cflags = "):]))
             if f != "-Winvalid-pch"]
    cmd = cpu_kernels._pch_command(spec, tmp_path / "h.gch")
    header = str(cpu_kernels.SOURCE_DIR / cpu_kernels.PCH_HEADER)
    assert cmd[1:3] == ["-x", "c++-header"] and cmd[-3:] == [header, "-o", str(tmp_path / "h.gch")]
    assert _flags_without_paths(cmd[3:-3]) == built
    assert any(f.startswith("-DTORCH_EXTENSION_NAME=") for f in built)
    assert not (spec.directory / "pch").exists()


def test_sources_include_the_precompiled_header_first() -> None:
    """A precompiled header applies only as a source's first include; fused_ops.cpp's
    `fp-contract=off` pragma must precede the torch headers, so it parses them itself."""
    for name in cpu_kernels.SOURCES:
        includes = [x for x in (cpu_kernels.SOURCE_DIR / name).read_text().splitlines()
                    if x.startswith("#include")]
        first = includes[0].split("//")[0].strip()
        if name == "fused_ops.cpp":
            assert all(cpu_kernels.PCH_HEADER not in x for x in includes)
        else:
            assert first == f"#include <{cpu_kernels.PCH_HEADER}>", name


def test_a_failed_precompile_builds_without_it(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """No usable compiler for the header: no include directory is offered, and the build
    parses the headers in each source."""
    monkeypatch.setenv("RADIXRT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    spec = cpu_kernels.build_spec()
    assert cpu_kernels._precompile_headers(spec) is None
    assert not (spec.directory / "pch").exists()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels._precompile_headers(spec) is None
    assert not (spec.directory / "pch").exists()


def test_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """No compiler: one warning, a failed.log so later processes skip the build, and a backend
    that decodes through the torch path (or refuses, when the kernel is required)."""
    monkeypatch.setenv("RADIXRT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_failed", None)
    calls = []

    def no_compiler(spec: cpu_kernels.BuildSpec, verbose: bool) -> None:
        calls.append(spec)
        raise FileNotFoundError("c++: not found")

    monkeypatch.setattr(cpu_kernels, "_compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert not cpu_kernels.load_cpu_kernels()
        assert not cpu_kernels.load_cpu_kernels()
        kv = TokenToKVPool(8, 1, 2, 64)
        backend = TorchNativeBackend(kv)
    assert len(calls) == 1 and len(caplog.records) == 1
    assert "torch fallback" in caplog.records[0].getMessage()
    assert backend.decode_kernel is False
    assert "c++: not found" in calls[0].failed_log.read_text()
    with pytest.raises(RuntimeError, match="paged decode kernel unavailable"):
        TorchNativeBackend(kv, decode_kernel=True)
    # A new process (fresh module state) sees failed.log and does not try again.
    monkeypatch.setattr(cpu_kernels, "_failed", None)
    assert not cpu_kernels.load_cpu_kernels() and len(calls) == 1
    assert "earlier build failed" in (cpu_kernels.unavailable_reason() or "")


def test_unsupported_pool_is_reported() -> None:
    assert paged_decode_unavailable_reason(torch.float64, 64) is not None
    assert "head_dim 24" in (paged_decode_unavailable_reason(torch.float32, 24) or "")
    assert paged_decode_unavailable_reason(torch.bfloat16, 64) is None


_SUBPROCESS_CHECK = textwrap.dedent("""
    import torch
    from radixrt.attention import cpu_kernels
    assert cpu_kernels.load_cpu_kernels(), cpu_kernels.unavailable_reason()
    print(torch.ops.radixrt.paged_decode_isa())
    g = torch.Generator().manual_seed(0)
    kb = torch.randn(500, 2, 64, generator=g).bfloat16()
    vb = torch.randn(500, 2, 64, generator=g).bfloat16()
    q = torch.randn(3, 6, 64, generator=g).bfloat16()
    idx = torch.randint(0, 500, (800,), generator=g, dtype=torch.int32)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)
    out, lse = torch.ops.radixrt.paged_decode(q, kb, vb, idx, i64([40, 80, 120]),
        i64([40, 1, 677]), i64([0]), i64([40]), i64([0, 2]), i64([0, 2]), 0.125)
    for b, (s, n) in enumerate([(40, 40), (80, 1), (120, 677)]):
        sl = idx[s:s + n].long()
        if b != 1:
            sl = torch.cat([idx[:40].long(), sl])
        k = kb[sl].double().repeat_interleave(3, 1)
        v = vb[sl].double().repeat_interleave(3, 1)
        sc = torch.einsum("hd,khd->hk", q[b].double(), k) * 0.125
        ref = torch.einsum("hk,khd->hd", sc.softmax(-1), v)
        assert (out[b].double() - ref).abs().max() < 2e-2
        assert (lse[b].double() - sc.logsumexp(-1)).abs().max() < 2e-5
    print("ok")
""")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_other_instruction_sets_build_and_agree(isa: str) -> None:
    """The lower instruction sets (AVX2 machines, non-x86) built here and checked against the
    reference in a fresh process (one kernel library per process). Cached after the first run."""
    assert run_isa_check(isa, _SUBPROCESS_CHECK).split() == [isa.upper(), "ok"]


# -- through a model ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_model_decode_kernel_matches_torch_path(tmp_path: Path, dtype: torch.dtype) -> None:
    """Three requests sharing a 40-token cached prefix (cascade) and one alone, 6 greedy decode
    steps: the kernel and the torch path give the same tokens; fp32 logits match HF to 1e-4."""
    hf = make_tiny_checkpoint(tmp_path, "llama", seed=4)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 256, (40,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7, 1)]
    alone = torch.randint(0, 256, (12,), generator=g).tolist()
    runs = {}
    for kernel in (True, False):
        runner = PagedRunner.create(tmp_path, dtype=dtype)
        runner.model.attn_backend = TorchNativeBackend(runner.kv_pool, decode_kernel=kernel)
        first = runner.new_request()
        runner.extend([first], [prefix])
        rows = [runner.share_prefix(first, len(prefix)) for _ in tails] + [runner.new_request()]
        seqs = [prefix + t for t in tails] + [list(alone)]
        logits = runner.extend(rows, [t for t in tails] + [alone])
        steps = []
        for _ in range(6):
            for s, tok in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                s.append(tok)
            logits = runner.decode(rows, [s[-1] for s in seqs])
            backend = runner.model.attn_backend
            assert isinstance(backend, TorchNativeBackend)
            grouped = backend._kernel if kernel else backend._cascade
            assert grouped is not None and grouped.num_groups == 1
            steps.append(logits)
        runs[kernel] = (seqs, steps)
    assert runs[True][0] == runs[False][0]  # same greedy tokens
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(a, b, atol=tol * max(1.0, float(b.abs().max())), rtol=0)
    if dtype == torch.float32:
        seqs, steps = runs[True]
        for row, seq in zip(steps[-1], seqs, strict=True):
            torch.testing.assert_close(row, hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (6, 3, 80)])
def test_head_major_pool_gives_the_same_bits(dtype: torch.dtype, heads: int, kv_heads: int,
                                             dim: int) -> None:
    """The kernel reads the pool's strides: a head-major pool (the CPU default) and a slot-major
    one holding the same values give bitwise the same outputs, cascade groups included."""
    c = _case(5, dtype, heads, kv_heads, dim, LENS, [(40, [0, 3, 5]), (70, [1, 9])])
    hm = dict(c, kb=_head_major(c["kb"]), vb=_head_major(c["vb"]))
    assert hm["kb"].stride() == (dim, c["kb"].shape[0] * dim, 1)
    want, got = _run(c, dim**-0.5), _run(hm, dim**-0.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _positions(n: int, seed: int) -> dict[str, torch.Tensor]:
    """New pool slots for the n keys of a case's index list: all consecutive (`run`: one run, as
    a request's allocation gives), and runs of 1-40 slots in shuffled order (`runs`: blocks of
    16 keys that are consecutive or not, broken anywhere)."""
    g = torch.Generator().manual_seed(seed)
    cuts, at = [], 0
    while at < n:
        step = int(torch.randint(1, 41, (1,), generator=g))
        cuts.append(torch.arange(at, min(n, at + step)))
        at += step
    order = torch.randperm(len(cuts), generator=g).tolist()
    runs = torch.cat([cuts[i] for i in order]) if cuts else torch.zeros(0, dtype=torch.int64)
    return {"run": torch.arange(n), "runs": runs}


def _relocated(c: dict[str, Any], pos: torch.Tensor, names: tuple[str, ...]) -> dict[str, Any]:
    """`c` with key i of its index list moved to pool slot pos[i] (a pool of len(pos) slots,
    each pool tensor in `names` keeping its layout: head-major stays head-major)."""
    out = dict(c, idx=pos.to(torch.int32))
    src = c["idx"].long()
    for name in names:
        t = c[name]
        moved = torch.empty((pos.numel(), *t.shape[1:]), dtype=t.dtype)
        moved[pos] = t[src]
        head_major = t.dim() > 1 and t.stride(0) < t.stride(1)
        out[name] = _head_major(moved) if head_major else moved
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [(LENS, []), ([3, 9, 1, 40], [(40, [0, 1, 2])])],
                         ids=["flat", "cascade"])
def test_result_does_not_depend_on_where_keys_lie(dtype: torch.dtype, case: tuple) -> None:
    """The same keys in scattered slots, in one run of consecutive slots, or in runs of 1-40
    broken anywhere (head-major pools, as the CPU's): bitwise the same outputs and LSE."""
    own, groups = case
    c = _case(11, dtype, 9, 3, 64, own, groups)
    c = dict(c, kb=_head_major(c["kb"]), vb=_head_major(c["vb"]))
    want = _run(c, 0.125)
    for name, pos in _positions(c["idx"].numel(), 3).items():
        got = _run(_relocated(c, pos, ("kb", "vb")), 0.125)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


def test_k_and_v_of_different_layouts_are_refused() -> None:
    c = _case(6, torch.float32, 4, 2, 64, [3, 5], [])
    with pytest.raises(RuntimeError, match="alike"):
        _run(dict(c, vb=_head_major(c["vb"])), 0.125)
    with pytest.raises(RuntimeError, match="D contiguous"):
        _run(dict(c, kb=c["kb"].transpose(0, 2).contiguous().transpose(0, 2),
                  vb=c["vb"].transpose(0, 2).contiguous().transpose(0, 2)), 0.125)
