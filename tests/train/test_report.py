"""What the loop reports: the metrics row of a log line (MFU against the device's peak, means over the window) and
the run's result."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashdraft.telemetry import flops
from flashdraft.telemetry.metrics import format_line
from flashdraft.train import report
from flashdraft.train.loss.stats import LossStats

CUDA = torch.device("cuda")


def _window_stats():
    """LossStats of a log window: 3 of 4 positions right, on a drafter of block size 3."""
    return LossStats(
        loss_sum=torch.tensor(8.0),
        weight_sum=torch.tensor(4.0),
        correct=torch.tensor([0, 2, 1]),
        valid=torch.tensor([0, 2, 2]),
        accepted=torch.tensor(3),
        blocks=torch.tensor(2),
    )


@pytest.mark.parametrize("peak, mfu", [(None, None), (flops.Peak(1e9, "test"), 0.2)])
def test_summarize_reports_mfu_against_the_devices_peak_or_unknown(monkeypatch, peak, mfu):
    monkeypatch.setattr(report, "step_flops", lambda s, tokens, labelled: 2e8 * (tokens == 100 and labelled == 4))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2**30)
    s = SimpleNamespace(device=CUDA, peak=peak)
    row = report.summarize(_window_stats(), (100, 4, 1.0), s, lr=1e-4)
    assert row["mfu"] == mfu and row["loss"] == 2.0 and row["mem_gib"] == 1.0
    assert ("MFU –" in format_line(1, row)) == (mfu is None)
    cpu = report.summarize(_window_stats(), (100, 4, 1.0), SimpleNamespace(device=torch.device("cpu"), peak=None), 1e-4)
    assert "mfu" not in cpu and "MFU" not in format_line(1, cpu)


def test_the_log_window_is_the_last_steps_and_its_speed_the_steps_since_the_last_row():
    window = report.LogWindow(2)
    s = SimpleNamespace(device=torch.device("cpu"), peak=None)
    for _ in range(3):
        window.add(_window_stats(), 100)
    row = window.row(2.0, s, lr=1e-4)
    assert row["tok_s"] == 150.0 and row["draft_tok_s"] == 6.0  # 3 steps of 100 tokens and 4 positions, in 2 s
    assert row["loss"] == 2.0 and len(window.stats) == 2
    window.add(_window_stats(), 10)
    assert window.row(1.0, s, lr=1e-4)["tok_s"] == 10.0  # counted anew; loss over the last 2 steps still


def test_the_result_says_what_changed():
    change = {
        "steps": [0, 6],
        "prompts": 1,
        "heldout_loss": [2.9, 2.5],
        "heldout_sim_tau": [2.1, 2.3],
        "tau": [3.0, 3.2],
    }
    last = {"loss": 3.137, "sim_tau": 2.164, "tau": 3.2}
    result = report.result(Path("out"), 6, last, None, None, None, change)
    assert result.measured_tau == 3.2 and result.loss == 3.137
    assert result.summary() == (
        "6 steps, batch loss 3.137, batch simulated τ 2.16 (the last log window)\n"
        "held-out loss 2.900 → 2.500, measured τ 3.00 → 3.20 on 1 prompts (step 0 → 6)"
    )
    stopped = report.result(Path("out"), 2, {}, None, None, "SIGTERM", None)  # another rank: no row
    assert math.isnan(stopped.loss) and stopped.measured_tau is None and "held-out" not in stopped.summary()
