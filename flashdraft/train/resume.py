"""`--resume`: where a run starts. From the newest checkpoint that verifies (the drafter, optimizer, scheduler, RNG
and data loader states), or from step 0 again when OUT holds this same run's config but no checkpoint yet (a job
stopped before its first one, restarted with its command line).

    resume = args.resume or restarted(out, cfg)                    # torchrun --max-restarts: resume by itself
    restart = resume and restart_without_checkpoint(out, cfg)      # before config.json is written
    start, checkpoint = resume_point(resume, restart, checkpoints, s, optimizer, scheduler)
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from flashdraft.config import RunConfig, to_dict
from flashdraft.train.checkpoint import CheckpointManager

logger = logging.getLogger(__name__)


def resume_point(resume: bool, restart: bool, checkpoints: CheckpointManager, s, optimizer, scheduler):
    """(the step the run starts after, the checkpoint it resumed from or None). Loads the checkpoint into the
    drafter, `optimizer`, `scheduler` and the data loader `s.batches` of Setup `s`."""
    if restart:
        logger.warning(
            "--resume: %s holds this run's config but no checkpoint yet (it stopped before the first); "
            "starting from step 0, the steps it logged are dropped",
            checkpoints.out,
        )
    if not resume or restart:
        return 0, None
    latest = checkpoints.latest()
    if latest is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint in {checkpoints.out / 'checkpoints'}")
    state = checkpoints.load(latest, s.drafter, optimizer, scheduler)
    # A checkpoint without the loader's state (an older one) is at its step: the order is a function of it.
    s.batches.load_state_dict(state.get("data", {"step": state["step"]}))
    logger.info("resumed from %s (step %d)", latest, state["step"])
    return state["step"], latest


def restarted(out: Path, cfg: RunConfig) -> bool:
    """Whether this worker was restarted by torchrun (`--max-restarts`: TORCHELASTIC_RESTART_COUNT > 0) after its
    job started this run in OUT: then it goes on as with `--resume`, from the newest complete checkpoint (or from
    step 0 when the run had written none). False when the earlier attempt stopped before it wrote its config: the
    run then starts as launched."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return False
    if CheckpointManager(out).checkpoints():
        return True
    try:
        return restart_without_checkpoint(out, cfg)
    except FileNotFoundError:
        return False


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
