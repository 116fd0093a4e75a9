"""Training metrics: a console line and a JSON line per log step, a progress bar, optional trackers, the curve.

    metrics = MetricsLogger(out, total_steps=600, trackers=cfg.log.trackers, config=to_dict(cfg),
                            resume_from_step=start if resume else None, enabled=rank == 0)
    with metrics.progress():
        metrics.advance(start)                     # a resumed run jumps to its start step (no fake speed)
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

The console line knows these keys (all optional; None is skipped): loss, sim_tau, acc (per-position accuracy,
acc@1 shown), tok_s, draft_tok_s, mfu (a fraction; None is shown as "MFU –", unknown), mem_gib, grad_norm, lr. Every
key goes to the JSON line. The line is printed whole, never wrapped at the console's width, so a log file or a pipe
holds one line per log step; the progress bar is drawn only on a terminal.

Trackers, each used only when named in `log.trackers`: "wandb" (project $WANDB_PROJECT or "flashdraft"; wandb
itself reads WANDB_MODE, WANDB_DIR, ...), "tensorboard" (SummaryWriter in OUT/tb), "trackio" (project
$TRACKIO_PROJECT or "flashdraft"). They receive the run config through `redact`, never environment values. A named
tracker that is not installed is a config error (`check_trackers`, before anything loads): whoever names one wants
that run's dashboard, and a run of hours that quietly went without it is found out only when it is too late. One
that is installed but fails to start or to log (no login, no network) is dropped with a warning; training goes on.

The curve needs matplotlib (`pip install 'flashdraft[plot]'`): `draw_training_curve` says in one line that it was
not drawn, and how to get it, where `plot_training_curve` raises.
"""

from __future__ import annotations

import contextlib
import importlib.util
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

logger = logging.getLogger(__name__)

TRACKERS = ("wandb", "tensorboard", "trackio")
REDACTED = "<redacted>"
PLOT_EXTRA = "pip install 'flashdraft[plot]'"


def check_trackers(names: list[str] | tuple[str, ...], installed: bool = True) -> None:
    """Raise ValueError naming `log.trackers` for a tracker that is unknown or (`installed`) not installed."""
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"log.trackers: unknown tracker {unknown[0]!r}; valid: {', '.join(TRACKERS)}")
    for name in names if installed else ():
        package = _TRACKER_CLASSES[name][1]
        if not _installed(package):
            raise ValueError(f"log.trackers: {name!r} is not installed: pip install {package} (or remove {name!r} "
                             "from log.trackers)")  # fmt: skip


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return False


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
        self._trackers: list[_Tracker] = []
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
            tracker = _open_tracker(name, self.out, safe_config, resume_from_step)
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
        self.console.print(format_line(step, values, total_steps=self.total_steps), markup=False, highlight=False,
                           soft_wrap=True)  # fmt: skip
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
        """A progress bar over `total_steps` showing the latest loss, sim_tau and tok/s; move it with `advance`.
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


def format_line(step: int, metrics: Mapping[str, Any], total_steps: int | None = None) -> str:
    """'step 120/600 | loss 3.214 | sim_tau 1.83 | acc@1 0.41 | 12.3K tok/s | ... | lr 5.8e-4' (known keys only)."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]

    def get(key):
        value = metrics.get(key)
        return None if value is None or isinstance(value, bool) else value

    if (loss := get("loss")) is not None:
        parts.append(f"loss {loss:.3f}")
    if (tau := get("sim_tau")) is not None:
        parts.append(f"sim_tau {tau:.2f}")
    if (real := get("tau")) is not None:
        parts.append(f"τ {real:.2f} (measured)")
    acc = get("acc")
    if isinstance(acc, list | tuple) and acc and acc[0] is not None:
        parts.append(f"acc@1 {acc[0]:.2f}")
    if (tok_s := get("tok_s")) is not None:
        parts.append(f"{_si(tok_s)} tok/s")
    if (draft := get("draft_tok_s")) is not None:
        parts.append(f"{_si(draft)} draft tok/s")
    if (mfu := get("mfu")) is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    elif "mfu" in metrics:
        parts.append("MFU –")  # a GPU whose peak rate is unknown
    if (mem := get("mem_gib")) is not None:
        parts.append(f"mem {mem:.1f} GiB")
    if (gnorm := get("grad_norm")) is not None:
        parts.append(f"gnorm {gnorm:.2f}")
    if (lr := get("lr")) is not None:
        parts.append(f"lr {_short_exp(lr)}")
    return " | ".join(parts)


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
        parts.append(f"loss {values['loss']:.3f}")
    if values.get("sim_tau") is not None:
        parts.append(f"sim_tau {values['sim_tau']:.2f}")
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
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- secrets ----------------------------------------------------------------------------------------------------

# Word sequences that make a key secret wherever they appear in it, and last words that do at the end
# (hf_token, wandb_api_key) but not in the middle (mask_token_id, linear_key_head_dim) or plural (max_tokens).
_SECRET_WORDS = ("secret", "password", "passwd", "credential", "credentials", "api_key", "apikey", "access_key",
                 "private_key", "auth_token")  # fmt: skip
_SECRET_LAST_WORDS = ("key", "token")
# Tokenizer special tokens are strings like "<|im_end|>", not credentials.
_NOT_SECRET = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token")
_URL_PASSWORD = re.compile(r"(://[^/@:\s]+):[^/@\s]+@")


def is_secret_key(key: str) -> bool:
    """Whether a config key names a credential, by whole words: aws_secret_access_key, WANDB_API_KEY, hfToken."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower()
    words = [w for w in re.split(r"[^a-z0-9]+", words) if w]
    if not words:
        return False
    joined = "_" + "_".join(words) + "_"
    if joined.strip("_") in _NOT_SECRET:
        return False
    return words[-1] in _SECRET_LAST_WORDS or any(f"_{w}_" in joined for w in _SECRET_WORDS)


def redact(config: Any) -> Any:
    """A copy of `config` with credential-named keys (see `is_secret_key`) and passwords in URLs replaced."""
    if isinstance(config, Mapping):
        return {
            key: (REDACTED if value is not None else None) if is_secret_key(key) else redact(value)
            for key, value in config.items()
        }
    if isinstance(config, list | tuple):
        return [redact(v) for v in config]
    if isinstance(config, str):
        return _URL_PASSWORD.sub(rf"\1:{REDACTED}@", config)
    return config


# ---- trackers ---------------------------------------------------------------------------------------------------


class _Tracker:
    name = ""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _TensorBoard(_Tracker):
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


class _Wandb(_Tracker):
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


class _Trackio(_Tracker):
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


def _open_tracker(name: str, out: Path, config: dict, resume_from_step: int | None) -> _Tracker | None:
    cls, _ = _TRACKER_CLASSES[name]
    try:
        return cls(out, config, resume_from_step)
    except Exception as exc:
        logger.warning(
            "tracker %r did not start (%s: %s); training continues without it", name, type(exc).__name__, exc
        )
        return None


# ---- plot -------------------------------------------------------------------------------------------------------


def trend_reach(points: int) -> int:
    """How many log windows on each side a curve's trend averages over: a twentieth of the run, at least 2 (a short
    run's windows differ the most); 0 (no trend) below 10 points."""
    return max(2, points // 20) if points >= 10 else 0


def centered_mean(values: list[float], reach: int) -> list[float]:
    """At each point, the mean of the values up to `reach` points before and after it (fewer at the ends): a trend
    that does not lag behind the curve as a trailing mean would."""
    return [
        sum(values[max(0, i - reach) : i + reach + 1]) / len(values[max(0, i - reach) : i + reach + 1])
        for i in range(len(values))
    ]


def draw_training_curve(
    metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, final_tau: float | None = None
) -> Path | None:
    """`plot_training_curve`, or None and one warning line saying how to get the curve when matplotlib is missing
    (the curve is an extra: the run itself succeeded)."""
    try:
        return plot_training_curve(metrics_jsonl, out_png, final_tau)
    except ImportError:
        logger.warning("training curve not drawn: matplotlib is not installed (%s to get it; every value is in %s)",
                       PLOT_EXTRA, metrics_jsonl)  # fmt: skip
        return None


def plot_training_curve(
    metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, final_tau: float | None = None
) -> Path:
    """Loss (left axis) and simulated tau (right axis) against step, with the measured tau of the periodic
    evaluations and `final_tau` (the end-of-run measurement) at the last step; returns the PNG.

    Each logged value is a mean over one log window, and windows differ in what they read (an easy stretch of data,
    a hard one): with 10 or more of them, the values are drawn faint and a trend over them bold (`centered_mean`
    over 2 x `trend_reach` + 1 windows), and the title says where the trend starts and ends.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError(f"plot_training_curve needs matplotlib: {PLOT_EXTRA}") from None
    records = read_metrics(metrics_jsonl)

    def series(key):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        return [s for s, _ in points], [v for _, v in points]

    loss_steps, loss = series("loss")
    tau_steps, tau = series("sim_tau")
    real_steps, real = series("tau")
    if final_tau is not None and math.isfinite(final_tau) and (loss_steps or tau_steps):
        real_steps, real = real_steps + [max(loss_steps[-1:] + tau_steps[-1:])], real + [final_tau]
    if not loss and not tau:
        raise ValueError(f"{metrics_jsonl}: no logged step has a loss or sim_tau to plot")
    # The Agg canvas directly, not pyplot: no global backend switch, no GUI, safe in threads.
    fig = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    tau_ax = ax.twinx()
    marker = "o" if max(len(loss), len(tau)) <= 40 else None
    reach = trend_reach(max(len(loss), len(tau)))
    lines, summary = [], []
    curves = ((ax, loss_steps, loss, "tab:blue", "loss", 3), (tau_ax, tau_steps, tau, "tab:orange", "simulated tau", 2))
    for axis, steps, values, color, name, digits in curves:
        if not values:
            continue
        if not reach:
            lines += axis.plot(steps, values, color=color, marker=marker, markersize=4, label=name)
            summary.append(f"{name} {values[-1]:.{digits}f}")
            continue
        axis.plot(steps, values, color=color, alpha=0.35, linewidth=1, marker=marker, markersize=2.5)
        smooth = centered_mean(values, reach)
        lines += axis.plot(steps, smooth, color=color, linewidth=2.2, label=name)
        summary.append(f"{name} {smooth[0]:.{digits}f} → {smooth[-1]:.{digits}f}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(set(loss_steps + tau_steps)) == 1:
        # One point: matplotlib would pad the axis to fractional steps around it.
        ax.set_xticks(loss_steps[:1] or tau_steps[:1])
    ax.set_ylabel("loss", color="tab:blue")
    ax.tick_params(axis="y", labelcolor="tab:blue")
    ax.grid(alpha=0.3)
    if real:
        lines += tau_ax.plot(real_steps, real, color="tab:red", marker="s", markersize=5, linestyle="--",
                             label="measured tau (decoding)")  # fmt: skip
    tau_ax.set_ylabel("acceptance length (tau)", color="tab:orange")
    tau_ax.tick_params(axis="y", labelcolor="tab:orange")
    # Below the axes: inside, it would cover one of the two curves.
    fig.legend(lines, [line.get_label() for line in lines], loc="outside lower center", ncols=len(lines))
    if reach:
        ax.text(0.01, 0.01, f"faint: each log window; bold: mean of {2 * reach + 1} windows", transform=ax.transAxes,
                fontsize=7, color="dimgray")  # fmt: skip
    if final_tau is not None and math.isfinite(final_tau):
        summary.append(f"measured tau {final_tau:.2f}")
    last = max(loss_steps[-1:] + tau_steps[-1:])
    ax.set_title(f"Drafter training, {last} steps: {', '.join(summary)}", fontsize=10)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f".{out_png.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out_png)
    return out_png
