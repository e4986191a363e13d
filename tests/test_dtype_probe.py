"""`dtype="auto"` on CPU: the start-up fp32-vs-bf16 matmul probe and `resolve_dtype`.

The decision is tested with injected timings (never this CPU's); one test runs the real probe
only for its shape and cost."""

from __future__ import annotations

import math
import time

import pytest
import torch

from radixrt.model import dtype_probe
from radixrt.model.dtype_probe import ENV_FORCE, DtypeProbe, probe_cpu_dtype
from radixrt.model.loader import resolve_dtype
from radixrt.model.model_config import ModelConfig

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _unforced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FORCE, raising=False)  # conftest forces float32 for other tests


def _config(torch_dtype: torch.dtype | None = None) -> ModelConfig:
    cfg = ModelConfig.__new__(ModelConfig)
    object.__setattr__(cfg, "torch_dtype", torch_dtype)
    return cfg


@pytest.mark.parametrize("fp32,bf16,expect", [
    (2.0, 1.0, torch.bfloat16),  # bf16 2x faster (AVX-512-BF16 / AMX)
    (1.0, 30.0, torch.float32),  # emulated bf16
    (1.2, 1.0, torch.float32),  # faster, but not clearly (< MIN_SPEEDUP)
    (1.3, 1.0, torch.bfloat16),  # exactly MIN_SPEEDUP
])
def test_decision_from_injected_timings(fp32: float, bf16: float, expect: torch.dtype) -> None:
    p = probe_cpu_dtype(measure=lambda: (fp32 * 1e-3, bf16 * 1e-3), flags=frozenset({"avx2"}))
    assert p.choice == expect and not p.forced
    assert p.fp32_ms == pytest.approx(fp32) and p.bf16_ms == pytest.approx(bf16)
    assert p.speedup == pytest.approx(fp32 / bf16)
    assert p.threads == torch.get_num_threads()
    assert str(expect).removeprefix("torch.") in p.describe()
    assert p.as_info()["choice"] == str(expect).removeprefix("torch.")


@pytest.mark.parametrize(("flag", "expect"), [("amx_bf16", torch.bfloat16),
                                              ("avx512_bf16", torch.bfloat16),
                                              ("avx512_vnni", torch.float32)])
def test_native_bf16_needs_only_to_be_no_slower(flag: str, expect: torch.dtype) -> None:
    """A CPU listing native bf16 takes it at 1.2x (a loaded start-up reading); others need
    MIN_SPEEDUP; bf16 slower than fp32 is refused even where it is native."""
    from radixrt.model import dtype_probe

    p = probe_cpu_dtype(measure=lambda: (1.2e-3, 1e-3), flags=frozenset({"avx2", flag}))
    assert p.choice == expect
    assert f"needs >= {p.min_speedup}x" in p.describe()
    assert p.min_speedup == (dtype_probe.NATIVE_MIN_SPEEDUP if expect == torch.bfloat16
                             else dtype_probe.MIN_SPEEDUP)
    slower = probe_cpu_dtype(measure=lambda: (1e-3, 1.5e-3), flags=frozenset({flag}))
    assert slower.choice == torch.float32
    assert dtype_probe.native_bf16(frozenset({"amx_bf16"}))
    assert not dtype_probe.native_bf16(frozenset({"avx512f", "avx512_vnni"}))


def test_a_reading_near_the_threshold_is_measured_again() -> None:
    """A loaded first reading (1.33x) is timed again and each dtype keeps its best time; clear
    readings are timed once, and an ambiguous machine stops after RETRIES more."""
    from radixrt.model import dtype_probe

    readings = iter([(1.0e-3, 0.75e-3), (0.55e-3, 0.5e-3), (0.9e-3, 0.27e-3), (5.0, 5.0)])
    calls = []

    def measure() -> tuple[float, float]:
        calls.append(1)
        return next(readings)

    p = probe_cpu_dtype(measure=measure, flags=frozenset())
    assert len(calls) == 3  # 1.33x, then 0.55 / 0.5 = 1.1x: still near; then 0.55 / 0.27
    assert p.fp32_ms == pytest.approx(0.55) and p.bf16_ms == pytest.approx(0.27)
    assert p.choice == torch.bfloat16
    calls.clear()
    assert probe_cpu_dtype(measure=lambda: calls.append(1) or (2e-3, 1e-3),
                           flags=frozenset()).choice == torch.bfloat16 and len(calls) == 1
    calls.clear()
    near = probe_cpu_dtype(measure=lambda: calls.append(1) or (1.25e-3, 1e-3), flags=frozenset())
    assert near.choice == torch.float32 and len(calls) == 1 + dtype_probe.RETRIES


def test_without_dense_matmuls_takes_bf16_where_it_halves_kv_unless_forced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slow_bf16 = probe_cpu_dtype(measure=lambda: (1e-3, 30e-3))
    assert slow_bf16.choice == torch.float32 and slow_bf16.note is None
    p = slow_bf16.without_dense_matmuls(halves_kv=True)
    assert p.choice == torch.bfloat16 and p.fp32_ms == slow_bf16.fp32_ms
    assert p.note and p.note in p.describe() and p.as_info()["note"] == p.note
    kept = slow_bf16.without_dense_matmuls(halves_kv=False)  # float16 / int8 K/V under fp32
    assert kept.choice == torch.float32 and kept.note and "fp32 stays" in kept.describe()
    fast_bf16 = probe_cpu_dtype(measure=lambda: (2e-3, 1e-3))
    for halves in (True, False):
        assert fast_bf16.without_dense_matmuls(halves) is fast_bf16
    monkeypatch.setenv(ENV_FORCE, "float32")
    forced = probe_cpu_dtype()
    for halves in (True, False):
        assert forced.without_dense_matmuls(halves) is forced  # a forced outcome is kept


@pytest.mark.parametrize("forced", ["float32", "bfloat16"])
def test_env_forces_the_outcome_without_measuring(monkeypatch: pytest.MonkeyPatch,
                                                  forced: str) -> None:
    monkeypatch.setenv(ENV_FORCE, forced)

    def never() -> tuple[float, float]:
        raise AssertionError("measured although forced")

    p = probe_cpu_dtype(measure=never)
    assert p.choice == getattr(torch, forced) and p.forced and p.fp32_ms is None
    assert ENV_FORCE in p.describe()
    monkeypatch.setenv(ENV_FORCE, "float16")
    with pytest.raises(ValueError, match=ENV_FORCE):
        probe_cpu_dtype(measure=never)


def test_resolve_dtype_auto_uses_the_probe_on_cpu_only() -> None:
    calls: list[int] = []

    def probe(choice: torch.dtype):  # noqa: ANN202
        def run() -> DtypeProbe:
            calls.append(1)
            return DtypeProbe(choice, 2.0, 1.0, 1)
        return run

    assert resolve_dtype("auto", CPU, _config(), probe(torch.bfloat16)) == torch.bfloat16
    assert resolve_dtype("auto", CPU, _config(), probe(torch.float32)) == torch.float32
    assert len(calls) == 2
    # An explicit dtype overrides `auto`: no probe.
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, CPU, _config(), probe(torch.bfloat16)) == getattr(torch, name)
    assert resolve_dtype(torch.float16, CPU, _config(), probe(torch.bfloat16)) == torch.float16
    # CUDA keeps the checkpoint's dtype, unprobed.
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, _config(torch.float16), probe(torch.bfloat16)) == (
        torch.float16)
    assert len(calls) == 2


def test_real_probe_is_cheap_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_probe, "_cached", None)
    t0 = time.perf_counter()
    p = probe_cpu_dtype()
    took = time.perf_counter() - t0
    assert p.choice in (torch.float32, torch.bfloat16) and not p.forced
    assert p.fp32_ms is not None and p.bf16_ms is not None
    assert math.isfinite(p.fp32_ms) and p.fp32_ms > 0 and math.isfinite(p.bf16_ms)
    assert took < 5.0  # ~0.3-0.7 s; generous for a loaded machine
    assert probe_cpu_dtype() is p  # once per process


def test_interleaved_best_takes_turns_and_stops_on_its_budget():
    from radixrt.model.probe_timing import interleaved_best

    calls: list[str] = []
    best = interleaved_best({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                            warmup=1, min_reps=3, max_reps=3)
    assert calls == ["a", "b"] * 4 and set(best) == {"a", "b"}
    assert all(0 <= t < 1 for t in best.values())
    calls.clear()
    interleaved_best({"a": lambda: calls.append("a")}, min_reps=2, max_reps=50, budget_s=0.0)
    assert calls == ["a", "a"]  # the budget is spent: stops once the minimum reps are in
