"""`DecodePathTuner`: which of two bitwise-equal paths a decode step of many rows takes, chosen
by timing both while the server runs.

From `decode_microbatch_rows` rows a one-call decode step can run as two micro-batches (one per
thread, sharing nothing) or as one pass: of the team of threads (every op shared, each member
taking the other's last items when it is done with its own), or with a parallel region per op
where no team runs the step. Which is faster depends on the machine and on where the
hypervisor put the two vCPUs: on the Xeon of stops 37-41 the team pass was 1.01-1.06x faster
from 12 to 64 rows (stop 41); on Zen 5 at stop 28 the micro-batches were from 16-24 rows, the
team 1.2x faster at 8; on Zen 4 at stop 58 the micro-batches were 1.02-1.04x faster at 8 rows
and 1.04-1.05x at 10, the team 1.01-1.03x at 6. Both give bitwise the same logits
(tests/test_decode_layers.py), so the choice only changes speed and may change at any step.

Per bucket of row counts (half octaves: 8-11, 12-15, 16-22, 23-31, ...) the tuner alternates the two
paths step by step until it has `pairs` pairs of adjacent steps with the same row count (a pair
sees the same contexts and the same moment of the machine, so slow drifts cancel), keeps the
path whose median time ratio is lower, and explores again after `every` more steps of that
bucket (the VM's placement moves from minute to minute on some hosts).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# A pick: one pass ("team": the team of threads, or a parallel region per op where no team runs
# the step), or two micro-batches.
TEAM, SPLIT = False, True


@dataclass
class _Bucket:
    ratios: list[float] = field(default_factory=list)  # split / adjacent team step, same rows
    last: tuple[bool, int, float] | None = None  # (path, rows, seconds) awaiting its pair
    choice: bool | None = None  # None while exploring
    since: int = 0  # steps since the choice
    decided: float | None = None  # the median ratio behind the latest choice
    decisions: int = 0  # choices made (monotonic)


class DecodePathTuner:
    """Picks per step between the team pass and two micro-batches (see the module)."""

    def __init__(self, pairs: int = 8, every: int = 4096):
        if pairs < 1 or every < 1:
            raise ValueError(f"pairs and every must be >= 1, got {pairs}, {every}")
        self.pairs, self.every = pairs, every
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return int(2 * math.log2(max(rows, 1)))

    def pick(self, rows: int) -> bool:
        """SPLIT (two micro-batches) or TEAM for a step of `rows` rows."""
        b = self._buckets.setdefault(self.bucket(rows), _Bucket())
        if b.choice is not None:
            if b.since < self.every:
                b.since += 1
                return b.choice
            b.choice, b.ratios, b.last = None, [], None  # explore again
        if b.last is not None:
            return not b.last[0]
        return len(b.ratios) % 2 == 1  # the path going first alternates from pair to pair

    def record(self, rows: int, split: bool, seconds: float) -> None:
        """The time of a step of `rows` rows that ran `split` as `pick` said."""
        b = self._buckets.setdefault(self.bucket(rows), _Bucket())
        if b.choice is not None:
            return
        if b.last is not None and b.last[0] != split and b.last[1] == rows and seconds > 0:
            team_s, split_s = (b.last[2], seconds) if split else (seconds, b.last[2])
            b.ratios.append(split_s / max(team_s, 1e-12))
            b.last = None
        else:
            b.last = (split, rows, seconds)
        if len(b.ratios) >= self.pairs:
            ratio = statistics.median(b.ratios)
            b.choice, b.since = ratio < 1.0, 0
            b.decided, b.decisions = ratio, b.decisions + 1
            logger.info("decode steps of %d-%d rows: %s (micro-batches / team pass %.3fx over "
                        "%d pairs of steps)", *self.rows_of(self.bucket(rows)),
                        "two micro-batches" if b.choice else "one team pass", ratio,
                        len(b.ratios))

    @staticmethod
    def rows_of(bucket: int) -> tuple[int, int]:
        """The row counts [first, last] of a bucket."""
        first = math.ceil(2 ** (bucket / 2))
        while DecodePathTuner.bucket(first) < bucket:
            first += 1
        last = first
        while DecodePathTuner.bucket(last + 1) == bucket:
            last += 1
        return first, last

    def choices(self) -> dict[str, str]:
        """Each bucket's current path ("team", "micro-batches", or "exploring"), by row range."""
        out = {}
        for k in sorted(self._buckets):
            c = self._buckets[k].choice
            first, last = self.rows_of(k)
            out[f"{first}-{last}"] = ("exploring" if c is None
                                      else "micro-batches" if c else "team")
        return out

    def describe(self) -> dict[str, dict[str, object]]:
        """Per row range (`stats()["decode_paths"]`): `path` as `choices`, `ratio` (micro-batch
        step / team step, the median behind the latest choice; None before the first, kept
        while exploring again), `decisions` (choices made, monotonic)."""
        return {rng: {"path": path, "ratio": b.decided, "decisions": b.decisions}
                for (rng, path), b in zip(self.choices().items(),
                                          (self._buckets[k] for k in sorted(self._buckets)),
                                          strict=True)}
