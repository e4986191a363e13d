"""What a scheduler step costs, measured on the steps the scheduler runs: a decode step as a
function of its rows (`StepCostModel`: speculative decoding prices a draft row with it), and any
step as a function of its prefill tokens and decode rows (`MixedStepCost`: the prefill pacer
sizes a mixed step's prefill against the decode rows it carries). Both are two-term least
squares on `_DecayedSums`."""

from __future__ import annotations


class _DecayedSums:
    """Exponentially decayed sums for fitting seconds = p x x + q x y over observed (x, y,
    seconds): Σx², Σxy, Σy², Σx·s, Σy·s. `det` is the normal equations' determinant."""

    def __init__(self, decay: float):
        self.decay = decay
        self.xx = self.xy = self.yy = self.xs = self.ys = 0.0

    def add(self, x: float, y: float, seconds: float) -> None:
        d = self.decay
        self.xx = d * self.xx + x * x
        self.xy = d * self.xy + x * y
        self.yy = d * self.yy + y * y
        self.xs = d * self.xs + x * seconds
        self.ys = d * self.ys + y * seconds

    def det(self) -> float:
        return self.xx * self.yy - self.xy * self.xy

    def q(self, det: float) -> float:
        """The y coefficient, for a nonzero `det`."""
        return (self.ys * self.xx - self.xs * self.xy) / det


class StepCostModel:
    """A decode step's time as `a + c x rows`, fitted by exponentially weighted least squares
    over the steps the scheduler ran (`observe`); `fit()` is None until the rows seen vary.
    Measured, not assumed: what a row costs depends on the CPU, the dtype and the kernels
    (0.5 ms on top of a 4 ms one-row step on one machine here, near the full step in fp32
    without the CPU kernels)."""

    def __init__(self, decay: float = 0.98):
        self.sums = _DecayedSums(decay)  # x = 1 (the fixed part a), y = rows

    def observe(self, rows: int, seconds: float) -> None:
        self.sums.add(1.0, rows, seconds)

    def fit(self) -> tuple[float, float] | None:
        """(a, c) in seconds, or None while the rows seen do not vary enough to tell them."""
        s = self.sums
        den = s.det()
        if s.xx < 4 or den <= 0.25 * s.xx * s.xx:  # row-count variance under 0.25
            return None
        c = s.q(den)
        a = (s.xs - c * s.xy) / s.xx
        return a, c


class MixedStepCost:
    """A step's time as `b x prefill tokens + c x decode rows` (no fixed part: it is spread
    over both), fitted by exponentially weighted least squares over the steps the scheduler
    ran: plain decode steps (tokens 0), prefill steps alone (rows 0) and mixed ones. `fit()` is
    None until the samples tell b and c apart (tokens and rows not in one fixed proportion);
    `b` alone is known once a step with tokens ran (`seconds_per_token`)."""

    def __init__(self, decay: float = 0.95):
        self.sums = _DecayedSums(decay)  # x = prefill (the pacer's work), y = decode rows

    def observe(self, tokens: float, rows: int, seconds: float) -> None:
        """`tokens`: the step's prefill, in whatever unit b is wanted in (the pacer's work)."""
        self.sums.add(tokens, rows, seconds)

    def fit(self) -> tuple[float, float] | None:
        """(b, c): seconds per prefill token and per decode row, or None (see the class)."""
        s = self.sums
        det = s.det()
        if s.xx <= 0 or s.yy <= 0 or det <= 1e-3 * s.xx * s.yy:
            return None
        b = (s.xs * s.yy - s.ys * s.xy) / det
        c = s.q(det)
        if b <= 0 or c < 0:
            return None
        return b, c

    def seconds_per_token(self, fit: tuple[float, float] | None = None) -> float | None:
        """b from `fit` (default: a fresh one), else from the steps' tokens alone (decode rows
        counted as prefill time: an upper bound), None before any step with tokens."""
        fit = fit or self.fit()
        if fit is not None:
            return fit[0]
        s = self.sums
        return s.xs / s.xx if s.xx > 0 else None
