"""`dtype="auto"` on CPU: time a model-shaped matmul in fp32 and bf16 once at start-up.

bf16 matmul speed depends on the CPU, not on anything we can read from torch cheaply: with
AVX-512-BF16 or AMX it can be ~2x faster than fp32; without native bf16 it is emulated and
7-100x slower. So `auto` measures (with the thread count already set for this process) and takes
bf16 only when it is clearly faster (>= MIN_SPEEDUP), fp32 otherwise; where the CPU lists native
bf16 (NATIVE_BF16_FLAGS), when it is no slower (a timing taken beside the server's other
processes starting up can understate a 2x speedup).

The matmul timing is the whole story only while matmuls run in the model dtype. Where every
matmul runs on the int8-activation vnni kernel with no dense copy (`ModelRunner` decides, once
the quantization is resolved), the dtype only stores activations and the K/V cache. `auto` then
takes bf16 even where bf16 matmul is slow when that halves the K/V bytes, i.e. when an fp32
model would keep fp32 K/V (`without_dense_matmuls`; measured on an AVX512-VNNI Xeon without
AVX512-BF16 in bench/results, stop 37). Where an fp32 model stores K/V as float16 (`kv_cache_dtype
auto` on CPU since stop 73) or int8, bf16 saves nothing but activation bytes and rounds more (on
Zen 3, stop 82: KL to the fp32 reference 5.2e-3 against 3.2e-3, step times within noise), so
fp32 stays. This also keeps the choice off the quantization probe's noise: whether the 8-bit
width wins at a prefill-sized count decides `no_dense_matmul`, and on Zen 3 it did in one start
of three, which then served other logits.

A reading near the threshold is measured again (AMBIGUITY, RETRIES), each dtype keeping its
best time, so that load from the server's other processes starting beside it does not decide.
`RADIXRT_AUTO_DTYPE=float32|bfloat16` forces the outcome without measuring (tests, or a
machine whose answer is known); an explicit `--dtype` bypasses `auto` altogether.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from radixrt.model.probe_timing import interleaved_best

ENV_FORCE = "RADIXRT_AUTO_DTYPE"
MIN_SPEEDUP = 1.3
# A speedup within this factor of MIN_SPEEDUP is measured again (up to RETRIES more times, each
# dtype keeping its best time over all of them): on the AMX Xeon of stop 52 one server start,
# whose HTTP and detokenizer processes were starting beside it, read 1.33x where the probe alone
# reads 2.0-2.1x; a few percent more load would have flipped the start to fp32.
AMBIGUITY, RETRIES = 1.3, 3
# Where /proc/cpuinfo lists native bf16 matmul (AVX512-BF16, AMX-BF16), bf16 needs only to be no
# slower than fp32: those CPUs ran it 2-2.6x faster, but a scheduler starting beside the server's
# other processes read 1.27-1.33x on the AMX Xeon (the probe alone: 2.0-2.1x), and one start
# resolved to fp32 timings for its quantization probe.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
NATIVE_MIN_SPEEDUP = 1.0
# A decode-sized and a prefill-sized GEMM of a small Llama (hidden 576, MLP 1536).
SHAPES = ((8, 576, 1536), (64, 576, 1536))
WARMUP = 3  # steps per dtype before timing (the first bf16 calls set up their kernels)
MIN_REPS, MAX_REPS = 3, 20
BUDGET_S = 0.3  # timed reps stop after this long (once MIN_REPS are in)

# () -> (fp32 seconds, bf16 seconds): best time of one probe step (every SHAPES matmul once).
Measure = Callable[[], tuple[float, float]]


@dataclass(frozen=True)
class DtypeProbe:
    choice: torch.dtype
    fp32_ms: float | None  # best time of one probe step (None when forced)
    bf16_ms: float | None
    threads: int
    forced: bool = False
    note: str | None = None  # why `choice` is not the matmul timing's answer, when it is not
    min_speedup: float = MIN_SPEEDUP  # the threshold the timing was judged by

    @property
    def speedup(self) -> float | None:
        """fp32 time / bf16 time (> 1: bf16 faster)."""
        if self.fp32_ms is None or not self.bf16_ms:
            return None
        return self.fp32_ms / self.bf16_ms

    def without_dense_matmuls(self, halves_kv: bool) -> DtypeProbe:
        """The choice once no matmul runs in the model dtype (every one on the int8-activation
        vnni kernel, no dense copy): bfloat16 where it halves the K/V bytes (`halves_kv`: an fp32
        model would store fp32 K/V), since the probe's only case against it, slow bf16 matmul,
        no longer applies; else the probe's choice, with a note saying why. A forced outcome
        stays."""
        if self.forced or self.choice == torch.bfloat16:
            return self
        if not halves_kv:
            return replace(self, note="every matmul runs on the int8-activation vnni kernel; "
                                      "fp32 stays: its K/V cache takes no more bytes than "
                                      "bf16's and rounds less")
        return replace(self, choice=torch.bfloat16,
                       note="every matmul runs on the int8-activation vnni kernel, none in the "
                            "model dtype: bf16 halves the K/V and activation bytes")

    def describe(self) -> str:
        if self.forced:
            return f"{_name(self.choice)} (forced by {ENV_FORCE})"
        note = f"; {self.note}" if self.note else ""
        return (f"{_name(self.choice)} (matmul probe, {self.threads} threads: fp32 "
                f"{self.fp32_ms:.3f} ms, bf16 {self.bf16_ms:.3f} ms, bf16 speedup "
                f"{self.speedup:.2f}x, needs >= {self.min_speedup}x{note})")

    def as_info(self) -> dict[str, object]:
        return {"choice": _name(self.choice), "fp32_ms": self.fp32_ms, "bf16_ms": self.bf16_ms,
                "threads": self.threads, "forced": self.forced, "note": self.note}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_matmul() -> tuple[float, float]:
    """Best wall time (s) of one step (each of SHAPES' `x @ w` once) in fp32 and in bf16, the
    two timed in alternation (`interleaved_best`)."""
    g = torch.Generator().manual_seed(0)
    operands = {dt: [(torch.randn(m, k, generator=g).to(dt), torch.randn(k, n, generator=g).to(dt))
                     for m, k, n in SHAPES] for dt in (torch.float32, torch.bfloat16)}

    def step(dt: torch.dtype) -> None:
        for x, w in operands[dt]:
            torch.matmul(x, w)

    best = interleaved_best({dt: functools.partial(step, dt) for dt in operands}, warmup=WARMUP,
                            min_reps=MIN_REPS, max_reps=MAX_REPS, budget_s=BUDGET_S)
    return best[torch.float32], best[torch.bfloat16]


def decide(fp32_s: float, bf16_s: float, min_speedup: float = MIN_SPEEDUP) -> torch.dtype:
    return torch.bfloat16 if bf16_s * min_speedup <= fp32_s else torch.float32


_cached: DtypeProbe | None = None


def native_bf16(flags: frozenset[str]) -> bool:
    """Whether these CPU flags list a native bf16 matmul (NATIVE_BF16_FLAGS)."""
    return bool(flags & NATIVE_BF16_FLAGS)


def probe_cpu_dtype(measure: Measure | None = None, min_speedup: float | None = None,
                    flags: frozenset[str] | None = None) -> DtypeProbe:
    """The dtype `auto` means on this CPU, with the figures behind the choice. Measured once per
    process (later calls return the first result) unless `measure` is injected. The threshold
    is `min_speedup`, else NATIVE_MIN_SPEEDUP where `flags` (default: this CPU's) list native
    bf16, else MIN_SPEEDUP."""
    global _cached
    if min_speedup is None:
        if flags is None:
            from radixrt.attention.cpu_kernels import cpu_flags

            flags = cpu_flags()
        min_speedup = NATIVE_MIN_SPEEDUP if native_bf16(flags) else MIN_SPEEDUP
    threads = torch.get_num_threads()
    forced = os.environ.get(ENV_FORCE, "").strip()
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{ENV_FORCE} must be float32 or bfloat16, got {forced!r}")
        return DtypeProbe(getattr(torch, forced), None, None, threads, forced=True)
    if measure is None and _cached is not None:
        return _cached
    with torch.inference_mode():
        fp32, bf16 = (measure or measure_matmul)()
        for _ in range(RETRIES):
            if not min_speedup / AMBIGUITY <= fp32 / bf16 < min_speedup * AMBIGUITY:
                break
            again = (measure or measure_matmul)()
            fp32, bf16 = min(fp32, again[0]), min(bf16, again[1])
    result = DtypeProbe(decide(fp32, bf16, min_speedup), fp32 * 1e3, bf16 * 1e3, threads,
                        min_speedup=min_speedup)
    if measure is None:
        _cached = result
    return result
