"""`quantization="auto"` on CPU, and the row count up to which quantized kernels win: measured
once at start-up, like `dtype_probe`.

A weight-only kernel reads 4-8x fewer weight bytes than a dense GEMM, so it wins when a matmul is
bound by reading weights (decode: a few rows), and loses when it is bound by arithmetic (prefill:
it dequantizes on the fly). How fast each kernel is with the model's activations depends on the
CPU (torch's is fast only with native bf16; the int8-activation vnni kernel does not care, it
quantizes them), so nothing is assumed from the dtype:

- `auto` quantizes when the quantized kernel, timed against the dense matmul with activations in
  the model dtype (itself measured by `dtype_probe`), is at least MIN_SPEEDUP x faster at one
  row;
- the crossover (`max_rows`: the largest call run on the kernel; larger ones use the dense copy)
  is the largest of ROWS up to which the kernel stays faster, per width (4-bit, 8-bit); a
  width faster at every row count up to ROWS[-1] (a prefill size: the int8-activation vnni
  kernel) runs every call and its weights keep no dense copy (`EVERY_CALL`), and where both
  widths do, no weight keeps one. That needs a margin at ROWS[-1] (EVERY_CALL_MARGIN): on
  Zen 1 the 8-bit LM head won there by 9% in one start and lost in another, and with every
  matmul on the vnni kernel `dtype=auto` takes bf16 (`dtype_probe`), so two starts of one
  server on one machine resolved to fp32 and to bf16 and gave different logits. (The kernel's
  time per row is flat from 64 rows on; a dense GEMM's is too, once past 512: on Zen 1 the
  4-bit kernel beat fp32 by 1.12-1.24x at 512, 1024 and 2048 rows.)
- `quant_kernel="auto"` with several candidate kernels (`quant_kernel_candidates`: vnni and
  radixrt on AVX512-VNNI and AVX2 CPUs) times each and keeps the one with the smallest mean of its
  time / dense time over the widths and row counts all of them were timed at.

The timing runs over a model-shaped weight set of at least PROBE_PARAMS parameters, more than a
CPU cache holds, so it sees memory bandwidth as a real forward pass does (timing one small
matrix in a loop measures a cache-resident weight and misjudges decode); row counts from
LARGE_ROWS on (compute-bound) time the first 1/LARGE_SHARE of it, to stay in budget. One row and
the largest count (the two ends that decide decode and the dense copy) are timed first, the rest
ascending only while BUDGET_S lasts, so a slow dense path on a loaded machine shortens the
middle, never the ends; a kernel that lost at two counts is not timed further (ascending, it
will not win again). A count left unmeasured does not break a crossover that won on both sides. Widths and the dense path alternate call by call and each keeps its best time, so load
from other processes hits all alike. `RADIXRT_AUTO_QUANTIZATION=none|gguf|int8|int4` forces the
`auto` outcome (the test suite sets `none`); an explicit `--quantization` bypasses `auto`,
`--quant-max-rows` the crossover.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixrt.model.linear import DenseWeight, LinearWeight, QuantizedWeight
from radixrt.model.probe_timing import interleaved_best
from radixrt.model.quant import EVERY_CALL, GROUP, QUANTIZATION_MODES, Int4Groups, QuantPlan
from radixrt.model.quant_matmul import (
    VNNI_CODE_BYTES,
    VnniQuantMatmul,
    quant_kernel_candidates,
    vnni_kernel_available,
    vnni_terms,
)

logger = logging.getLogger(__name__)

ENV_FORCE = "RADIXRT_AUTO_QUANTIZATION"
MIN_SPEEDUP = 1.2
EVERY_CALL_MARGIN = 1.15  # a width runs every call only this much faster than dense at ROWS[-1]
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
LARGE_ROWS, LARGE_SHARE = 128, 8
PROBE_PARAMS = 24_000_000  # 48 MB of bf16 weights: beyond the caches of the CPUs we run on
MIN_REPS, MAX_REPS = 2, 6
ROW_BUDGET_S = 0.15  # timed reps of one row count stop after this long (once MIN_REPS are in)
BUDGET_S = 3.0  # no further row count is started after this long (a loaded or slow machine)
KINDS = ("dense", "int4", "int8")

# (rows, dense dtype) -> best ms per kind for a pass over the probe weights at each of rows;
# kinds "dense" and "<int4|int8>:<kernel>" for each kernel timed.
Measure = Callable[[tuple[int, ...], torch.dtype], dict[str, dict[int, float]]]


@dataclass(frozen=True)
class QuantProbe:
    """Best ms of one pass over the probe weights per kind ("dense", "int4", "int8") and rows."""

    ms: dict[str, dict[int, float]] = field(default_factory=dict)
    threads: int = 1
    kernel: str = "torch"  # the quantized kernel timed (the one chosen, when several were)
    others: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)  # kernel -> ms

    def runs_every_call(self, kind: str) -> bool:
        """`kind` beat dense at every measured row count up to ROWS[-1], there by at least
        EVERY_CALL_MARGIN (its weights then keep no dense copy)."""
        s = self.speedup(kind, ROWS[-1])
        return self.crossover(kind) == ROWS[-1] and s is not None and s >= EVERY_CALL_MARGIN

    def wins_everywhere(self) -> bool:
        """Both widths run every call (`runs_every_call`: no dense copy is needed)."""
        return all(self.runs_every_call(k) for k in ("int4", "int8"))

    def crossover(self, kind: str) -> int:
        """Largest row count up to which `kind` beat dense at every measured count (0: never)."""
        best = 0
        for rows in sorted(self.ms.get("dense", {})):
            t = self.ms.get(kind, {}).get(rows)
            if t is None or t >= self.ms["dense"][rows]:
                break
            best = rows
        return best

    def speedup(self, kind: str, rows: int = 1) -> float | None:
        """dense time / `kind` time at `rows` (> 1: quantized faster)."""
        d, q = self.ms.get("dense", {}).get(rows), self.ms.get(kind, {}).get(rows)
        return None if d is None or not q else d / q

    def describe(self) -> str:
        parts = []
        for rows in sorted(self.ms.get("dense", {})):
            cells = "/".join(f"{self.ms[k][rows]:.2f}" if rows in self.ms.get(k, {}) else "-"
                             for k in KINDS)
            parts.append(f"{rows}: {cells}")
        others = "".join(f"; {k} kernel: {QuantProbe(ms, self.threads, k).describe()}"
                         for k, ms in self.others.items())
        return (f"ms dense/int4/int8 per rows ({self.kernel} kernel, {self.threads} threads) "
                + ", ".join(parts)
                + f"; kernels win up to {self.crossover('int4')} rows (4-bit), "
                  f"{self.crossover('int8')} rows (8-bit)" + others)

    def as_info(self) -> dict[str, object]:
        return {"ms": {k: {str(r): v for r, v in d.items()} for k, d in self.ms.items()},
                "threads": self.threads, "kernel": self.kernel, "max_rows_int4": self.crossover("int4"),
                "max_rows_int8": self.crossover("int8"),
                "others": {k: QuantProbe(ms, self.threads, k).as_info()
                           for k, ms in self.others.items()}}


def choose_kernel(per_kernel: dict[str, dict[str, dict[int, float]]]) -> str:
    """The kernel (key of `per_kernel`, each {"dense"|"int4"|"int8": {rows: ms}}) with the
    smallest mean of kernel / dense time over the (width, rows) cells every kernel has; ties and
    no common cell keep the first."""
    names = list(per_kernel)
    cells = None
    for ms in per_kernel.values():
        have = {(k, r) for k in ("int4", "int8") for r in ms.get(k, {}) if r in ms.get("dense", {})}
        cells = have if cells is None else cells & have
    if not cells:
        return names[0]

    def cost(name: str) -> float:
        ms = per_kernel[name]
        return sum(ms[k][r] / ms["dense"][r] for k, r in cells) / len(cells)

    return min(names, key=cost)


_Codes = dict[tuple[tuple[int, ...], int], torch.Tensor]


def _random_codes(shape: tuple[int, ...], high: int, g: torch.Generator, drawn: _Codes
                  ) -> torch.Tensor:
    """uint8 codes in [0, high): drawn once per shape, copied for the next weight of that shape
    (drawing costs ~20x a copy; each weight still has memory of its own, which the timing
    needs, and the values do not matter)."""
    key = (shape, high)
    if key not in drawn:
        drawn[key] = torch.randint(0, high, shape, dtype=torch.uint8, generator=g)
    return drawn[key].clone()


def _random_groups(n: int, k: int, planes: int, g: torch.Generator, drawn: _Codes
                   ) -> Int4Groups:
    q = _random_codes((planes, n, k), 16, g, drawn)
    s = torch.full((1, n, k // GROUP), 0.01)
    scale = s if planes == 1 else torch.cat([16 * s, s])
    return Int4Groups(q, scale, torch.zeros_like(scale))


def _random_vnni(n: int, k: int, bits: int, g: torch.Generator, drawn: _Codes,
                 terms: int = 1) -> VnniQuantMatmul:
    """A vnni-layout weight of random codes and scales 0.01 (packing real groups costs ~10x
    more; the timing does not depend on the values)."""
    cb = VNNI_CODE_BYTES[bits]
    packed = _random_codes((n // 16, k // GROUP, cb + 64), 256, g, drawn)
    packed[..., cb:] = torch.full((32,), 0.01, dtype=torch.float16).view(torch.uint8)
    return VnniQuantMatmul(packed, bits, terms)


def _probe_weights(hidden: int, intermediate: int, dense_dtype: torch.dtype,
                   kernels: tuple[str, ...] = ("auto",)) -> dict[str, list[LinearWeight]]:
    """Model-shaped weights (gate_up `[2i, h]` and down `[h, i]` alternating) of at least
    PROBE_PARAMS parameters in each kind: "dense", and "int4:<kernel>" / "int8:<kernel>" for
    each of `kernels`. Values are arbitrary: only timing matters. The dense ones stay plain even
    where the model's are packed (prepack.py): packed, they won at 64 rows here, where in a real
    step, with K/V streaming through the caches, they did not, and the plan moved decode
    batches of 33-64 rows off the kernel (gsp at 8 concurrent 7-10% slower). Since stop 68
    `crossover_tuning` lowers the crossover this probe finds where the model's own extend steps
    run faster on its (packed) dense copies."""
    shapes = [(2 * intermediate, hidden), (hidden, intermediate)]
    shapes = [(n, k) for n, k in shapes if k % GROUP == 0] or [(1536, 576)]
    out: dict[str, list[LinearWeight]] = {"dense": []}
    g = torch.Generator().manual_seed(0)
    drawn: _Codes = {}
    needs_groups = not all(vnni_terms(kernel) for kernel in kernels)  # vnni packs its own
    total = 0
    i = 0
    while total < PROBE_PARAMS or i < len(shapes):
        n, k = shapes[i % len(shapes)]
        i += 1
        total += n * k
        out["dense"].append(DenseWeight(torch.full((n, k), 0.01, dtype=dense_dtype)))
        for kind, planes in (("int4", 1), ("int8", 2)):
            groups = _random_groups(n, k, planes, g, drawn) if needs_groups else None
            for kernel in kernels:
                qw = (QuantizedWeight(_random_vnni(n, k, 4 * planes, g, drawn,
                                                   vnni_terms(kernel)))
                      if vnni_terms(kernel) or groups is None
                      else QuantizedWeight.from_groups(groups, kernel=kernel))
                out.setdefault(f"{kind}:{kernel}", []).append(qw)
    return out


def probe_order(rows_list: tuple[int, ...]) -> tuple[int, ...]:
    """The order row counts are timed in: the first and the last (decode's one row, prefill's
    largest), then the rest ascending (see the module docstring)."""
    if len(rows_list) <= 2:
        return rows_list
    return (rows_list[0], rows_list[-1], *rows_list[1:-1])


def measure_kernels(hidden: int, intermediate: int, kernels: tuple[str, ...] = ("auto",)
                    ) -> Measure:
    """The real measurement for a model of this shape on `kernels` (see the module
    docstring); keys "dense" and "<width>:<kernel>"."""

    def measure(rows_list: tuple[int, ...], dense_dtype: torch.dtype) -> dict[str, dict[int, float]]:
        weights = _probe_weights(hidden, intermediate, dense_dtype, kernels)
        names = list(weights)
        best: dict[str, dict[int, float]] = {k: {} for k in names}
        losses = dict.fromkeys(names, 0)
        start = time.perf_counter()
        for i, rows in enumerate(probe_order(rows_list)):
            kinds = [k for k in names if k == "dense" or losses[k] < 2]
            if kinds == ["dense"] or (i >= 2 and time.perf_counter() - start > BUDGET_S):
                break
            share = LARGE_SHARE if rows >= LARGE_ROWS else 1
            widths = {w.in_features for w in weights["dense"]}
            inputs = {(kind, k): torch.randn(rows, k).to(dense_dtype)
                      for kind in kinds for k in widths}

            def run(kind: str) -> float:
                ws = weights[kind][: max(2, len(weights[kind]) // share)]  # noqa: B023
                t0 = time.perf_counter()
                for w in ws:
                    w(inputs[(kind, w.in_features)])  # noqa: B023
                return time.perf_counter() - t0

            for kind in kinds:  # warm-up (first calls set up kernels)
                run(kind)
            row_start = time.perf_counter()
            for rep in range(MAX_REPS):
                for kind in kinds:
                    t = run(kind) * share  # a full pass's time
                    best[kind][rows] = min(best[kind].get(rows, float("inf")), t)
                if rep + 1 >= MIN_REPS and time.perf_counter() - row_start > ROW_BUDGET_S:
                    break
            for kind in kinds[1:]:
                if best[kind][rows] >= best["dense"][rows]:
                    losses[kind] += 1
        return {k: {r: s * 1e3 for r, s in v.items()} for k, v in best.items() if v}

    return measure


_cached: dict[tuple[int, int, torch.dtype, tuple[str, ...]], QuantProbe] = {}


def probe_quant_kernels(hidden: int, intermediate: int, dense_dtype: torch.dtype = torch.bfloat16,
                        measure: Measure | None = None, kernel: str = "auto") -> QuantProbe:
    """Time dense vs quantized matmuls on each of `quant_kernel_candidates(kernel)` for this
    model shape, keep the fastest kernel (`choose_kernel`); once per process, shape and kernel
    unless `measure` is injected."""
    kernels = quant_kernel_candidates(kernel)
    key = (hidden, intermediate, dense_dtype, kernels)
    if measure is None and key in _cached:
        return _cached[key]
    with torch.inference_mode():
        ms = (measure or measure_kernels(hidden, intermediate, kernels))(ROWS, dense_dtype)
    per_kernel = {k: {"dense": ms.get("dense", {}), "int4": ms.get(f"int4:{k}", {}),
                      "int8": ms.get(f"int8:{k}", {})} for k in kernels}
    chosen = choose_kernel(per_kernel)
    result = QuantProbe(per_kernel.pop(chosen), torch.get_num_threads(), chosen, per_kernel)
    if measure is None:
        _cached[key] = result
    return result


ENV_SINGLE_TILE = "RADIXRT_VNNI_SINGLE_TILE"
SINGLE_TILE_MARGIN = 1.03  # one tile per pass is kept only this much faster


def probe_single_tile_passes(hidden: int, intermediate: int,
                             measure: Callable[[], dict[bool, float]] | None = None
                             ) -> tuple[bool, str]:
    """Whether the vnni kernel's one-row passes take one tile at a time (one sequential weight
    stream per thread) instead of several (more independent dot chains): one-row calls over
    model-shaped 4-bit weights of twice the last-level cache, both ways in alternation, each
    keeping its best; one tile is kept only SINGLE_TILE_MARGIN x faster. Sets the kernel
    (`radixrt::qgemm_vnni_single_tile`) and returns (the choice, why). The outputs are bitwise
    the same either way; only the AVX-512 build has the choice. `RADIXRT_VNNI_SINGLE_TILE=0|1`
    forces it."""
    ops = torch.ops.radixrt
    forced = os.environ.get(ENV_SINGLE_TILE, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{ENV_SINGLE_TILE} must be 0 or 1, got {forced!r}")
    if not vnni_kernel_available():
        return False, "several tiles per pass (no vnni kernel here)"
    if ops.qgemm_vnni_isa() != "avx512vnni":
        ops.qgemm_vnni_single_tile(False)
        return False, f"several tiles per pass (the {ops.qgemm_vnni_isa()} build has no choice)"
    if forced:
        ops.qgemm_vnni_single_tile(forced == "1")
        return forced == "1", f"forced by {ENV_SINGLE_TILE}={forced}"
    if measure is None:
        measure = _measure_single_tile(hidden, intermediate)
    best = measure()
    single = best[True] * SINGLE_TILE_MARGIN < best[False]
    ops.qgemm_vnni_single_tile(single)
    return single, (f"{'one tile' if single else 'several tiles'} per pass for one row (probe, "
                    f"one row: {best[False] * 1e3:.2f} ms several, {best[True] * 1e3:.2f} ms one)")


def _single_tile_probe_bytes() -> int:
    """Weight bytes the one-tile probe streams: twice the last-level cache (sysfs; 32 MiB if
    unread), at least 64 MiB. Within a cache both ways run alike (a 12 MB set on Zen 4's 32 MiB
    L3 timed the same); only from memory does the stream layout show."""
    llc = 32 << 20
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        llc = int(text[:-1]) << (10 if text.endswith("K") else 20) if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        pass
    return max(64 << 20, 2 * llc)


def _measure_single_tile(hidden: int, intermediate: int) -> Callable[[], dict[bool, float]]:
    """The timing for `probe_single_tile_passes`: best seconds of a one-row pass over
    `_single_tile_probe_bytes()` of 4-bit weights, keyed by the setting."""

    def measure() -> dict[bool, float]:
        g = torch.Generator().manual_seed(0)
        drawn: _Codes = {}
        shapes = [(2 * intermediate, hidden), (hidden, intermediate)]
        shapes = [(n, k) for n, k in shapes if k % GROUP == 0 and n % 16 == 0] or [(1536, 576)]
        weights: list[QuantizedWeight] = []
        total, want = 0, _single_tile_probe_bytes()
        while total < want:
            n, k = shapes[len(weights) % len(shapes)]
            weights.append(QuantizedWeight(_random_vnni(n, k, 4, g, drawn)))
            total += weights[-1].bytes_read(1)
        inputs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in shapes}

        def run(single: bool) -> Callable[[], object]:
            def step() -> None:
                torch.ops.radixrt.qgemm_vnni_single_tile(single)
                for w in weights:
                    w(inputs[w.in_features])
            return step

        with torch.inference_mode():
            return interleaved_best({False: run(False), True: run(True)}, min_reps=5,
                                    max_reps=15, warmup=1, budget_s=0.5)

    return measure


ProbeFn = Callable[[torch.dtype], QuantProbe]


def resolve_quantization(requested: str, dtype: torch.dtype, device: torch.device,
                         is_gguf: bool, probe: ProbeFn, max_rows: int | None = None,
                         dense_copy: bool = True, kernel: str = "auto") -> tuple[QuantPlan, str]:
    """The `QuantPlan` for `ServerArgs.quantization` = `requested` and why (a log line);
    `kernel` (`ServerArgs.quant_kernel`) is resolved into the plan when it quantizes.

    `probe(dense_dtype)` (timing that kernel) is called only when a crossover or the `auto`
    decision needs timing. Raises ValueError naming the field for a mode this model / device
    cannot use."""
    if requested not in ("auto", *QUANTIZATION_MODES):
        raise ValueError(f"ServerArgs.quantization: must be one of "
                         f"{('auto', *QUANTIZATION_MODES)}, got {requested!r}")
    if requested == "none":
        return QuantPlan(), "none (requested)"
    if device.type != "cpu":
        if requested == "auto":
            return QuantPlan(), f"none (quantized kernels are CPU-only; device {device})"
        raise ValueError(f"ServerArgs.quantization: {requested!r} runs on CPU only, device is "
                         f"{device}")
    mode = requested
    forced = ""
    if requested == "auto":
        forced = os.environ.get(ENV_FORCE, "").strip()
        if forced and forced not in QUANTIZATION_MODES:
            raise ValueError(f"{ENV_FORCE} must be one of {QUANTIZATION_MODES}, got {forced!r}")
        mode = forced or ("gguf" if is_gguf else "int8")
        if mode == "none":
            return QuantPlan(), f"none (forced by {ENV_FORCE})"
    candidates = quant_kernel_candidates(kernel)
    requested_kernel, kernel = kernel, candidates[-1] if kernel == "auto" else candidates[0]
    if mode == "gguf" and not is_gguf:
        raise ValueError("ServerArgs.quantization: 'gguf' keeps a GGUF file's blocks; the model is "
                         "not a .gguf file (use int8 or int4)")

    # The probe runs for the crossover and the `auto` decision, and, where `auto` has several
    # candidate kernels, to pick one even when the rows are given (no crossover to measure):
    # untimed, `radixrt` ran 2.6x slower than `vnni` at batch 8 on a CPU without AVX512-BF16
    # (stop 37).
    rows_given = not dense_copy or (max_rows is not None and requested != "auto")
    p = probe(dtype) if not rows_given or len(candidates) > 1 else None
    if p is not None and requested_kernel == "auto" and p.kernel in candidates:
        kernel = p.kernel  # the probe timed the candidates and kept the fastest
    if not dense_copy:
        return (QuantPlan(mode, dense_copy=False, kernel=kernel),
                f"{mode} ({kernel} kernel for every call, no dense copy)")
    if max_rows is not None and requested != "auto":
        return (QuantPlan(mode, max_rows, max_rows, kernel=kernel),
                f"{mode} ({kernel} kernel, max_rows {max_rows} given)")
    assert p is not None  # rows not given: probed above
    if requested == "auto" and not forced:
        kind = "int4" if mode == "gguf" else mode
        s = p.speedup(kind)
        if s is None or s < MIN_SPEEDUP:
            return QuantPlan(), (f"none ({kind} kernel at 1 row only {s or 0:.2f}x dense, needs "
                                 f">= {MIN_SPEEDUP}x; {p.describe()})")
    why = f"forced by {ENV_FORCE}" if forced else "requested" if requested != "auto" else "probe"
    if max_rows is None and p.wins_everywhere():  # no width keeps a copy; the LM head's own
        # timing may still keep one (QuantPlan.time_head), unlike --disable-quant-dense-copy
        return (QuantPlan(mode, EVERY_CALL, EVERY_CALL, kernel=kernel),
                f"{mode} ({why}; {kernel} kernel for every call, no dense copy: faster than "
                f"dense up to {ROWS[-1]} rows; {p.describe()})")
    if max_rows is not None:
        return QuantPlan(mode, max_rows, max_rows, kernel=kernel), f"{mode} ({why}; {p.describe()})"
    # A width that wins at every row count runs every call; only the other keeps a dense copy.
    r4, r8 = (EVERY_CALL if p.runs_every_call(k) else p.crossover(k) for k in ("int4", "int8"))
    plan = QuantPlan(mode, r4, r8, kernel=kernel)
    return plan, f"{mode} ({why}; {kernel} kernel, {plan.rows_text()}; {p.describe()})"
