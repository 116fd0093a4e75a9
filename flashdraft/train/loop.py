"""The DFlash training loop: frozen target → context features → packed blocks → drafter → chunked loss.

    flashdraft train                                     # the bundled default: a 2-core CPU, under 3 minutes
    flashdraft train --config examples/tiny.yaml --out runs/tiny train.max_steps=50
    flashdraft train --config examples/qwen3.5-27b.yaml --resume

`train` reads top to bottom: build the run (setup.py), resume (resume.py), evaluate the drafter as it starts
(evaluation.py), then one `train_step` per step, a log line (report.py) every log.every steps, an evaluation every
log.eval_every and at the end, a checkpoint every log.checkpoint_every and at the end. Everything a step reads is
a function of the step number (dataloader.py), so a resumed run repeats an uninterrupted one exactly. Many
processes (torchrun): flashdraft.distributed; the loop is the same with one process or many.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from pathlib import Path

import torch

from flashdraft.config import RunConfig, to_dict
from flashdraft.distributed import data_parallel, faults, job
from flashdraft.distributed.ranks import world
from flashdraft.distributed.stop import GracefulStop
from flashdraft.io.atomic import atomic_write_text
from flashdraft.telemetry.metrics import MetricsLogger, before_after, read_metrics
from flashdraft.telemetry.plot import draw_training_curve
from flashdraft.telemetry.timer import Timer, synchronize
from flashdraft.telemetry.trackers import check_trackers
from flashdraft.train.checkpoint import CheckpointManager
from flashdraft.train.dataloader import MicroBatch
from flashdraft.train.evaluation import Evaluator
from flashdraft.train.forward import Drafting, no_mark
from flashdraft.train.optim import build_optimizer, build_scheduler
from flashdraft.train.report import LogWindow, TrainResult, log_first_step, report_wall_time, result
from flashdraft.train.resume import restart_without_checkpoint, resume_point
from flashdraft.train.setup import Setup, setup

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); the message names the last good checkpoint."""


def train(cfg: RunConfig, resume: bool = False, console=None) -> TrainResult:
    timer, out = Timer(), Path(cfg.log.out)
    check_trackers(cfg.log.trackers)  # before minutes of loading
    # Decided before config.json is written: it is what tells this run's OUT from another run's.
    restart = resume and restart_without_checkpoint(out, cfg)
    _write_config(out, cfg)
    cfg = copy.deepcopy(cfg)  # the run's own copy: setup decides its `auto` compile switches in it
    s = setup(cfg, out, console, timer)
    job.steady()  # the ranks leave their start together; from here on a collective waits train.collective_timeout_s
    optimizer = build_optimizer(s.drafter.parameters(), cfg.optim, s.device)
    scheduler = build_scheduler(optimizer, cfg.optim, s.total_steps)
    checkpoints = CheckpointManager(out, keep=cfg.log.keep_checkpoints)
    start, last_ckpt = resume_point(resume, restart, checkpoints, s, optimizer, scheduler)
    metrics = MetricsLogger(
        out,
        total_steps=s.total_steps,
        trackers=cfg.log.trackers,
        config=to_dict(cfg),
        console=console,
        resume_from_step=start if resume and not restart else None,
        enabled=world().is_main,
    )
    evaluator, window, skipped, stopped_by = Evaluator(cfg, s, out), LogWindow(cfg.log.every), 0, None
    with metrics.progress(), GracefulStop() as stop:
        metrics.advance(start)
        if start == 0:  # the drafter as the run found it: the "before" of every evaluation after
            _log(metrics, 0, {}, evaluator, "all", timer)
        # The steps are not timed one by one (a sync per step): they are the loop's time less the phases inside it.
        loop_started, timed_before = timer.since_start(), sum(timer.seconds.values())
        timer.lap()
        done = start
        for step in range(start, s.total_steps):
            faults.note(f"step {step + 1}")
            with timer.phase("first step") if step == start else contextlib.nullcontext():
                stats, tokens, finite = train_step(s, cfg, optimizer, next(s.batches))
            if step == start:
                log_first_step(timer)
            skipped += _check_finite(finite, step, cfg, skipped, last_ckpt)
            scheduler.step()
            window.add(stats, tokens)
            metrics.advance()
            done = step + 1
            halt = stop.requested(s.device)  # a stop logs and checkpoints the steps since the last ones too
            if done % cfg.log.every == 0 or done == s.total_steps or halt:
                row = window.row(timer.lap(), s, scheduler.get_last_lr()[0]) | {"skipped": skipped}
                _log(metrics, done, row, evaluator, _evaluation_due(cfg, done, s.total_steps, halt), timer)
            if done % cfg.log.checkpoint_every == 0 or done == s.total_steps or halt:
                with timer.phase("checkpoints"):
                    state = {"step": done, "data": s.batches.state_dict()}
                    last_ckpt = checkpoints.save(done, s.drafter, optimizer, scheduler, state)
            if halt:
                stopped_by = stop.signal_name or "another rank's signal"
                logger.warning(
                    "%s: stopped after step %d; checkpoint %s (--resume goes on)", stopped_by, done, last_ckpt
                )
                break
    metrics.close()
    synchronize()
    timer.add("steps", timer.since_start() - loop_started - (sum(timer.seconds.values()) - timed_before))
    curve, change = _curve_and_change(out, timer)
    report_wall_time(timer, out)
    return result(out, done, metrics.latest, last_ckpt, curve, stopped_by, change)


def train_step(s: Setup, cfg: RunConfig, optimizer, batch: list[MicroBatch], mark=no_mark):
    """One optimizer step over this rank's micro-batches of a step (`s.batches`); the loss is normalised over the
    whole step, every micro-batch of every rank, so each token weighs the same whatever the split.

    Returns (loss stats, sequence tokens, finite). A non-finite loss or gradient norm applies no update.
    `mark(phase)` (benchmarks: `flashdraft.benchmarks.train_step`) is called as each phase has been queued:
    "target", "drafter_fwd", "loss", "drafter_bwd" per micro-batch, then "optimizer".
    """
    drafting = Drafting.of(cfg, s)
    denominator = data_parallel.all_sum(drafting.normaliser(batch)).clamp(min=1e-6)
    tokens, total = sum(micro.tokens for micro in batch), None
    for micro in batch:
        loss, stats = drafting.loss(micro, denominator, mark)
        loss.backward()
        mark("drafter_bwd")
        total = stats if total is None else total + stats
    grad_norm = data_parallel.clip_grad_norm_(s.drafter.parameters(), cfg.optim.grad_clip)
    total, tokens = data_parallel.sum_stats(total, tokens)
    # One host sync per step: applying a NaN update would poison every later step and checkpoint.
    finite = bool(torch.isfinite(total.loss_sum) & torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")
    return total, tokens, finite


def _write_config(out: Path, cfg: RunConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if world().is_main:  # other ranks may read it meanwhile (`restart_without_checkpoint`): never a half-written one
        atomic_write_text(out / "config.json", json.dumps(to_dict(cfg), indent=1))


def _evaluation_due(cfg: RunConfig, done: int, total: int, halt: bool) -> str | None:
    """What `done` steps call for: "all" (the held-out scores and the measured τ: at the end, every log.eval_every),
    "heldout" (the held-out scores alone: every log.heldout_every) or None."""
    if halt:
        return None
    if done == total or cfg.log.eval_every and done % cfg.log.eval_every == 0:
        return "all"
    return "heldout" if cfg.log.heldout_every and done % cfg.log.heldout_every == 0 else None


def _log(metrics: MetricsLogger, step: int, row: dict, evaluator: Evaluator, due: str | None, timer: Timer) -> None:
    """Log `row` of `step`, with the scores of the evaluation `due` ("all", "heldout"; collective: every rank
    calls it). Evaluating is not training: the next log window's speed is counted from its end."""
    if due is not None and evaluator.enabled:
        with timer.phase("evaluation"):
            row = row | (evaluator.evaluate(measure=due == "all") or {})
        timer.lap()
    if row:
        metrics.log(step, row)


def _curve_and_change(out: Path, timer: Timer) -> tuple[Path | None, dict | None]:
    """Rank 0: the training curve and the run's first and last evaluation, from metrics.jsonl; None, None on the
    other ranks."""
    if not world().is_main:
        return None, None
    with timer.phase("plot"):
        curve = draw_training_curve(out / "metrics.jsonl", out / "training_curve.png")
    return curve, before_after(read_metrics(out / "metrics.jsonl"))


def _check_finite(finite: bool, step: int, cfg: RunConfig, skipped: int, last_ckpt) -> int:
    """1 for a step whose update was skipped (non-finite, `train.on_nonfinite: skip`), 0 for a finite one; a
    TrainingError naming the last good checkpoint with `train.on_nonfinite: stop`."""
    if finite:
        return 0
    if cfg.train.on_nonfinite == "stop":
        raise TrainingError(
            f"non-finite loss or gradient at step {step + 1}; nothing of it was applied. Last good checkpoint: "
            f"{last_ckpt or 'none'} (resume with --resume, or set train.on_nonfinite=skip)"
        )
    logger.warning("step %d: non-finite loss or gradient, update skipped (%d so far)", step + 1, skipped + 1)
    return 1
