"""Checks shared by the C++ kernel tests.

`run_isa_check`: a check script against the kernel library built for a lower instruction set.
One kernel library is loaded per process, so each ISA is checked in a fresh interpreter with
`RADIXRT_CPU_ISA` set; the build is cached after the first run. `assert_rows_independent`:
batch invariance of a row-wise op. `assert_flag_only_with`: an ISA's extra compiler flag.
`with_threads`: a call at a given intra-op thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

import pytest
import torch

from radixrt.attention import cpu_kernels

T = TypeVar("T")


def with_threads(n: int, fn: Callable[[], T]) -> T:
    """`fn()` with torch's intra-op thread count set to `n` (restored after)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(threads)


def run_isa_check(isa: str, script: str, timeout: int = 900) -> str:
    """stdout of `script` run under the library built for `isa` (skips when this CPU cannot
    run it; fails with the child's stderr when the script fails)."""
    if isa != "default" and cpu_kernels.choose_isa(requested=isa) != isa:
        pytest.skip(f"this CPU cannot run {isa}")
    env = dict(os.environ, RADIXRT_CPU_ISA=isa)
    if isa != cpu_kernels.choose_isa():
        # A lower ISA than this machine's is built only for these checks of agreement: -O1
        # compiles in about half the time (the machine's own build stays at the default -O3).
        env["RADIXRT_KERNEL_OPT"] = "-O1"
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def assert_rows_independent(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                            counts: Iterable[int]) -> None:
    """Each output row of `fn` is bitwise the same whatever the row count (the first m rows, and
    row m - 1 alone, for each m in `counts`) and whatever the thread count (1 vs the current)."""
    full = fn(x)
    for m in counts:
        assert torch.equal(fn(x[:m]), full[:m])
        assert torch.equal(fn(x[m - 1 : m]), full[m - 1 : m])
    assert torch.equal(with_threads(1, lambda: fn(x)), full)


def assert_flag_only_with(monkeypatch: pytest.MonkeyPatch, cache: str, cpu_flag: str,
                          cflag: str) -> None:
    """The avx512 build adds `cflag` exactly when /proc/cpuinfo lists `cpu_flag`; avx2 never."""
    monkeypatch.setenv("RADIXRT_KERNEL_CACHE", cache)
    monkeypatch.delenv("RADIXRT_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    base = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"})
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base)
    assert cflag not in cpu_kernels.build_spec().cflags
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: base | {cpu_flag})
    assert cflag in cpu_kernels.build_spec().cflags
    assert cflag not in cpu_kernels.build_spec("avx2").cflags
