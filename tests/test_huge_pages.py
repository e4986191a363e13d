"""`radixrt.mem.huge_pages`: the KV pool and the model's tensors in 2 MiB-aligned buffers advised
for transparent huge pages, without changing any tensor's identity, values or layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_runner

from radixrt.mem.huge_pages import HUGE_PAGE, huge_page_buffer, huge_page_info, move_to_huge_pages
from radixrt.mem.memory_pool import TokenToKVPool

THP = huge_page_info()["thp_mode"]
needs_thp = pytest.mark.skipif(
    THP not in ("madvise", "always") or not os.path.exists("/proc/self/smaps"),
    reason=f"kernel THP mode {THP!r} (needs madvise or always, and /proc/self/smaps)")


def huge_kb_at(addr: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that contains `addr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_buffer_is_aligned_and_sized() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 100
    assert buf.data_ptr() % HUGE_PAGE == 0
    small = huge_page_buffer(1000)  # under one huge page: a plain allocation
    assert small.numel() == 1000


@needs_thp
def test_buffer_lands_on_huge_pages() -> None:
    buf = huge_page_buffer(8 * HUGE_PAGE)
    buf.fill_(1)
    assert huge_kb_at(buf.data_ptr()) >= 4 * HUGE_PAGE // 1024


def test_move_keeps_identity_values_layout_and_sharing() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 70, generator=g)
    b = torch.randn(1000, generator=g).to(torch.bfloat16)
    base = torch.randn(50, 40, generator=g)
    view_t = base.t()  # shares base's storage, strided
    view_s = base[10:20]  # shares it with a storage offset
    tensors = [a, b, base, view_t, view_s]
    before = [(t.clone(), t.size(), t.stride(), t.storage_offset()) for t in tensors]
    old_bytes = sum(t.untyped_storage().nbytes() for t in (a, b, base))
    moved = move_to_huge_pages([*tensors, a])  # a listed twice: moved once
    assert old_bytes <= moved < old_bytes + 3 * 64  # each storage once, 64-byte aligned
    for t, (vals, size, stride, _) in zip(tensors, before, strict=True):
        assert torch.equal(t, vals) and t.size() == size and t.stride() == stride
    # views keep their place relative to their base
    assert view_t.storage_offset() == base.storage_offset()
    assert view_s.storage_offset() - base.storage_offset() == before[4][3] - before[2][3]
    # one buffer for all; tensors that shared a storage still share it
    ptr = a.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == ptr for t in tensors)
    base.zero_()
    assert float(view_t.abs().sum()) == 0 and float(view_s.abs().sum()) == 0
    assert float(a.abs().sum()) > 0  # a separate region of the buffer
    assert view_t.data_ptr() == base.data_ptr() and view_s.data_ptr() == base[10].data_ptr()


def test_pool_buffers_are_disjoint_views() -> None:
    pool = TokenToKVPool(5000, 3, 2, 16, torch.float32)
    bufs = [*pool.k_buffer, *pool.v_buffer]
    # Head-major on CPU: slot stride head_dim, head stride one head's whole run of slots.
    assert all(b.shape == (5001, 2, 16) and b.stride() == (16, 5001 * 16, 1) for b in bufs)
    assert all(float(b[0].abs().sum()) == 0 for b in bufs)  # the padding slot
    for i, b in enumerate(bufs):
        b[1:].fill_(float(i + 1))
    for i, b in enumerate(bufs):
        assert torch.all(b[1:] == i + 1)  # no buffer overlaps another
    plain = TokenToKVPool(5000, 3, 2, 16, torch.float32, huge_pages=False)
    ptrs = {b.untyped_storage().data_ptr() for b in (*plain.k_buffer, *plain.v_buffer)}
    assert len(ptrs) == 6  # one allocation per buffer
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1
    slot_major = TokenToKVPool(5000, 3, 2, 16, torch.float32, head_major=False)
    assert all(b.is_contiguous() for b in (*slot_major.k_buffer, *slot_major.v_buffer))


@needs_thp
def test_pool_slots_land_on_huge_pages() -> None:
    pool = TokenToKVPool(40000, 2, 3, 64, torch.bfloat16)  # ~15 MiB per buffer
    pool.k_buffer[0][1:8000].fill_(1.0)  # the head of the first buffer, as a short run fills it
    assert huge_kb_at(pool.k_buffer[0][1].data_ptr()) > 0


@pytest.mark.parametrize("disable", [False, True])
def test_runner_moves_model_tensors_unless_disabled(tmp_path: Path, disable: bool) -> None:
    runner = make_tiny_runner(tmp_path, layers=2, disable_huge_pages=disable)
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert (len(storages) == 1) is (not disable)
    kv = runner.token_to_kv_pool
    kv_storages = {b.untyped_storage().data_ptr() for b in (*kv.k_buffer, *kv.v_buffer)}
    assert (len(kv_storages) == 1) is (not disable)
