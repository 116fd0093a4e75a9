"""What the training loop reports as it goes: the metrics row of a log line, the time to the first step, where the
run's time went, and the run's result.

    window = LogWindow(cfg.log.every)
    window.add(stats, tokens)                              # after every step
    row = window.row(timer.lap(), s, lr)                   # at a log line: loss, accuracy, τ, speed, MFU
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.distributed.ranks import world
from flashdraft.telemetry.flops import step_flops
from flashdraft.telemetry.metrics import describe_before_after
from flashdraft.telemetry.timer import Timer

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    out: Path
    steps: int
    loss: float  # the training batches' loss over the last log window
    sim_tau: float  # their simulated τ
    measured_tau: float | None  # the final evaluation's (None: no held-out prompts, or the run was stopped)
    checkpoint: Path | None
    curve: Path | None
    stopped_by: str | None = None  # the signal that ended the run early (SIGTERM, SIGINT), if one did
    change: dict | None = None  # the first and last evaluation: `telemetry.metrics.before_after`

    def summary(self) -> str:
        """'190 steps, batch loss 3.137, batch simulated τ 2.16 (the last log window)', then, for a run with
        held-out prompts, 'held-out loss 2.905 → 2.401, measured τ 3.10 → 3.62 on 8 prompts (step 0 → 190)'."""
        line = f"{self.steps} steps, batch loss {self.loss:.3f}, batch simulated τ {self.sim_tau:.2f} (the last log window)"
        return line + (f"\n{describe_before_after(self.change)}" if self.change else "")


class LogWindow:
    """The steps a log line reports. Loss, accuracy and τ are over the last `every` steps: the line after a run's
    last full window (a run that does not end on a multiple of log.every, or a stop) reaches back into the window
    before it rather than report one or two steps' worth of sequences. Speed is over the steps since the last line."""

    def __init__(self, every: int) -> None:
        self.stats: deque = deque(maxlen=every)
        self.tokens, self.drafted = 0, 0

    def add(self, stats, tokens: int) -> None:
        self.stats.append(stats)
        self.tokens += tokens
        self.drafted = self.drafted + stats.valid.sum()  # a device tensor: read at the row, not one sync per step

    def row(self, seconds: float, s, lr: float) -> dict:
        """The metrics row of the window (`summarize`), `seconds` after the last one; starts the next speed count."""
        timing, self.tokens, self.drafted = (self.tokens, int(self.drafted), seconds), 0, 0
        return summarize(functools.reduce(operator.add, self.stats), timing, s, lr)


def summarize(stats, timing: tuple[int, int, float], s, lr: float) -> dict:
    """A metrics row: loss, accuracy and τ of `stats` (summed over the steps of a log window: token-weighted means
    over it); speed and MFU of `timing` (sequence tokens, drafted positions, seconds since the last row) on Setup
    `s`. "mfu" is None on a GPU of unknown peak, absent on a CPU."""
    tokens, drafted, seconds = timing
    acc = stats.accuracy()
    row = {
        "loss": float(stats.loss_sum / stats.weight_sum.clamp(min=1e-12)),
        "sim_tau": float(stats.tau()),
        "block_tau": float(stats.block_tau()),
        "acc": [round(float(a), 4) for a in acc],
        "tok_s": tokens / seconds,
        "draft_tok_s": drafted / seconds,
        "mem_gib": torch.cuda.max_memory_allocated() / 2**30 if s.device.type == "cuda" else None,
        "lr": lr,
    }
    if s.device.type == "cuda":
        # Tokens and positions are every rank's (the global steps'): against every rank's peak.
        peak = s.peak.flops * world().size if s.peak else None
        row["mfu"] = step_flops(s, tokens, drafted) / seconds / peak if peak else None
    return row


def log_first_step(timer: Timer) -> None:
    """Once per run: how long until the first step was done, what came before it (loading the target, the data and
    the drafter; the evaluation at step 0) and how long the step itself took (on a GPU, its compiles and Triton
    autotuning)."""
    step = timer.seconds["first step"]
    total = timer.since_start()
    parts = ", ".join(f"{name} {sec:.1f}" for name, sec in timer.seconds.items() if name != "first step")
    logger.info(
        "first step after %.1f s (before it %.1f s: %s; the step itself %.1f s)", total, total - step, parts, step
    )


def report_wall_time(timer: Timer, out: Path) -> None:
    """Where the run's time went: one log line and OUT/wall_time.json (rank 0)."""
    if world().is_main:
        logger.info("%s", timer.line())
        timer.write(out / "wall_time.json")


def result(out: Path, steps: int, last: dict, checkpoint, curve, stopped_by, change) -> TrainResult:
    """The run's TrainResult from its last metrics row `last` (rank 0's; empty on the other ranks)."""
    nan = math.nan
    return TrainResult(
        out,
        steps,
        last.get("loss", nan),
        last.get("sim_tau", nan),
        last.get("tau"),
        checkpoint,
        curve,
        stopped_by,
        change,
    )
