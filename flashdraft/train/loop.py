"""The DFlash training loop: frozen target → context features → packed blocks → drafter → chunked loss.

    flashdraft train                                     # the bundled default: a laptop CPU, a few minutes
    flashdraft train --config examples/tiny.yaml --out runs/tiny train.max_steps=50
    flashdraft train --config examples/qwen3.5-27b.yaml --resume

Everything a step needs is derived from the step number (data order and anchors are seeded by (seed, epoch,
sample)), so a resumed run repeats an uninterrupted one exactly. Many processes (torchrun): see
flashdraft/train/distributed.py and data_parallel.py; the loop calls them in a few places and is otherwise the same.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import operator
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.config import RunConfig, to_dict
from flashdraft.devices import autocast
from flashdraft.io.atomic import atomic_write_text
from flashdraft.train import data_parallel, distributed
from flashdraft.train.blocks import before_labels
from flashdraft.train.checkpoint import CheckpointManager
from flashdraft.train.compile import compile_enabled, static_shapes
from flashdraft.train.flops import step_flops
from flashdraft.train.loss import Objective, dflash_loss
from flashdraft.train.masks import attention_kind, drafter_mask
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.optim import build_optimizer, build_scheduler
from flashdraft.train.plot import draw_training_curve
from flashdraft.train.setup import Setup, collate, pad_positions, setup, step_blocks, step_indices
from flashdraft.train.stop import GracefulStop
from flashdraft.train.tau import measure_tau, periodic_tau
from flashdraft.train.trackers import check_trackers
from flashdraft.train.wallclock import WallClock, synchronize

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); the message names the last good checkpoint."""


@dataclass
class TrainResult:
    out: Path
    steps: int
    loss: float
    sim_tau: float
    measured_tau: float | None
    checkpoint: Path | None
    curve: Path | None
    stopped_by: str | None = None  # the signal that ended the run early (SIGTERM, SIGINT), if one did


def train(cfg: RunConfig, resume: bool = False, console=None) -> TrainResult:
    clock = WallClock()
    out = Path(cfg.log.out)
    check_trackers(cfg.log.trackers)  # before minutes of loading
    # Decided before config.json is written: it is what tells this run's OUT from another run's.
    restart = resume and restart_without_checkpoint(out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    if distributed.world().is_main:
        # Other ranks may read it meanwhile (`restart_without_checkpoint`): never a half-written one.
        atomic_write_text(out / "config.json", json.dumps(to_dict(cfg), indent=1))
    # The run's own copy: setup decides its `auto` compile switches in it (config.json keeps what was asked).
    cfg = copy.deepcopy(cfg)
    s = setup(cfg, out, console, clock)
    optimizer = build_optimizer(s.drafter.parameters(), cfg.optim, s.device)
    scheduler = build_scheduler(optimizer, cfg.optim, s.total_steps)
    checkpoints = CheckpointManager(out, keep=cfg.log.keep_checkpoints)
    start, latest = 0, None
    if restart:
        logger.warning(
            "--resume: %s holds this run's config but no checkpoint yet (it stopped before the first); "
            "starting from step 0, the steps it logged are dropped",
            out,
        )
    elif resume:
        latest = checkpoints.latest()
        if latest is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
        start = checkpoints.load(latest, s.drafter, optimizer, scheduler)["step"]
        logger.info("resumed from %s (step %d)", latest, start)
    metrics = MetricsLogger(
        out,
        total_steps=s.total_steps,
        trackers=cfg.log.trackers,
        config=to_dict(cfg),
        console=console,
        resume_from_step=start if resume else None,
        enabled=distributed.world().is_main,
    )
    # The checkpoint resumed from, not a second latest(): that would hash every checkpoint again and repeat the
    # warning about each damaged one it skips.
    last_ckpt, timer = latest, _Timer(s.device)
    # Loss, accuracy and τ of a log line are over the last log.every steps: the line after a run's last full window
    # (a run that does not end on a multiple of log.every, or a stop) reaches back into the window before it rather
    # than report one or two steps' worth of sequences.
    window: deque = deque(maxlen=cfg.log.every)
    skipped, stopped_by = 0, None
    # The steps are not timed one by one (a sync per step): they are the loop's time less the phases inside it.
    loop_started, timed_before = clock.since_start(), sum(clock.seconds.values())
    with metrics.progress(), GracefulStop() as stop:
        metrics.advance(start)
        for step in range(start, s.total_steps):
            with clock.phase("first step") if step == start else contextlib.nullcontext():
                stats, tokens, finite = train_step(s, cfg, optimizer, step)
            if step == start:
                _log_first_step(clock)
            if not finite:
                if cfg.train.on_nonfinite == "stop":
                    raise TrainingError(
                        f"non-finite loss or gradient at step {step + 1}; nothing of it was applied. "
                        f"Last good checkpoint: {last_ckpt or 'none'} (resume with --resume, or set "
                        "train.on_nonfinite=skip)"
                    )
                skipped += 1
                logger.warning("step %d: non-finite loss or gradient, update skipped (%d so far)", step + 1, skipped)
            scheduler.step()
            window.append(stats)
            timer.add(tokens, stats.valid.sum())
            metrics.advance()
            done = step + 1
            # A stop logs the steps since the last log line too, so none is lost from the metrics.
            halt = stop.requested(s.device)
            if done % cfg.log.every == 0 or done == s.total_steps or halt:
                row = summarize(functools.reduce(operator.add, window), timer.take(), s, scheduler.get_last_lr()[0])
                row["skipped"] = skipped
                if cfg.log.eval_every and done % cfg.log.eval_every == 0 and done < s.total_steps and not halt:
                    with clock.phase("measured τ"):
                        row["tau"] = periodic_tau(cfg, s)
                    timer.take()  # decoding time is not training throughput
                metrics.log(done, row)
            if done % cfg.log.checkpoint_every == 0 or done == s.total_steps or halt:
                with clock.phase("checkpoints"):
                    last_ckpt = checkpoints.save(done, s.drafter, optimizer, scheduler, {"step": done})
            if halt:
                stopped_by = stop.signal_name or "another rank's signal"
                logger.warning(
                    "%s: stopped after step %d of %d; checkpoint %s (continue with --resume)",
                    stopped_by,
                    done,
                    s.total_steps,
                    last_ckpt,
                )
                break
    metrics.close()
    synchronize()
    timed_inside = sum(clock.seconds.values()) - timed_before  # the first step, evaluations, checkpoints
    clock.add("steps", clock.since_start() - loop_started - timed_inside)
    main = distributed.world().is_main
    if stopped_by is not None:
        # No final τ measurement: a stopped job should leave within its grace period.
        with clock.phase("plot"):  # the stop logged a metrics row (above)
            curve = draw_training_curve(out / "metrics.jsonl", out / "training_curve.png") if main else None
        _report_wall_time(clock, out, main)
        return TrainResult(out, done, float("nan"), float("nan"), None, last_ckpt, curve, stopped_by)
    # Decoding (the measured τ) and the report are rank 0's, on a plain copy of the (sharded) drafter.
    s.drafter = data_parallel.gather_drafter(s.drafter)
    if s.drafter is None:
        return TrainResult(out, s.total_steps, float("nan"), float("nan"), None, last_ckpt, None)
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]
    with clock.phase("measured τ"):
        measured = measure_tau(cfg, s, out / "measured_tau.json")
    with clock.phase("plot"):
        curve = draw_training_curve(out / "metrics.jsonl", out / "training_curve.png", final_tau=measured)
    _report_wall_time(clock, out, main)
    return TrainResult(out, s.total_steps, final["loss"], final["sim_tau"], measured, last_ckpt, curve)


def _report_wall_time(clock: WallClock, out: Path, main: bool) -> None:
    """Where the run's time went: one log line and OUT/wall_time.json (rank 0)."""
    if main:
        logger.info("%s", clock.line())
        clock.write(out / "wall_time.json")


def restart_without_checkpoint(out: Path, cfg: RunConfig) -> bool:
    """Whether `--resume` starts from step 0: OUT has no checkpoint yet but this same run's config.json (a job
    stopped before its first checkpoint, restarted with its command line). False when OUT has a checkpoint; a
    FileNotFoundError naming the difference when OUT has neither, or another run's config."""
    if CheckpointManager(out).checkpoints():
        return False
    saved = out / "config.json"
    if not saved.is_file():
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out / 'checkpoints'} and no run started in {out} (nothing to resume)"
        )
    try:
        before = json.loads(saved.read_text())
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out / 'checkpoints'}, and {saved} is unreadable ({exc})"
        ) from None
    difference = _first_difference(json.loads(json.dumps(to_dict(cfg))), before)
    if difference is not None:
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out / 'checkpoints'}, and {saved} is another run's "
            f"config ({difference}): give this run another --out, or drop --resume to start it "
            "over there"
        )
    return True


def _first_difference(now, before, prefix: str = "") -> str | None:
    """'train.max_steps: 8 now, 6 there' for the first key whose value differs; None when equal."""
    if isinstance(now, dict) and isinstance(before, dict):
        for key in dict.fromkeys([*now, *before]):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in now or key not in before:
                return (
                    f"{name}: {repr(now[key]) if key in now else 'missing'} now, "
                    f"{repr(before[key]) if key in before else 'missing'} there"
                )
            if (found := _first_difference(now[key], before[key], name)) is not None:
                return found
        return None
    return None if now == before else f"{prefix}: {now!r} now, {before!r} there"


def train_step(s: Setup, cfg: RunConfig, optimizer, step: int, mark=None):
    """One optimizer step over `grad_accum` micro-batches; the loss is normalised over the whole step.

    Returns (loss stats, sequence tokens, finite). A non-finite loss or gradient norm applies no update.
    `mark(phase)` (benchmarks: `flashdraft.train.step_timing`) is called as each phase has been queued: "target",
    "drafter_fwd", "loss", "drafter_bwd" per micro-batch, then "optimizer".
    """
    mark = mark or _no_mark
    attention = attention_kind(cfg.train.attention, s.device)
    # Static shapes: the drafter sees data.max_length positions and recipe.num_anchors blocks in every micro-batch
    # (the target still runs on the real width; its features are padded after).
    width = cfg.data.max_length if static_shapes(cfg.train.static_shapes, cfg.train.compile, s.device) else None
    # The loss's softmax math is compiled with the drafter: a run too short for one compile pays for neither.
    compile_loss = compile_enabled(cfg.train.compile, s.device)
    indices = step_indices(s, cfg, step)
    micro = [collate(s.data, idx, s.device) for idx in indices]
    epoch = step // s.steps_per_epoch
    batches = [
        step_blocks(s, cfg, ids, mask, idx, epoch, width) for (ids, mask, _), idx in zip(micro, indices, strict=True)
    ]
    # Over the whole global step (every micro-batch of every rank): each token weighs the same whatever the split.
    objective = Objective.from_recipe(cfg.recipe)
    normalisers = sum(objective.normaliser(b.labels, b.weights, b.block_size) for b in batches)
    denominator = data_parallel.all_sum(normalisers).clamp(min=1e-6)
    # Counted before the GPU work is queued: a host sync later would stall the queue between micro-batches.
    tokens = sum(int(attn.sum()) for _, _, attn in micro)
    total = None
    soft = cfg.recipe.labels == "target"
    for (ids, _, attn), batch, idx in zip(micro, batches, indices, strict=True):
        teacher_hidden = None
        if soft:  # the target's own distribution before each label (recipe.labels: target)
            features, final = s.target.capture(ids, attn, final=True)
            teacher_hidden = before_labels(final, batch)
        else:
            features = s.target.capture(ids, attn) if s.features is None else s.features.batch(idx, ids.shape[1])
        if width is not None:
            features = pad_positions(features, width)
        mark("target")
        with autocast(s.device):
            hidden = s.drafter(
                position_ids=batch.position_ids,
                attention_mask=drafter_mask(batch, s.drafter.config, attention),
                noise_embedding=s.target.embed(batch.block_ids),
                target_hidden=features,
            )
        mark("drafter_fwd")
        loss, stats = dflash_loss(
            hidden,
            s.target.lm_head_weight,
            batch.labels,
            batch.weights,
            block_size=batch.block_size,
            denominator=denominator,
            objective=objective,
            teacher_hidden=teacher_hidden,
            compile_chunks=compile_loss,
        )
        mark("loss")
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


def _no_mark(phase: str) -> None:
    pass


def _log_first_step(clock: WallClock) -> None:
    """Once per run: how long until the first step was done, and how much of it was the step itself (on a GPU, its
    compiles and Triton autotuning) rather than loading the target, the data and the drafter."""
    step = clock.seconds["first step"]
    total = clock.since_start()
    parts = ", ".join(f"{name} {sec:.1f}" for name, sec in clock.seconds.items() if name != "first step")
    logger.info("first step after %.1f s (setup %.1f s: %s; the step itself %.1f s)", total, total - step, parts, step)


class _Timer:
    """Sequence tokens, labelled (drafted) positions and seconds since the last `take`."""

    def __init__(self, device: torch.device):
        self.device, self.tokens, self.drafted, self.start = device, 0, 0, time.perf_counter()

    def add(self, tokens: int, drafted) -> None:
        self.tokens += tokens
        self.drafted = self.drafted + drafted  # a device tensor: read at `take`, not one host sync per step

    def take(self) -> tuple[int, int, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        out = (self.tokens, int(self.drafted), now - self.start)
        self.tokens, self.drafted, self.start = 0, 0, now
        return out


def summarize(stats, timing: tuple[int, int, float], s: Setup, lr: float) -> dict:
    """A metrics row: loss, accuracy and τ of `stats` (summed over the steps of a log window: token-weighted means
    over it); speed and MFU of `timing` (sequence tokens, drafted positions, seconds since the last row). "mfu" is
    None on a GPU of unknown peak, absent on a CPU."""
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
        peak = s.peak.flops * distributed.world().size if s.peak else None
        row["mfu"] = step_flops(s, tokens, drafted) / seconds / peak if peak else None
    return row
