import json

import pytest

from flashdraft.train import wallclock
from flashdraft.train.wallclock import WallClock


@pytest.fixture
def ticks(monkeypatch):
    """perf_counter under the test's control: `now[0]` seconds."""
    now = [100.0]
    monkeypatch.setattr(wallclock.time, "perf_counter", lambda: now[0])
    return now


def test_phases_add_up_and_other_is_what_none_covers(ticks, tmp_path):
    clock = WallClock()
    ticks[0] += 2.0  # before any phase: "other"
    with clock.phase("target"):
        ticks[0] += 10.0
    for _ in range(2):  # a phase measured twice adds up
        with clock.phase("checkpoints"):
            ticks[0] += 1.5
    clock.move("target", "fast-path probe", 6.0)
    clock.add("steps", 4.0)
    ticks[0] += 4.0
    r = clock.report()
    assert r["phases_s"] == {"target": 4.0, "checkpoints": 3.0, "fast-path probe": 6.0, "steps": 4.0}
    assert r["total_s"] == 19.0 and r["other_s"] == 2.0
    assert clock.line() == "wall time 19.0 s: target 4.0, checkpoints 3.0, fast-path probe 6.0, steps 4.0, other 2.0"
    clock.write(tmp_path / "wall_time.json")
    assert json.loads((tmp_path / "wall_time.json").read_text()) == r


def test_a_phase_that_raises_is_still_counted(ticks):
    clock = WallClock()
    with pytest.raises(KeyError), clock.phase("data"):
        ticks[0] += 3.0
        raise KeyError("bad row")
    assert clock.seconds == {"data": 3.0}


def test_moving_more_than_a_phase_has_is_refused(ticks):
    clock = WallClock()
    with clock.phase("target"):
        ticks[0] += 1.0
    with pytest.raises(ValueError, match="cannot move 2.000 s of 'target'"):
        clock.move("target", "fast-path probe", 2.0)
    with pytest.raises(ValueError, match="'data'"):
        clock.move("data", "x", 0.5)
