"""Crash safety of training, proven by killing it: `kill -9` the CPU trainer 20 times, resume, and lose nothing.

The soak lives in scripts/crash_soak.py (its docstring says what is aimed at and what is checked; run it for longer
soaks: `python scripts/crash_soak.py --kills 200 --seed 7 --steps 200`). The big test runs it with 20 kills: about
2.5 minutes on 2 cores, mostly the trainer's start-up after each kill (~6 s of imports), hence `slow` (CI runs it).
The small tests show that the soak's checks fail on what they are meant to catch.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_soak():
    spec = importlib.util.spec_from_file_location("crash_soak", ROOT / "scripts" / "crash_soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


crash_soak = _load_soak()


@pytest.mark.slow
def test_kill_9_twenty_times_loses_nothing_and_repeats_the_uninterrupted_run(tmp_path):
    summary = crash_soak.soak(tmp_path, kills=20, seed=0, steps=40)
    report = "\n".join(k.line() for k in summary.kills) + "\n\n" + summary.table() + f"\n(logs: {tmp_path / 'logs'})"
    print(report)
    assert summary.ok, report
    assert len(summary.kills) == 20, report
    # Aimed at 12 stages of checkpoint writes; the last (just after the rename) and a poll that wakes late under
    # load can land outside one, so the bound leaves room, but a soak that stopped hitting writes fails.
    assert len(summary.kills_in_write) >= 6, report
    assert summary.fresh_restarts >= 1, report  # killed before the first checkpoint: started again from scratch
    assert summary.damage_skipped_with_warning == len(summary.damaged) == 3, report
    assert summary.torn_visible == summary.checkpoints_lost == 0, report
    assert summary.records_lost == summary.records_duplicated == 0, report
    assert summary.curve_equal and summary.weights_identical and summary.state_identical and summary.tau_equal, report


# ---- the checks can fail --------------------------------------------------------------------------------------


def _checker(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    return crash_soak.Checker(out, crash_soak.Summary()), out


def _metrics(out, steps):
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))


def test_a_step_dir_without_manifest_is_a_torn_checkpoint_visible_as_complete(tmp_path):
    checker, out = _checker(tmp_path)
    (out / "checkpoints" / "step_00000002" / "drafter").mkdir(parents=True)  # what writing in place would leave
    (out / "checkpoints" / "step_00000002" / "optimizer.pt").write_bytes(b"half")
    assert checker.after_kill("after launch 3", out / "none.log") is None
    assert checker.summary.torn_visible == 1
    assert "step_00000002 is visible but does not verify" in checker.summary.failures[0]


def test_a_checkpoint_reported_written_but_gone_is_lost(tmp_path):
    checker, out = _checker(tmp_path)
    log = tmp_path / "launch.log"
    log.write_text(
        f"checkpoint {out}/checkpoints/step_00000002 written\ncheckpoint {out}/checkpoints/step_00000004 written\n"
    )
    checker.after_kill("after launch 5", log)
    assert checker.summary.checkpoints_lost == 2
    assert "[2, 4] were committed but the newest left is None" in checker.summary.failures[0]


@pytest.mark.parametrize(
    "steps, lost, duplicated",
    [([1, 2, 4], 1, 0), ([1, 2, 2, 3, 4], 0, 1), ([1, 2, 3], 1, 0), ([1, 2, 3, 4, 6], 0, 0)],
)
def test_missing_duplicated_or_out_of_order_records_fail(tmp_path, steps, lost, duplicated):
    checker, out = _checker(tmp_path)
    _metrics(out, steps)
    checker.check_records("after launch 2", upto=4)
    assert (checker.summary.records_lost, checker.summary.records_duplicated) == (lost, duplicated)
    assert len(checker.summary.failures) == 1 and "metrics.jsonl steps" in checker.summary.failures[0]


def test_a_torn_last_line_is_allowed_after_a_kill_but_not_at_the_end(tmp_path):
    checker, out = _checker(tmp_path)
    _metrics(out, [1, 2, 3])
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    checker.check_records("after launch 1", upto=2)
    assert checker.summary.ok and checker.summary.torn_lines == 1
    checker.check_records("final", upto=3, final=True)
    assert "not JSON" in checker.summary.failures[0]
