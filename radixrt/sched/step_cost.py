"""What a scheduler step costs, measured on the steps the scheduler runs: a decode step as a
function of its rows (`StepCostModel`: speculative decoding prices a draft row with it), and any
step as a function of its prefill tokens and decode rows (`MixedStepCost`: the prefill pacer
sizes a mixed step's prefill against the decode rows it carries)."""

from __future__ import annotations


class StepCostModel:
    """A decode step's time as `a + c x rows`, fitted by exponentially weighted least squares
    over the steps the scheduler ran (`observe`); `fit()` is None until the rows seen vary.
    Measured, not assumed: what a row costs depends on the CPU, the dtype and the kernels
    (0.5 ms on top of a 4 ms one-row step on one machine here, near the full step in fp32
    without the CPU kernels)."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.w = self.n = self.nn = self.t = self.nt = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.w = d * self.w + 1
        self.n = d * self.n + rows
        self.nn = d * self.nn + rows * rows
        self.t = d * self.t + seconds
        self.nt = d * self.nt + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, c) in seconds, or None while the rows seen do not vary enough to tell them."""
        den = self.w * self.nn - self.n * self.n
        if self.w < 4 or den <= 0.25 * self.w * self.w:  # row-count variance under 0.25
            return None
        c = (self.w * self.nt - self.n * self.t) / den
        a = (self.t - c * self.n) / self.w
        return a, c


class MixedStepCost:
    """A step's time as `b x prefill tokens + c x decode rows` (no fixed part: it is spread
    over both), fitted by exponentially weighted least squares over the steps the scheduler
    ran: plain decode steps (tokens 0), prefill steps alone (rows 0) and mixed ones. `fit()` is
    None until the samples tell b and c apart (tokens and rows not in one fixed proportion);
    `b` alone is known once a step with tokens ran (`seconds_per_token`)."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.tt = self.tr = self.rr = self.ts = self.rs = 0.0

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        d = self.decay
        self.tt = d * self.tt + tokens * tokens
        self.tr = d * self.tr + tokens * rows
        self.rr = d * self.rr + rows * rows
        self.ts = d * self.ts + tokens * seconds
        self.rs = d * self.rs + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(b, c): seconds per prefill token and per decode row, or None (see the class)."""
        det = self.tt * self.rr - self.tr * self.tr
        if self.tt <= 0 or self.rr <= 0 or det <= 1e-3 * self.tt * self.rr:
            return None
        b = (self.ts * self.rr - self.rs * self.tr) / det
        c = (self.rs * self.tt - self.ts * self.tr) / det
        if b <= 0 or c < 0:
            return None
        return b, c

    def seconds_per_token(self) -> float | None:
        """b from the fit, else from the steps' tokens alone (decode rows counted as prefill
        time: an upper bound), None before any step with tokens."""
        fit = self.fit()
        if fit is not None:
            return fit[0]
        return self.ts / self.tt if self.tt > 0 else None
