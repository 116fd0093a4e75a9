"""The training curve: what it draws, and a run without matplotlib."""

import logging
import math
import sys

import pytest
import torch

from flashdraft.telemetry.metrics import MetricsLogger
from flashdraft.telemetry.plot import centered_mean, draw_training_curve, plot_training_curve, trend_reach
from tests.telemetry.drawn import curve_pixels, height_trend
from tests.telemetry.logged import console, row

LOGGER = "flashdraft.telemetry.plot"


@pytest.mark.parametrize("steps", [[10], list(range(10, 610, 10))])
def test_plot_training_curve_writes_a_png(tmp_path, steps):
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
    with pytest.raises(ValueError, match="no logged step has a loss or sim_tau"):
        plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png")


def test_plot_draws_the_final_measured_tau_and_ignores_a_nan(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    with MetricsLogger(tmp_path, total_steps=30, console=console()) as metrics:
        for step in (10, 20, 30):
            metrics.log(step, {"loss": 4.0 - step / 20, "sim_tau": 1 + step / 30})
    plain = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "a.png").read_bytes()
    nan = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "b.png", final_tau=float("nan")).read_bytes()
    final = plot_training_curve(tmp_path / "metrics.jsonl", tmp_path / "c.png", final_tau=2.7).read_bytes()
    assert nan == plain and final != plain
