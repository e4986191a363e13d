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

# One "step": three 24 MiB tensors written, then freed together. Once freed they form a 72 MiB
# free heap top, over glibc's dynamic trim threshold (twice the largest freed mapping), so by
# default the top is trimmed and the next step faults every page in again.
_STEPS = """
import json, resource, sys, torch
if sys.argv[1] == "retain":
    from radixrt.mem.step_heap import retain_step_heap
    print(retain_step_heap(), file=sys.stderr)
def step():
    ts = [torch.empty(24 << 20, dtype=torch.uint8).fill_(1) for _ in range(3)]
    del ts
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5))
"""


def _faults_per_step(mode: str) -> float:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                         cwd=root, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_retained_heap_reuses_pages() -> None:
    """72 MiB of step tensors: thousands of page faults per step by default (each 4 KiB page
    faulted and zeroed again; 18432 pages in all; 2458-11059 seen, glibc's dynamic thresholds
    keep some), almost none once retained."""
    default, retained = _faults_per_step("default"), _faults_per_step("retain")
    assert default > 500, default
    assert retained < min(200, default / 10), (retained, default)


@pytest.mark.parametrize("disable", [False, True])
def test_runner_retains_unless_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        disable: bool) -> None:
    calls: list[int] = []
    monkeypatch.setattr(runner_mod, "retain_step_heap", lambda: calls.append(1) or "test")
    make_tiny_runner(tmp_path / "hf", disable_heap_retention=disable)
    assert len(calls) == (0 if disable else 1)
