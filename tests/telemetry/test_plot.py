"""The training curve: what it draws, what its title and PNG metadata say, and a run without matplotlib."""

import json
import logging
import math
import sys

import pytest
import torch

from flashdraft.telemetry.metrics import MetricsLogger, before_after, describe_before_after, read_metrics
from flashdraft.telemetry.plot import centered_mean, draw_training_curve, plot_training_curve, series_of, trend_reach
from tests.telemetry.drawn import curve_pixels, height_trend, shown
from tests.telemetry.logged import console, row

LOGGER = "flashdraft.telemetry.plot"


def _evaluated_run(path, steps=60, every=10, eval_every=20):
    """A run's metrics.jsonl: an evaluation at step 0, every `eval_every` steps and at the end; batch rows between."""
    with MetricsLogger(path, total_steps=steps, console=console()) as metrics:
        metrics.log(0, {"heldout_loss": 3.0, "heldout_sim_tau": 2.0, "tau": 2.9, "heldout_prompts": 8})
        for step in range(every, steps + 1, every):
            values = {"loss": 3.2 - step / 100 + 0.3 * (-1) ** (step // every), "sim_tau": 2.0 + step / 200}
            if step % eval_every == 0 or step == steps:
                values |= {
                    "heldout_loss": 3.0 - step / 100,
                    "heldout_sim_tau": 2.0 + step / 100,
                    "tau": 2.9 + step / 80,
                    "heldout_prompts": 8,
                }
            metrics.log(step, values)
    return path / "metrics.jsonl"


def test_an_evaluated_run_shows_heldout_loss_and_tau_from_step_0_with_its_before_and_after(tmp_path):
    """The PNG's text says what it shows: its title's before and after are the first and last evaluation of
    metrics.jsonl, and each plotted series is the metrics' own values."""
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    jsonl = _evaluated_run(tmp_path)
    png = plot_training_curve(jsonl, tmp_path / "training_curve.png")
    text = shown(png)
    records = read_metrics(jsonl)
    assert text["Title"] == "held-out loss 3.000 → 2.400, measured τ 2.90 → 3.65 on 8 prompts (step 0 → 60)"
    change = json.loads(text["flashdraft:before_after"])
    assert change == before_after(records) and describe_before_after(change) == text["Title"]
    assert change["heldout_loss"] == [records[0]["heldout_loss"], records[-1]["heldout_loss"]]
    assert change["tau"] == [records[0]["tau"], records[-1]["tau"]] and change["steps"] == [0, 60]
    series = json.loads(text["flashdraft:series"])
    assert series == series_of(records)
    assert [s for s, _ in series["heldout_loss"]] == [0, 20, 40, 60] and series["tau"][0] == [0, 2.9]
    loss, tau = curve_pixels(png)
    assert loss.sum() > 20 and tau.sum() > 20
    # The held-out loss falls and its τ rises: drawn lower and higher on the right of the image than on the left.
    (loss_left, loss_right), (tau_left, tau_right) = height_trend(loss), height_trend(tau)
    assert loss_right > loss_left + 50 and tau_right < tau_left - 50, (loss_left, loss_right, tau_left, tau_right)


def test_a_run_evaluated_only_at_step_0_says_so(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    with MetricsLogger(tmp_path, total_steps=30, console=console()) as metrics:
        metrics.log(0, {"heldout_loss": 3.0, "heldout_sim_tau": 2.0, "tau": 2.9, "heldout_prompts": 2})
        metrics.log(10, {"loss": 3.1, "sim_tau": 2.0})  # then stopped
    text = shown(plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png"))
    assert text["Title"] == "held-out loss 3.000, measured τ 2.90 on 2 prompts (step 0)"


@pytest.mark.parametrize("steps", [[10], list(range(10, 610, 10))])
def test_without_evaluations_the_curve_is_the_batches_loss_and_tau(tmp_path, steps):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    with MetricsLogger(tmp_path, total_steps=steps[-1], console=console()) as metrics:
        for step in steps:
            metrics.log(
                step, {"loss": 5.5 * math.exp(-step / 150) + 1.2, "sim_tau": 1 + 3 * (1 - math.exp(-step / 200))}
            )
    png = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "plots" / "training_curve.png")
    assert png == tmp_path / "plots" / "training_curve.png"
    loss, tau = curve_pixels(png)
    assert loss.sum() > 20 and tau.sum() > 20  # both curves (a single step: both markers) are drawn
    if len(steps) > 1:  # the loss falls and tau rises: the loss ends lower on the image, tau higher
        loss_left, loss_right = height_trend(loss)
        tau_left, tau_right = height_trend(tau)
        assert loss_right > loss_left + 50 and tau_right < tau_left - 50, (loss_left, loss_right, tau_left, tau_right)
        assert shown(png)["Title"].startswith("Drafter training, 600 steps: batch loss ")
    assert "flashdraft:before_after" not in shown(png)
    assert not list(png.parent.glob(".*"))


def test_without_matplotlib_the_curve_is_skipped_with_one_line_saying_how_to_get_it(tmp_path, monkeypatch, caplog):
    with MetricsLogger(tmp_path, total_steps=10, console=console()) as metrics:
        metrics.log(10, row(10))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'flashdraft\[plot\]'"):
        plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert draw_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png") is None
    assert [r.getMessage() for r in caplog.records] == [
        "training curve not drawn: matplotlib is not installed (pip install 'flashdraft[plot]' to get it; every "
        f"value is in {tmp_path / 'metrics.jsonl'})"
    ]
    assert not (tmp_path / "curve.png").exists()


def test_the_curves_trend_is_a_centered_mean_of_the_log_windows():
    values = torch.randn(37, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).tolist()
    for reach in (1, 3):
        # Reference: each point's neighbourhood, clipped at the ends, averaged by torch.
        near = [values[max(0, i - reach) : min(len(values), i + reach + 1)] for i in range(len(values))]
        want = [torch.tensor(v, dtype=torch.float64).mean().item() for v in near]
        assert centered_mean(values, reach) == pytest.approx(want, rel=1e-12)
    assert [trend_reach(n) for n in (1, 9, 10, 19, 40, 60, 100)] == [0, 0, 2, 2, 2, 3, 5]


def test_plot_of_an_empty_log_says_so(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no logged step has a loss or τ to plot"):
        plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")


def test_a_nan_is_left_out_of_the_series(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    with MetricsLogger(tmp_path, total_steps=30, console=console()) as metrics:
        for step in (10, 20, 30):
            metrics.log(step, {"loss": 4.0 - step / 20 if step != 20 else float("nan"), "sim_tau": 1 + step / 30})
    series = json.loads(shown(plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "a.png"))["flashdraft:series"])
    assert [s for s, _ in series["loss"]] == [10, 30] and [s for s, _ in series["sim_tau"]] == [10, 20, 30]
