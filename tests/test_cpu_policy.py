"""`radixrt.core.cpu_policy`: the environment each process gets, and the knobs' validation."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from radixrt.config import ServerArgs
from radixrt.core import cpu_policy


def test_passive_and_spin_environments():
    p = cpu_policy.omp_env(2, "passive")
    assert p["OMP_NUM_THREADS"] == p["MKL_NUM_THREADS"] == "2"
    assert p["OMP_WAIT_POLICY"] == "PASSIVE" and p["KMP_BLOCKTIME"] == "0"
    s = cpu_policy.omp_env(3, "spin")
    assert s == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}  # the runtime's own default
    b = cpu_policy.omp_env(2, "brief")  # the default: a bounded spin, then sleep
    assert ServerArgs().thread_wait == "brief"
    assert b["OMP_WAIT_POLICY"] is None  # unset: an inherited PASSIVE would override the count
    assert 0 < int(b["GOMP_SPINCOUNT"]) <= 100_000 and int(b["KMP_BLOCKTIME"]) >= 1
    with pytest.raises(ValueError, match="thread_wait"):
        cpu_policy.omp_env(2, "busy")
    h = cpu_policy.helper_env()
    assert h["OMP_NUM_THREADS"] == "1" and h["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize(("field", "value"), [("thread_wait", "busy"), ("helper_nice", -1),
                                              ("helper_nice", 20),
                                              ("startup_quiet_wait_s", -1.0),
                                              ("startup_quiet_wait_s", 61.0)])
def test_bad_knobs_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"ServerArgs.{field}"):
        ServerArgs(**{field: value})


def test_become_helper_lowers_priority_and_threads():
    code = ("import os, torch; from radixrt.core.cpu_policy import become_helper; "
            "before = os.getpriority(os.PRIO_PROCESS, 0); torch.set_num_threads(2); "
            "become_helper(3); print(os.getpriority(os.PRIO_PROCESS, 0) - before, "
            "torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=True)
    delta, threads = out.stdout.split()
    assert int(threads) == 1
    assert int(delta) == min(3, 19 - os.getpriority(os.PRIO_PROCESS, 0))


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc")


@needs_proc
def test_quiet_wait_sees_a_busy_process_and_its_end():
    """A busy loop beside us reads as about a core of other use, and the start-up wait holds
    for its whole bound; once the loop is gone, the wait returns at its first quiet reading."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert cpu_policy.other_cpu_use(0.3) > 0.5
        waited, use = cpu_policy.wait_for_quiet_cpus(0.6)
        assert waited >= 0.6 and use is not None and use > 0.25
    finally:
        busy.kill()
        busy.wait()
    waited, use = cpu_policy.wait_for_quiet_cpus(5.0)
    assert use is not None and use < 0.25 and waited < 5.0


def test_quiet_gate_waits_once(monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(cpu_policy, "wait_for_quiet_cpus",
                        lambda s: calls.append(s) or (0.0, 0.0))
    gate = cpu_policy.QuietBeforeTiming(2.5)
    gate()
    gate()
    assert calls == [2.5]
    cpu_policy.QuietBeforeTiming(0)()
    assert calls == [2.5]  # 0: never waits


@pytest.mark.parametrize(("dtype", "waits"), [("float32", 0), ("auto", 1)])
def test_runner_waits_only_before_a_probe(tmp_path, monkeypatch, dtype, waits):
    """The model runner waits for quiet CPUs once before its first start-up probe (dtype `auto`
    times fp32 against bf16), and not at all when every choice is given."""
    from model_fixtures import make_tiny_runner

    calls: list[float] = []
    monkeypatch.setattr(cpu_policy, "wait_for_quiet_cpus",
                        lambda s: calls.append(s) or (0.0, 0.0))
    make_tiny_runner(tmp_path / "hf", dtype=dtype, startup_quiet_wait_s=1.5)
    assert calls == [1.5] * waits
