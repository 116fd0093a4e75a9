"""Training metrics: a console line and a JSON line per log step, a progress bar, optional trackers, the curve.

    metrics = MetricsLogger(out, total_steps=600, trackers=cfg.log.trackers, config=to_dict(cfg),
                            resume_from_step=start if resume else None, enabled=rank == 0)
    with metrics.progress():
        metrics.advance(start)                     # a resumed run jumps to its start step (no fake speed)
        metrics.log(0, {"heldout_loss": 2.9, "heldout_sim_tau": 2.4, "tau": 3.1})     # an evaluation before step 1
        for step in range(start, total):
            ...
            metrics.advance()
            metrics.log(step + 1, {"loss": 3.2, "sim_tau": 1.8, "acc": [0.41, 0.22], "tok_s": 12_300, "lr": 6e-4})
    metrics.close()
    plot_training_curve(out / "metrics.jsonl", out / "training_curve.png")

`OUT/metrics.jsonl` holds one JSON object per log step (`step` first, then the metrics as given; tensors become
numbers or lists, NaN/inf become null so every line is strict JSON), flushed and fsynced as it is written. A fresh
run starts the file empty; a resumed run (`resume_from_step=S`) first drops the lines after step S, so the file
ends up equal to an uninterrupted run's.

The console line knows these keys (all optional; None is skipped): loss and sim_tau (of the training batches of
the log window: shown as "batch loss", "batch sim_tau"), heldout_loss and heldout_sim_tau (of the held-out set, at
an evaluation), tau (the measured τ of real decoding, at an evaluation), acc (per-position accuracy, acc@1 shown),
tok_s, draft_tok_s, mfu (a fraction; None is shown as "MFU –", unknown), mem_gib, grad_norm, lr. Every key goes to
the JSON line. The line is printed whole, never wrapped at the console's width, so a log file or a pipe
holds one line per log step; the progress bar is drawn only on a terminal.

Trackers (wandb, tensorboard, trackio) live in `trackers.py`; they receive the run config through `redact`. The
curve is drawn by `plot.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from flashdraft.io.atomic import atomic_write_text
from flashdraft.io.redact import redact
from flashdraft.telemetry.trackers import Tracker, check_trackers, open_tracker

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Writes metrics of rank 0 (`enabled=False` elsewhere: then every method does nothing)."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        total_steps: int,
        trackers: list[str] | tuple[str, ...] = (),
        config: Mapping | None = None,
        enabled: bool = True,
        console: Console | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        # Names are checked on every rank (a misspelt tracker is a config error wherever it is read), the packages
        # where the trackers run.
        check_trackers(trackers, installed=enabled)
        self.enabled = enabled
        self.total_steps = total_steps
        self.latest: dict = {}
        self._file = None
        self._trackers: list[Tracker] = []
        self._progress: Progress | None = None
        self._task = None
        self._first_advance = True
        if not enabled:
            return
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        self.console = console if console is not None else Console()
        _prepare_jsonl(self.path, resume_from_step)
        self._file = open(self.path, "a")
        safe_config = redact(config or {})
        for name in dict.fromkeys(trackers):
            tracker = open_tracker(name, self.out, safe_config, resume_from_step)
            if tracker is not None:
                self._trackers.append(tracker)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append one JSON line (flushed and fsynced), print one console line, forward scalars to trackers."""
        if not self.enabled:
            return
        values = {"step": int(step)}
        values.update((key, _plain(value, key)) for key, value in metrics.items() if key != "step")
        self._file.write(json.dumps(_strict_json(values), allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.latest = values
        self.console.print(
            format_line(step, values, total_steps=self.total_steps), markup=False, highlight=False, soft_wrap=True
        )
        if self._progress is not None:
            self._progress.update(self._task, stats=_bar_stats(values))
        scalars = _flatten_scalars(values)
        scalars.pop("step")
        for tracker in list(self._trackers):
            try:
                tracker.log(step, scalars)
            except Exception as exc:
                logger.warning(
                    "tracker %s failed (%s: %s); continuing without it", tracker.name, type(exc).__name__, exc
                )
                self._trackers.remove(tracker)

    @contextlib.contextmanager
    def progress(self) -> Iterator[MetricsLogger]:
        """A progress bar over `total_steps` showing the latest batch loss, sim_tau and tok/s; move it with `advance`.
        Only on a terminal: in a file or a pipe the log lines say it all, one per log step."""
        if not self.enabled or not self.console.is_terminal:
            yield self
            return
        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = bar.add_task("train", total=self.total_steps, stats=_bar_stats(self.latest))
        self._first_advance = True
        with bar:
            self._progress = bar
            try:
                yield self
            finally:
                self._progress = None

    def advance(self, n: int = 1) -> None:
        if self._progress is None:
            return
        if self._first_advance:
            # The first call may be a resumed run's jump to its start step: set it without a speed sample,
            # else the bar would report that jump as throughput (and a wrong ETA).
            self._first_advance = False
            self._progress.reset(self._task, completed=n, stats=_bar_stats(self.latest))
        else:
            self._progress.advance(self._task, n)

    def close(self) -> None:
        """Close the JSON file and finish the trackers; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as exc:
                logger.warning("tracker %s did not close cleanly (%s: %s)", tracker.name, type(exc).__name__, exc)
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- formatting -------------------------------------------------------------------------------------------------


# The console line's fields, in order: key, and how its value is shown.
_FIELDS = (
    ("loss", lambda v: f"batch loss {v:.3f}"),
    ("sim_tau", lambda v: f"batch sim_tau {v:.2f}"),
    ("heldout_loss", lambda v: f"held-out loss {v:.3f}"),
    ("heldout_sim_tau", lambda v: f"held-out sim_tau {v:.2f}"),
    ("tau", lambda v: f"τ {v:.2f} (measured)"),
    ("acc", lambda v: f"acc@1 {v[0]:.2f}" if isinstance(v, list | tuple) and v and v[0] is not None else None),
    ("tok_s", lambda v: f"{_si(v)} tok/s"),
    ("draft_tok_s", lambda v: f"{_si(v)} draft tok/s"),
    ("mfu", lambda v: f"MFU {100 * v:.1f}%"),
    ("mem_gib", lambda v: f"mem {v:.1f} GiB"),
    ("grad_norm", lambda v: f"gnorm {v:.2f}"),
    ("lr", lambda v: f"lr {_short_exp(v)}"),
)


def format_line(step: int, metrics: Mapping[str, Any], total_steps: int | None = None) -> str:
    """'step 120/600 | batch loss 3.214 | batch sim_tau 1.83 | acc@1 0.41 | 12.3K tok/s | ... | lr 5.8e-4', with
    'held-out loss 2.905 | held-out sim_tau 2.41 | τ 3.10 (measured)' after the step of an evaluation (known keys
    only; a None value is left out, but for mfu: "MFU –", a GPU whose peak rate is unknown)."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    for key, show in _FIELDS:
        value = metrics.get(key)
        if value is not None and not isinstance(value, bool):
            parts.append(show(value))
        elif key == "mfu" and key in metrics:
            parts.append("MFU –")
    return " | ".join(p for p in parts if p is not None)


def _si(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def _short_exp(value: float) -> str:
    """5.8e-4 rather than 5.8e-04."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:.1e}").replace("e+", "e")


def _bar_stats(values: Mapping[str, Any]) -> str:
    parts = []
    if values.get("loss") is not None:
        parts.append(f"batch loss {values['loss']:.3f}")
    if values.get("sim_tau") is not None:
        parts.append(f"batch sim_tau {values['sim_tau']:.2f}")
    if values.get("tok_s") is not None:
        parts.append(f"{_si(values['tok_s'])} tok/s")
    return " · ".join(parts)


# ---- values -----------------------------------------------------------------------------------------------------


def _plain(value: Any, key: str) -> Any:
    """Tensors and numpy values to Python numbers / lists; raises naming `key` for what JSON cannot hold."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v, key) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"metric {key!r}: {type(value).__name__} is not a number, list or string")


def _strict_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_strict_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    return value


def _flatten_scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers only, for trackers: lists become key/1, key/2, ... (block positions count from 1)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, int | float):
            out[name] = value
        elif isinstance(value, list):
            out.update(_flatten_scalars({str(i + 1): v for i, v in enumerate(value)}, f"{name}/"))
        elif isinstance(value, Mapping):
            out.update(_flatten_scalars(value, f"{name}/"))
    return out


# ---- metrics.jsonl ----------------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (the writer was killed mid-line) is skipped."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            logger.warning("%s:%d: not valid JSON (an interrupted write?); skipped", path, n)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def before_after(records: list[dict]) -> dict | None:
    """The first and the last evaluation of a run (the rows with a held-out loss or a measured τ): {"steps",
    "prompts", "heldout_loss", "heldout_sim_tau", "tau"}, each a [first, last] pair (None where the row lacks it);
    None without evaluations."""
    rows = [r for r in records if r.get("heldout_loss") is not None or r.get("tau") is not None]
    if not rows:
        return None
    first, last = rows[0], rows[-1]
    keys = ("heldout_loss", "heldout_sim_tau", "tau")
    return {"steps": [first["step"], last["step"]], "prompts": last.get("heldout_prompts")} | {
        key: [first.get(key), last.get(key)] for key in keys
    }


def describe_before_after(change: dict) -> str:
    """'held-out loss 2.905 → 2.401, measured τ 3.10 → 3.62 on 8 prompts (step 0 → 190)': a `before_after`; one
    value each when the run was evaluated once."""

    def pair(name: str, values: list, digits: int) -> str | None:
        shown = [f"{v:.{digits}f}" for v in (values if change["steps"][0] != change["steps"][1] else values[:1])]
        return None if None in values else f"{name} {' → '.join(shown)}"

    parts = [pair("held-out loss", change["heldout_loss"], 3), pair("measured τ", change["tau"], 2)]
    steps = " → ".join(str(s) for s in dict.fromkeys(change["steps"]))
    prompts = f" on {change['prompts']} prompts" if change["prompts"] else ""
    return f"{', '.join(p for p in parts if p)}{prompts} (step {steps})"


def _prepare_jsonl(path: Path, resume_from_step: int | None) -> None:
    """A fresh run starts empty; a resumed one keeps the lines up to its checkpoint's step."""
    if not path.exists():
        return
    if resume_from_step is None:
        old = sum(1 for line in path.read_text().splitlines() if line.strip())
        if old:
            logger.warning("%s: a new run starts here; its %d lines from an earlier run are replaced", path, old)
        kept = []
    else:
        kept = [r for r in read_metrics(path) if r["step"] <= resume_from_step]
    atomic_write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
