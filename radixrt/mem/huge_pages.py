"""Long-lived CPU tensors on 2 MiB transparent huge pages.

A decode step streams every weight and every cached K/V row it attends through the TLB: ~100 MB
of weights and (batch 8, 512 tokens) ~100 MB of K/V per step for SmolLM2. On 4 KiB pages that is
~50k page walks per step, and the hardware prefetchers stop at every 4 KiB boundary. The pool
buffers and the model's tensors therefore live in 2 MiB-aligned buffers advised
`MADV_HUGEPAGE` before anything touches them (`huge_page_buffer`: a private anonymous mapping of
its own, so no page of it was touched before), so the kernel backs them with huge pages where
its THP mode is `madvise` or `always`.

torch's own switch (THP_MEM_ALLOC_ENABLE, read once at the process's first allocation) advises
only allocations of at least 2 MiB, without aligning them, and page-aligns every allocation
however small: it would leave every per-layer weight here (each under 2 MiB) and the used head
of each pool buffer on small pages. Hence explicit buffers, each holding many tensors, that work
in any process whatever its environment or import order.

Invariant: `move_to_huge_pages` keeps every tensor object and its values; only its storage
changes (`Tensor.set_`), so whoever holds a tensor (modules, the C++ decode stack's lists) sees
the new storage. Tensors that shared a storage still share one afterwards.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_ALIGN = 64  # each moved storage starts on a cache line


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised (zero-filled) uint8 CPU tensor of `nbytes` starting on a 2 MiB boundary,
    in fresh anonymous memory (its own mmap, never pages the process touched before) advised
    for huge pages before its first touch, so the first write faults in 2 MiB pages. Falls back
    to the same layout on small pages where the kernel refuses the advice. The mapping lives as
    long as the tensor (or any view of it)."""
    if nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    # private: an anonymous MAP_SHARED mapping is shmem, outside THP's `madvise` mode
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # holds `mm`
    start = raw.data_ptr()
    offset = (-start) % HUGE_PAGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    try:
        if advise is None:
            raise OSError("no MADV_HUGEPAGE on this platform")
        mm.madvise(advise, offset, (len(mm) - offset) // mmap.PAGESIZE * mmap.PAGESIZE)
    except OSError as e:
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s); %d bytes stay on small pages", e,
                     nbytes)
    return raw[offset:offset + nbytes]


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copies the distinct storages behind the CPU `tensors` into one `huge_page_buffer` and
    points each tensor at its copy (same object, same values, same sizes, strides and offset
    within its storage). Returns the bytes moved. Non-CPU and sparse tensors are left where they
    are."""
    by_storage: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or t.untyped_storage().nbytes() == 0:
            continue
        s = t.untyped_storage()
        entry = by_storage.setdefault(s.data_ptr(), (s, []))
        if not any(u is t for u in entry[1]):
            entry[1].append(t)
    if not by_storage:
        return 0
    places, total = {}, 0
    for key, (s, _) in by_storage.items():
        places[key] = total
        total += -(-s.nbytes() // _ALIGN) * _ALIGN
    buf = huge_page_buffer(total)
    storage, base = buf.untyped_storage(), buf.storage_offset()
    with torch.no_grad():
        for key, (s, ts) in by_storage.items():
            at = base + places[key]
            old = torch.empty(0, dtype=torch.uint8).set_(s)
            buf[places[key]:places[key] + s.nbytes()].copy_(old)
            for t in ts:
                size = t.element_size()
                t.set_(storage, at // size + t.storage_offset(), t.size(), t.stride())
    return total


def huge_page_info() -> dict[str, object]:
    """The kernel's THP mode (`madvise`, `always`, `never`; None where unreadable) and the MiB
    of this process's anonymous memory on huge pages now (None where unreadable)."""
    mode = None
    try:
        with open(THP_MODE_FILE) as f:
            mode = next((w.strip("[]") for w in f.read().split() if w.startswith("[")), None)
    except OSError:
        pass
    huge_mb = None
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    huge_mb = int(line.split()[1]) / 1024
    except OSError:
        pass
    return {"thp_mode": mode, "anon_huge_mb": huge_mb}
