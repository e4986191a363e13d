"""What a scheduler step costs, measured on the steps the scheduler runs: a decode step as a
function of its rows (`StepCostModel`: speculative decoding prices a draft row with it), and any
step as a function of its prefill tokens, their attention and its decode rows (`MixedStepCost`:
the prefill pacer sizes a step's prefill with it). Both are exponentially weighted least
squares."""

from __future__ import annotations

from dataclasses import dataclass


class _DecayedGram:
    """Exponentially decayed normal-equation sums over observed (x, seconds), x a vector of n
    regressors: `gram[i][j]` = Σ x_i x_j and `rhs[i]` = Σ x_i · seconds, each older
    observation weighted `decay` times less than the next."""

    def __init__(self, n: int, decay: float):
        self.decay = decay
        self.gram = [[0.0] * n for _ in range(n)]
        self.rhs = [0.0] * n

    def add(self, x: tuple[float, ...], seconds: float) -> None:
        d = self.decay
        for i, xi in enumerate(x):
            self.rhs[i] = d * self.rhs[i] + xi * seconds
            for j, xj in enumerate(x):
                self.gram[i][j] = d * self.gram[i][j] + xi * xj


class StepCostModel:
    """A decode step's time as `a + c x rows`, fitted by exponentially weighted least squares
    over the steps the scheduler ran (`observe`); `fit()` is None until the rows seen vary.
    Measured, not assumed: what a row costs depends on the CPU, the dtype and the kernels
    (0.5 ms on top of a 4 ms one-row step on one machine here, near the full step in fp32
    without the CPU kernels)."""

    def __init__(self, decay: float = 0.98):
        self.sums = _DecayedGram(2, decay)  # x = (1: the fixed part a, rows)

    def observe(self, rows: int, seconds: float) -> None:
        self.sums.add((1.0, float(rows)), seconds)

    def fit(self) -> tuple[float, float] | None:
        """(a, c) in seconds, or None while the rows seen do not vary enough to tell them."""
        (xx, xy), (_, yy) = self.sums.gram
        xs, ys = self.sums.rhs
        den = xx * yy - xy * xy
        if xx < 4 or den <= 0.25 * xx * xx:  # row-count variance under 0.25
            return None
        c = (ys * xx - xs * xy) / den
        a = (xs - c * xy) / xx
        return a, c


@dataclass(frozen=True)
class StepFit:
    """Seconds per prefill token (`b`, its matmuls and everything else a token costs), per unit
    of attention work (`a`: (query, key) pairs times the prior pair weight, so the prior says
    a = b) and per decode row (`c`; taken as `b` while not told apart, `rows_told` False)."""

    b: float
    a: float
    c: float
    rows_told: bool


class MixedStepCost:
    """A step's time as `b x tokens + a x attention + c x decode rows` (no fixed part: it is
    spread over the terms), fitted by exponentially weighted least squares over the steps the
    scheduler ran: plain decode steps (no tokens), prefill steps alone (no rows) and mixed ones.

    `attention` is a step's prefill (query, key) pairs times a prior weight (the pacer's: the
    attention FLOPs of a pair over a token's matmul FLOPs, times what the attention kernels lose
    to the matmuls on the CPU it was fitted on), so a = b when the prior holds. How much slower
    attention runs than the matmuls differs from CPU to CPU (AMX tiles, `vdpbf16ps`, fp32 FMA
    against int8 matmuls), so a is measured, pulled toward b by a ridge worth
    `PRIOR_STEPS` steps of `PRIOR_ATTENTION` units each: steps with little attention (short
    prompts) leave the prior, long-context steps outweigh it within a few steps. a / b stays in
    [1 / `MAX_RATIO`, `MAX_RATIO`].

    c is fitted once tokens and rows vary apart; before that the rows' time is counted as
    prefill time (an upper bound on b) and c is taken as b. `fit()` is None before a step with
    prefill tokens was seen."""

    PRIOR_STEPS = 1.0
    PRIOR_ATTENTION = 64.0
    MAX_RATIO = 4.0

    def __init__(self, decay: float = 0.95):
        self.sums = _DecayedGram(3, decay)  # x = (tokens, attention, rows)

    def observe(self, tokens: float, rows: int, seconds: float, attention: float = 0.0) -> None:
        """A step of `tokens` prefill tokens with `attention` units of attention work (pairs x
        the prior weight) and `rows` decode rows took `seconds`."""
        self.sums.add((float(tokens), float(attention), float(rows)), seconds)

    def _ridge(self) -> float:
        return self.PRIOR_STEPS * self.PRIOR_ATTENTION ** 2

    def _solve(self, idx: tuple[int, ...]) -> list[float] | None:
        """The ridge least-squares coefficients of the regressors `idx` (0 and 1 always)."""
        lam = self._ridge()
        m = [[self.sums.gram[i][j] for j in idx] for i in idx]
        m[0][0] += lam
        m[1][1] += lam
        m[0][1] -= lam
        m[1][0] -= lam
        return _solve_linear(m, [self.sums.rhs[i] for i in idx])

    def fit(self) -> StepFit | None:
        """b, a and c from the steps seen: all three where tokens and rows vary apart, else b
        and a with c = b; None before a step with prefill tokens."""
        g, r = self.sums.gram, self.sums.rhs
        if g[0][0] <= 0:
            return None
        # tokens (with attention at the prior) against rows: told apart when not collinear
        xx = g[0][0] + 2 * g[0][1] + g[1][1]
        xy, yy = g[0][2] + g[1][2], g[2][2]
        if yy > 0 and xx * yy - xy * xy > 1e-3 * xx * yy:
            sol = self._solve((0, 1, 2))
            if sol is not None and sol[0] > 0 and sol[2] >= 0:
                return self._bounded(sol[0], sol[1], sol[2], True)
        sol = self._solve((0, 1))
        if sol is not None and sol[0] > 0:
            return self._bounded(sol[0], sol[1], sol[0], False)
        b = (r[0] + r[1]) / xx
        return StepFit(b, b, b, False) if b > 0 else None

    def _bounded(self, b: float, a: float, c: float, rows_told: bool) -> StepFit:
        a = min(max(a, b / self.MAX_RATIO), b * self.MAX_RATIO)
        return StepFit(b, a, c, rows_told)


def _solve_linear(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with m x = v by Gaussian elimination with partial pivoting; None if m is singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(x) for row in m for x in row) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) <= 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            for j in range(col, n + 1):
                a[i][j] -= f * a[col][j]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x
