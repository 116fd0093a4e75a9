"""The training curve (loss and τ over steps) drawn from metrics.jsonl into a PNG, written atomically.

The curve needs matplotlib (`pip install 'flashdraft[plot]'`): `draw_training_curve` says in one line that it was
not drawn, and how to get it, where `plot_training_curve` raises.
"""

from __future__ import annotations

import io
import logging
import math
import os
from pathlib import Path

from flashdraft.io.atomic import atomic_write_bytes
from flashdraft.telemetry.metrics import read_metrics

logger = logging.getLogger(__name__)

PLOT_EXTRA = "pip install 'flashdraft[plot]'"


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
        logger.warning(
            "training curve not drawn: matplotlib is not installed (%s to get it; every value is in %s)",
            PLOT_EXTRA,
            metrics_jsonl,
        )
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
        lines += tau_ax.plot(
            real_steps, real, color="tab:red", marker="s", markersize=5, linestyle="--", label="measured tau (decoding)"
        )
    tau_ax.set_ylabel("acceptance length (tau)", color="tab:orange")
    tau_ax.tick_params(axis="y", labelcolor="tab:orange")
    # Below the axes: inside, it would cover one of the two curves.
    fig.legend(lines, [line.get_label() for line in lines], loc="outside lower center", ncols=len(lines))
    if reach:
        ax.text(
            0.01,
            0.01,
            f"faint: each log window; bold: mean of {2 * reach + 1} windows",
            transform=ax.transAxes,
            fontsize=7,
            color="dimgray",
        )
    if final_tau is not None and math.isfinite(final_tau):
        summary.append(f"measured tau {final_tau:.2f}")
    last = max(loss_steps[-1:] + tau_steps[-1:])
    ax.set_title(f"Drafter training, {last} steps: {', '.join(summary)}", fontsize=10)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    atomic_write_bytes(out_png, png.getvalue())
    return out_png
