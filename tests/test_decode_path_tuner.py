"""DecodePathTuner: the pick between two micro-batches and a team pass, from timed pairs."""

from __future__ import annotations

import pytest

from radixrt.model.decode_path_tuner import SPLIT, TEAM, DecodePathTuner


def _run(tuner: DecodePathTuner, rows: int, team_s: float, split_s: float,
         steps: int) -> list[bool]:
    """`steps` steps of `rows` rows, each path taking its given time; the picks."""
    picks = []
    for _ in range(steps):
        p = tuner.pick(rows)
        picks.append(p)
        tuner.record(rows, p, split_s if p else team_s)
    return picks


@pytest.mark.parametrize(("team_s", "split_s", "choice"),
                         [(0.010, 0.011, TEAM), (0.011, 0.010, SPLIT)])
def test_explores_both_then_keeps_the_faster(team_s: float, split_s: float,
                                             choice: bool) -> None:
    t = DecodePathTuner(pairs=4, every=10)
    picks = _run(t, 16, team_s, split_s, 8)
    # alternating, the path going first alternating from pair to pair
    assert picks == [TEAM, SPLIT, SPLIT, TEAM, TEAM, SPLIT, SPLIT, TEAM]
    assert t.choices() == {"16-22": "micro-batches" if choice else "team"}
    first = t.describe()["16-22"]
    assert first["ratio"] == pytest.approx(split_s / team_s) and first["decisions"] == 1
    assert _run(t, 16, team_s, split_s, 10) == [choice] * 10
    # after `every` steps it explores again, and follows a change of the machine
    assert _run(t, 16, split_s, team_s, 4) == [TEAM, SPLIT, SPLIT, TEAM]
    assert t.describe() == {"16-22": {"path": "exploring", "ratio": first["ratio"],
                                      "decisions": 1}}  # the last decision's ratio kept
    assert _run(t, 16, split_s, team_s, 4) == [TEAM, SPLIT, SPLIT, TEAM]
    assert _run(t, 16, split_s, team_s, 3) == [not choice] * 3
    assert t.describe()["16-22"] == {"path": "micro-batches" if not choice else "team",
                                     "ratio": pytest.approx(team_s / split_s), "decisions": 2}


def test_pairs_need_the_same_rows_and_buckets_are_apart() -> None:
    t = DecodePathTuner(pairs=2, every=100)
    # rows change between the two steps of a pair (a request finished): no ratio from them
    for rows, path in ((16, TEAM), (17, SPLIT)):
        assert t.pick(rows) == path
        t.record(rows, path, 1.0)
    assert t.choices() == {"16-22": "exploring"}
    _run(t, 17, 0.5, 1.0, 4)
    assert t.choices() == {"16-22": "team"}
    # another bucket explores on its own
    assert _run(t, 64, 1.0, 0.5, 4) == [TEAM, SPLIT, SPLIT, TEAM]
    assert t.choices() == {"16-22": "team", "64-90": "micro-batches"}
    assert t.pick(17) == TEAM and t.pick(64) == SPLIT


def test_buckets_are_contiguous_row_ranges() -> None:
    previous = 0
    for rows in range(1, 300):
        b = DecodePathTuner.bucket(rows)
        first, last = DecodePathTuner.rows_of(b)
        assert first <= rows <= last and b >= previous
        previous = b
    assert [DecodePathTuner.rows_of(DecodePathTuner.bucket(n)) for n in (12, 16, 64)] == [
        (12, 15), (16, 22), (64, 90)]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="pairs and every"):
        DecodePathTuner(pairs=0)
