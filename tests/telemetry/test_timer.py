"""The timer: phases that add up into wall_time.json, laps between log lines, marks inside a step."""

import json

import pytest
import torch

from flashdraft.telemetry import timer as timer_module
from flashdraft.telemetry.timer import Timer


@pytest.fixture
def ticks(monkeypatch):
    """perf_counter under the test's control: `now[0]` seconds."""
    now = [100.0]
    monkeypatch.setattr(timer_module.time, "perf_counter", lambda: now[0])
    return now


def test_phases_add_up_and_other_is_what_none_covers(ticks, tmp_path):
    timer = Timer()
    ticks[0] += 2.0  # before any phase: "other"
    with timer.phase("target"):
        ticks[0] += 10.0
    for _ in range(2):  # a phase measured twice adds up
        with timer.phase("checkpoints"):
            ticks[0] += 1.5
    timer.move("target", "fast-path probe", 6.0)
    timer.add("steps", 4.0)
    ticks[0] += 4.0
    r = timer.report()
    assert r["phases_s"] == {"target": 4.0, "checkpoints": 3.0, "fast-path probe": 6.0, "steps": 4.0}
    assert r["total_s"] == 19.0 and r["other_s"] == 2.0
    assert timer.line() == "wall time 19.0 s: target 4.0, checkpoints 3.0, fast-path probe 6.0, steps 4.0, other 2.0"
    timer.write(tmp_path / "wall_time.json")
    assert json.loads((tmp_path / "wall_time.json").read_text()) == r


def test_a_phase_that_raises_is_still_counted(ticks):
    timer = Timer()
    with pytest.raises(KeyError), timer.phase("data"):
        ticks[0] += 3.0
        raise KeyError("bad row")
    assert timer.seconds == {"data": 3.0}


def test_moving_more_than_a_phase_has_is_refused(ticks):
    timer = Timer()
    with timer.phase("target"):
        ticks[0] += 1.0
    with pytest.raises(ValueError, match="cannot move 2.000 s of 'target'"):
        timer.move("target", "fast-path probe", 2.0)
    with pytest.raises(ValueError, match="'data'"):
        timer.move("data", "x", 0.5)


def test_a_lap_is_the_time_since_the_last_and_its_marks_add_up_by_phase(ticks):
    timer = Timer(torch.device("cpu"))
    ticks[0] += 5.0
    assert timer.lap() == 5.0 and timer.lap_marks == {}  # the first lap: since the timer was made
    for phase, seconds in (("target", 0.25), ("loss", 0.5), ("target", 0.125), ("loss", 0.5), ("optimizer", 1.0)):
        ticks[0] += seconds
        timer.mark(phase)  # a micro-batch's phases, twice, then the step's last one
    ticks[0] += 0.25  # after the last mark: in the lap, in no phase
    assert timer.lap() == 2.625
    assert timer.lap_marks == {"target": 375.0, "loss": 1000.0, "optimizer": 1000.0}
    ticks[0] += 1.0
    assert timer.lap() == 1.0 and timer.lap_marks == {}  # marks are a lap's own
    assert timer.seconds == {}  # laps and marks are not phases
