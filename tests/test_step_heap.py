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

# In a fresh process, four "steps", each allocating and writing twenty 8 MiB tensors (160 MiB)
# and then freeing them all; per step: (page faults while allocating, bytes the frees gave back
# to the kernel). By default glibc maps the first step's tensors one by one (its mmap threshold
# starts at 128 KiB) and unmaps them when freed, and trims the heap's free top afterwards, so the
# second step faults all 40960 pages in again. Retained, nothing goes back, and later steps
# reuse the first one's pages. Not every one of them: a small allocation (a tensor's C++
# object, the interpreter's own) may land inside a freed block and split it, so one or two 8 MiB
# blocks may come fresh once more (seen: 0-6144 faults over the three later steps in 100 runs).
_STEPS = """
import json, os, resource, sys, torch
if sys.argv[1] == "retain":
    from radixrt.mem.step_heap import retain_step_heap
    print(retain_step_heap(), file=sys.stderr)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
held = [None] * 20
steps = []
for _ in range(4):
    before = faults()
    for i in range(20):
        held[i] = torch.empty(8 << 20, dtype=torch.uint8).fill_(1)
    faulted = faults() - before
    top = rss()
    for i in range(20):
        held[i] = None
    steps.append([faulted, top - rss()])
print(json.dumps(steps))
"""


def _steps(mode: str) -> list[tuple[int, int]]:
    """Per step: (page faults while allocating, bytes given back to the kernel by the frees)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                         cwd=root, check=True, timeout=120)
    return [tuple(s) for s in json.loads(out.stdout.strip().splitlines()[-1])]


@needs_glibc
def test_retained_heap_reuses_pages() -> None:
    """By default the first step's 160 MiB go back to the kernel and the second step faults
    them all in again; retained, no step gives pages back and the three later steps together
    fault in under half of one step's pages (a freed block split by a small allocation may be
    replaced once, see _STEPS)."""
    default = _steps("default")
    retained = _steps("retain")
    assert default[0][1] > 100 << 20 and default[1][0] > 30000, default
    assert all(released < 1 << 20 for _, released in retained), retained
    assert sum(faulted for faulted, _ in retained[1:]) < 20000, retained


@pytest.mark.parametrize("disable", [False, True])
def test_runner_retains_unless_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        disable: bool) -> None:
    calls: list[int] = []
    monkeypatch.setattr(runner_mod, "retain_step_heap", lambda: calls.append(1) or "test")
    make_tiny_runner(tmp_path / "hf", disable_heap_retention=disable)
    assert len(calls) == (0 if disable else 1)
