"""The training curve drawn from metrics.jsonl into a PNG, written atomically.

With evaluations (a run with held-out prompts: rows with `heldout_loss`, `heldout_sim_tau` and `tau`, step 0
among them), the curve shows what the run changed: the held-out loss (left axis) and the acceptance length τ on the
held-out set, simulated and measured by decoding (right axis), against the step, from step 0; its title says before
→ after ("held-out loss 2.905 → 2.401, measured τ 3.10 → 3.62 on 8 prompts (step 0 → 190)"). The loss of the
training batches is drawn faint behind: it swings with which continuations a batch holds. Without evaluations the
curve is the training batches' loss and simulated τ, a trend over them bold.

The PNG carries what it shows as text (PNG metadata, read with PIL's `Image.open(png).text`): "Title" (the title),
"flashdraft:series" (JSON: each plotted series as [[step, value], ...]) and, with evaluations,
"flashdraft:before_after" (JSON: {"steps", "prompts", "heldout_loss", "heldout_sim_tau", "tau"}, each a
[before, after] pair).

The curve needs matplotlib (`pip install 'flashdraft[plot]'`): `draw_training_curve` says in one line that it was
not drawn, and how to get it, where `plot_training_curve` raises.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from pathlib import Path

from flashdraft.io.atomic import atomic_write_bytes
from flashdraft.telemetry.metrics import before_after, describe_before_after, read_metrics

logger = logging.getLogger(__name__)

PLOT_EXTRA = "pip install 'flashdraft[plot]'"
SERIES = ("loss", "sim_tau", "heldout_loss", "heldout_sim_tau", "tau")
"""The metrics a curve may plot: the batches' loss and simulated τ; the held-out loss, simulated τ and measured τ."""


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


def draw_training_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """`plot_training_curve`, or None and one warning line saying how to get the curve when matplotlib is missing
    (the curve is an extra: the run itself succeeded)."""
    try:
        return plot_training_curve(metrics_jsonl, out_png)
    except ImportError:
        logger.warning(
            "training curve not drawn: matplotlib is not installed (%s to get it; every value is in %s)",
            PLOT_EXTRA,
            metrics_jsonl,
        )
        return None


def series_of(records: list[dict]) -> dict[str, list[list]]:
    """Each key of `SERIES` as [[step, value], ...] over the records that hold a finite value of it."""
    return {
        key: [[r["step"], r[key]] for r in records if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
        for key in SERIES
    }


def plot_training_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Draw the curve of a run's metrics.jsonl (the module docstring says which) into `out_png`; returns it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError(f"plot_training_curve needs matplotlib: {PLOT_EXTRA}") from None
    records = read_metrics(metrics_jsonl)
    series = series_of(records)
    if not any(series.values()):
        raise ValueError(f"{metrics_jsonl}: no logged step has a loss or τ to plot")
    # The Agg canvas directly, not pyplot: no global backend switch, no GUI, safe in threads.
    fig = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    tau_ax = ax.twinx()
    change = before_after(records)
    draw = _draw_evaluations if change else _draw_batches
    lines, title = draw(ax, tau_ax, series, change)
    steps = sorted({step for points in series.values() for step, _ in points})
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(steps) == 1:  # one point: matplotlib would pad the axis to fractional steps around it
        ax.set_xticks(steps)
    ax.set_ylabel("loss", color="tab:blue")
    ax.tick_params(axis="y", labelcolor="tab:blue")
    ax.grid(alpha=0.3)
    tau_ax.set_ylabel("acceptance length τ", color="tab:orange")
    tau_ax.tick_params(axis="y", labelcolor="tab:orange")
    # Below the axes: inside, it would cover one of the curves.
    fig.legend(lines, [line.get_label() for line in lines], loc="outside lower center", ncols=min(len(lines), 4))
    ax.set_title(title, fontsize=10)
    metadata = {"Title": title, "Software": "flashdraft", "flashdraft:series": json.dumps(series)}
    if change:
        metadata["flashdraft:before_after"] = json.dumps(change)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", metadata=metadata)
    atomic_write_bytes(out_png, png.getvalue())
    return out_png


def _xy(points: list[list]) -> tuple[list, list]:
    return [s for s, _ in points], [v for _, v in points]


def _draw_evaluations(ax, tau_ax, series: dict, change: dict) -> tuple[list, str]:
    """The held-out loss, its simulated τ and the measured τ at each evaluation, the batches' loss faint behind."""
    lines = []
    if series["loss"]:
        lines += ax.plot(*_xy(series["loss"]), color="tab:blue", alpha=0.3, linewidth=1, label="batch loss")
    for axis, key, color, style, label in (
        (ax, "heldout_loss", "tab:blue", "-o", "held-out loss"),
        (tau_ax, "heldout_sim_tau", "tab:orange", "-o", "held-out τ (simulated)"),
        (tau_ax, "tau", "tab:red", "--s", "measured τ (decoding)"),
    ):
        if series[key]:
            lines += axis.plot(*_xy(series[key]), style, color=color, linewidth=2, markersize=5, label=label)
    return lines, describe_before_after(change)


def _draw_batches(ax, tau_ax, series: dict, change: None) -> tuple[list, str]:
    """The training batches' loss and simulated τ: with 10 or more log windows, the values faint and a trend over
    them bold (`centered_mean` over 2 x `trend_reach` + 1 windows); the title says where the trend starts and ends."""
    loss, tau = _xy(series["loss"]), _xy(series["sim_tau"])
    marker = "o" if max(len(loss[1]), len(tau[1])) <= 40 else None
    reach = trend_reach(max(len(loss[1]), len(tau[1])))
    lines, summary = [], []
    for axis, (steps, values), color, name, digits in (
        (ax, loss, "tab:blue", "batch loss", 3),
        (tau_ax, tau, "tab:orange", "batch τ (simulated)", 2),
    ):
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
    if reach:
        ax.text(
            0.01,
            0.01,
            f"faint: each log window; bold: mean of {2 * reach + 1} windows",
            transform=ax.transAxes,
            fontsize=7,
            color="dimgray",
        )
    last = max(loss[0][-1:] + tau[0][-1:])
    return lines, f"Drafter training, {last} steps: {', '.join(summary)}"
