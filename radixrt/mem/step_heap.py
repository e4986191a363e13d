"""A step's CPU tensors reused from the process heap instead of fresh pages.

glibc's malloc serves a request above its mmap threshold (128 KiB at start, raised as mapped
chunks are freed, up to 32 MiB) with a mapping of its own, unmapped again when freed, and gives
the heap's free top back to the kernel above its trim threshold. A large step allocates and
frees the same big intermediates every time (an 8 x 512-token prefill: gate_up alone 25 MB in
bf16, ~200 MB in all), so each step faulted its pages in anew, the kernel zeroing every one:
measured 50k page faults and ~0.1 s of kernel time per such step, ~10% of it.

`retain_step_heap()` fixes the mmap threshold at glibc's largest (32 MiB, `MAX_MMAP_THRESHOLD`;
larger requests still get mappings of their own) and turns trimming off, so a freed step tensor
stays in the heap (up to a 2 GiB free top) and the next step's allocation of that size reuses its pages. The price: the
process keeps its largest step's working set resident instead of returning it between steps.

Process-wide, and glibc only (elsewhere it changes nothing and says so). The scheduler's model
runner calls it at start-up unless `ServerArgs.disable_heap_retention`.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
NO_TRIM = 2**31 - 1  # mallopt takes an int: a free heap top under 2 GiB is never trimmed


def retain_step_heap() -> str:
    """Keeps freed allocations of up to MAX_MMAP_THRESHOLD in this process's heap (see module
    docstring); returns what was done, for the log. Never raises."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc: allocator unchanged"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "mallopt unavailable: allocator unchanged"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok_mmap = mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1
    ok_trim = mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1
    if not (ok_mmap and ok_trim):
        return f"mallopt refused (mmap threshold {ok_mmap}, trim threshold {ok_trim})"
    return (f"freed allocations up to {MAX_MMAP_THRESHOLD >> 20} MiB stay in the heap "
            "(mmap threshold fixed, trimming off)")
