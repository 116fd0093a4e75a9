"""MetricsLogger: metrics.jsonl, the console line, the progress bar, resume truncation; the before and after of a
run's evaluations."""

import logging

import pytest
import torch

from flashdraft.telemetry.metrics import MetricsLogger, before_after, describe_before_after, format_line, read_metrics
from tests.telemetry.logged import console, lines, row

LOGGER = "flashdraft.telemetry.metrics"


def test_jsonl_lines_are_written_and_flushed_at_once(tmp_path):
    metrics = MetricsLogger(tmp_path, total_steps=30, console=console())
    metrics.log(10, {"loss": torch.tensor(3.25), "sim_tau": 1.5, "acc": torch.tensor([0.5, 0.25]), "lr": 6e-4})
    # Read while the logger is still open: a crash from here on loses nothing already logged.
    assert lines(tmp_path / "metrics.jsonl") == [
        {"step": 10, "loss": 3.25, "sim_tau": 1.5, "acc": [0.5, 0.25], "lr": 6e-4}
    ]
    metrics.log(20, {"loss": float("nan"), "sim_tau": 1.6, "mfu": None, "time": 12.5})
    assert lines(tmp_path / "metrics.jsonl")[1] == {"step": 20, "loss": None, "sim_tau": 1.6, "mfu": None, "time": 12.5}
    metrics.close()
    metrics.close()
    out = metrics.console.file.getvalue()
    assert "step 10/30 | batch loss 3.250 | batch sim_tau 1.50 | acc@1 0.50 | lr 6.0e-4" in out
    assert "step 20/30 | batch loss nan | batch sim_tau 1.60" in out


def test_unserialisable_metric_names_its_key(tmp_path):
    with MetricsLogger(tmp_path, total_steps=1, console=console()) as metrics:
        with pytest.raises(TypeError, match="metric 'bad'"):
            metrics.log(1, {"bad": object()})


def test_format_line():
    metrics = {
        "loss": 3.2144,
        "sim_tau": 1.834,
        "acc": [0.412, 0.3],
        "tok_s": 12_345.0,
        "draft_tok_s": 45_210.0,
        "mfu": 0.3121,
        "mem_gib": 12.14,
        "lr": 5.8e-4,
        "block_tau": 2.0,
    }
    assert format_line(120, metrics, total_steps=600) == (
        "step 120/600 | batch loss 3.214 | batch sim_tau 1.83 | acc@1 0.41 | 12.3K tok/s | 45.2K draft tok/s | "
        "MFU 31.2% | mem 12.1 GiB | lr 5.8e-4"
    )
    assert format_line(7, {"loss": 2.0, "mem_gib": None, "tok_s": 950.0, "grad_norm": 0.5}) == (
        "step 7 | batch loss 2.000 | 950 tok/s | gnorm 0.50"
    )
    # An evaluation's scores, alone at step 0 or after a step's own values.
    scores = {"heldout_loss": 2.9051, "heldout_sim_tau": 2.412, "tau": 3.1, "heldout_prompts": 8}
    assert format_line(0, scores, total_steps=600) == (
        "step 0/600 | held-out loss 2.905 | held-out sim_tau 2.41 | τ 3.10 (measured)"
    )
    assert format_line(1, {"tok_s": 2.5e6, "lr": 0.0}) == "step 1 | 2.5M tok/s | lr 0.0e0"
    # A GPU of unknown peak: MFU shown as unknown, not left out (and never made up).
    assert format_line(3, {"tok_s": 950.0, "mfu": None}) == "step 3 | 950 tok/s | MFU –"


def test_piped_output_has_one_whole_line_per_log_step_and_no_bar(tmp_path):
    out = console(width=80)  # what rich assumes for a file or a pipe
    metrics = MetricsLogger(tmp_path, total_steps=20, console=out)
    wide = {**row(10), "draft_tok_s": 45_210.0, "mfu": 0.3121, "mem_gib": 12.14, "grad_norm": 0.5, "lr": 5.8e-4}
    with metrics.progress():
        metrics.advance(10)
        metrics.log(10, wide)
        metrics.advance(10)
        metrics.log(20, {**wide, "loss": 2.5})
    metrics.close()
    printed = out.file.getvalue().splitlines()
    assert printed == [
        format_line(10, {"step": 10, **wide}, total_steps=20),
        format_line(20, {"step": 20, **wide, "loss": 2.5}, total_steps=20),
    ]
    assert len(printed[0]) > 80  # so it would have wrapped


def test_the_bar_is_drawn_on_a_terminal(tmp_path):
    out = console(terminal=True)
    metrics = MetricsLogger(tmp_path, total_steps=10, console=out)
    with metrics.progress():
        metrics.advance(5)
        assert metrics._progress is not None
    metrics.close()
    assert "5/10" in out.file.getvalue()


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, total_steps=50, console=console()) as metrics:
        for step in (10, 20, 30, 40):
            metrics.log(step, row(step))
    uninterrupted = lines(tmp_path / "metrics.jsonl")[:3]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "loss": 1.')  # torn by a kill mid-write
    with MetricsLogger(tmp_path, total_steps=50, console=console(), resume_from_step=20) as metrics:
        assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10, 20]
        metrics.log(30, row(30))
    assert lines(tmp_path / "metrics.jsonl") == uninterrupted


def test_a_fresh_run_starts_a_fresh_file(tmp_path, caplog):
    with MetricsLogger(tmp_path, total_steps=5, console=console()) as metrics:
        metrics.log(1, row(1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with MetricsLogger(tmp_path, total_steps=5, console=console()) as metrics:
            metrics.log(2, row(2))
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [2]
    assert "1 lines from an earlier run are replaced" in caplog.text


def test_disabled_logger_does_nothing(tmp_path):
    out = console()
    metrics = MetricsLogger(tmp_path / "run", total_steps=5, trackers=["tensorboard"], enabled=False, console=out)
    with metrics.progress():
        metrics.advance(3)
        metrics.log(1, row(1))
    metrics.close()
    assert not (tmp_path / "run").exists()
    assert out.file.getvalue() == ""


def test_progress_bar_tracks_steps_and_latest_values(tmp_path):
    metrics = MetricsLogger(tmp_path, total_steps=10, console=console(terminal=True))
    with metrics.progress():
        metrics.advance(4)  # a resumed run's jump
        for step in (5, 6):
            metrics.advance()
            metrics.log(step, row(step))
        task = metrics._progress.tasks[0]
        assert task.completed == 6 and task.total == 10
        assert task.fields["stats"] == "batch loss 4.940 · batch sim_tau 1.03 · 12.3K tok/s"
    metrics.advance()  # outside the bar: ignored
    metrics.close()


def test_before_and_after_are_the_first_and_last_evaluation():
    records = [
        {"step": 0, "heldout_loss": 2.9051, "heldout_sim_tau": 2.31, "tau": 3.1, "heldout_prompts": 8},
        {"step": 10, "loss": 3.0, "sim_tau": 2.0},
        {"step": 20, "loss": 2.8, "heldout_loss": 2.6, "heldout_sim_tau": 2.4, "tau": 3.3, "heldout_prompts": 8},
        {"step": 30, "loss": 2.7, "heldout_loss": 2.4012, "heldout_sim_tau": 2.52, "tau": 3.621, "heldout_prompts": 8},
    ]
    change = before_after(records)
    assert change == {
        "steps": [0, 30],
        "prompts": 8,
        "heldout_loss": [2.9051, 2.4012],
        "heldout_sim_tau": [2.31, 2.52],
        "tau": [3.1, 3.621],
    }
    assert describe_before_after(change) == (
        "held-out loss 2.905 → 2.401, measured τ 3.10 → 3.62 on 8 prompts (step 0 → 30)"
    )
    once = before_after(records[:2])  # a run stopped before its next evaluation
    assert describe_before_after(once) == "held-out loss 2.905, measured τ 3.10 on 8 prompts (step 0)"
    assert before_after(records[1:2]) is None  # no held-out prompts: nothing to compare
