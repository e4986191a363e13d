"""Run a check script against the C++ kernel library built for a lower instruction set.

One kernel library is loaded per process, so each ISA is checked in a fresh interpreter with
`RADIXRT_CPU_ISA` set; the build is cached after the first run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixrt.attention import cpu_kernels


def run_isa_check(isa: str, script: str, timeout: int = 900) -> str:
    """stdout of `script` run under the library built for `isa` (skips when this CPU cannot
    run it; fails with the child's stderr when the script fails)."""
    if isa != "default" and cpu_kernels.choose_isa(requested=isa) != isa:
        pytest.skip(f"this CPU cannot run {isa}")
    env = dict(os.environ, RADIXRT_CPU_ISA=isa)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
