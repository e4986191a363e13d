"""radixrt/mem/step_heap.py: freed step-sized tensors stay in the heap (no page faults when the
next step allocates them again), and ServerArgs.disable_heap_retention reaches the runner."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from model_fixtures import make_tiny_runner

from radixrt.model import runner as runner_mod

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# In a fresh process: a 24 MiB tensor written, freed, then allocated and written again. By
# default glibc serves the first from a mapping of its own (its mmap threshold starts at 128 KiB)
# and unmaps it when freed, so its pages go back to the kernel, and the second allocation faults
# every page in afresh. Retained, both come from the heap and the second reuses the first's pages.
_STEPS = """
import json, os, resource, sys, torch
if sys.argv[1] == "retain":
    from radixrt.mem.step_heap import retain_step_heap
    print(retain_step_heap(), file=sys.stderr)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
t = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
held = rss()
del t
released = held - rss()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
print(json.dumps([released, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


def _free_then_again(mode: str) -> tuple[int, int]:
    """(bytes given back to the kernel by the free, page faults of the second allocation)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                         cwd=root, check=True, timeout=120)
    released, faults = json.loads(out.stdout.strip().splitlines()[-1])
    return released, faults


@needs_glibc
def test_retained_heap_reuses_pages() -> None:
    """A freed 24 MiB tensor: by default its pages go back to the kernel and the next one of
    that size faults all 6144 in again; retained, none go back and the next one reuses them."""
    default_released, default_faults = _free_then_again("default")
    released, faults = _free_then_again("retain")
    assert default_released > 20 << 20 and default_faults > 5000, (default_released,
                                                                    default_faults)
    assert released < 1 << 20 and faults < 100, (released, faults)


@pytest.mark.parametrize("disable", [False, True])
def test_runner_retains_unless_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        disable: bool) -> None:
    calls: list[int] = []
    monkeypatch.setattr(runner_mod, "retain_step_heap", lambda: calls.append(1) or "test")
    make_tiny_runner(tmp_path / "hf", disable_heap_retention=disable)
    assert len(calls) == (0 if disable else 1)
