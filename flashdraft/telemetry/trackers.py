"""Experiment trackers a run can send its scalars to, each used only when named in `log.trackers`.

Trackers, each used only when named in `log.trackers`: "wandb" (project $WANDB_PROJECT or "flashdraft"; wandb
itself reads WANDB_MODE, WANDB_DIR, ...), "tensorboard" (SummaryWriter in OUT/tb), "trackio" (project
$TRACKIO_PROJECT or "flashdraft"). They receive the run config through `redact`, never environment values. A named
tracker that is not installed is a config error (`check_trackers`, before anything loads): whoever names one wants
that run's dashboard, and a run of hours that quietly went without it is found out only when it is too late. One
that is installed but fails to start or to log (no login, no network) is dropped with a warning; training goes on.
"""

from __future__ import annotations

import abc
import importlib.util
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

TRACKERS = ("wandb", "tensorboard", "trackio")


def check_trackers(names: list[str] | tuple[str, ...], installed: bool = True) -> None:
    """Raise ValueError naming `log.trackers` for a tracker that is unknown or (`installed`) not installed."""
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"log.trackers: unknown tracker {unknown[0]!r}; valid: {', '.join(TRACKERS)}")
    for name in names if installed else ():
        package = _TRACKER_CLASSES[name][1]
        if not _installed(package):
            raise ValueError(
                f"log.trackers: {name!r} is not installed: pip install {package} (or remove {name!r} from log.trackers)"
            )


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return False


class Tracker(abc.ABC):
    """One optional experiment tracker: each logged step's scalars, then close."""

    name = ""

    @abc.abstractmethod
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class _TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, out: Path, config: dict, resume_from_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events logged after the checkpoint, like the metrics.jsonl truncation.
        purge = None if resume_from_step is None else resume_from_step + 1
        self.writer = SummaryWriter(log_dir=str(out / "tb"), purge_step=purge)
        if resume_from_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb(Tracker):
    name = "wandb"

    def __init__(self, out: Path, config: dict, resume_from_step: int | None) -> None:
        import wandb

        # The run id is kept beside the metrics so a resumed run continues the same wandb run.
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_from_step is not None and id_file.is_file() else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "flashdraft"),
            config=config,
            dir=str(out),
            id=run_id,
            resume="allow" if run_id else None,
        )
        id_file.write_text(self.run.id + "\n")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio(Tracker):
    name = "trackio"

    def __init__(self, out: Path, config: dict, resume_from_step: int | None) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "flashdraft"), config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.trackio.log(scalars, step=step)

    def close(self) -> None:
        self.trackio.finish()


_TRACKER_CLASSES = {
    "wandb": (_Wandb, "wandb"),
    "tensorboard": (_TensorBoard, "tensorboard"),
    "trackio": (_Trackio, "trackio"),
}


def open_tracker(name: str, out: Path, config: dict, resume_from_step: int | None) -> Tracker | None:
    cls, _ = _TRACKER_CLASSES[name]
    try:
        return cls(out, config, resume_from_step)
    except Exception as exc:
        logger.warning(
            "tracker %r did not start (%s: %s); training continues without it", name, type(exc).__name__, exc
        )
        return None
