"""The report of `flashdraft eval` (`flashdraft.speculative.evaluate.evaluate`'s dict) as tables and as a plot.

    print_report(report)              # the drafter overall and per category; every method side by side; context lengths
    write_plot(report, "eval.png")    # the drafter's acceptance lengths, every method's acceptance by position and tau

The drafter is named by its family (DFlash, DSpark, DFlash2; its method key stays "dflash"). Columns: PL is prompt
lookup, AR autoregressive decoding, `x AR` / `x PL` the drafter's end-to-end speedup over them, `ceiling` tau x AR's
decode step / the drafter's round; in the table of every method, the speedup is each method's over
autoregressive decoding. Then where the time goes, per method: the mean prefill (time to the first token) and first
round, the median steady round (per prompt, the median of its rounds after the first), and the steady-state speedup
(decode phase, prefill excluded: the measured ceiling) beside the end-to-end one; a warning names the prompts whose
steady rounds were over twice their method's median (with what may cause it). A drafter with a confidence head
(DSpark) gets a table of its calibration: predicted against observed acceptance per draft position.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from flashdraft.drafter.families import FAMILIES

# The baselines' names; the drafter ("dflash") is named by its family (`_drafter`).
LABELS = {"mtp": "MTP", "prompt_lookup": "prompt lookup", "autoregressive": "autoregressive"}
# One colour per method in every panel of the plot.
COLORS = {"dflash": "tab:blue", "mtp": "tab:green", "prompt_lookup": "tab:orange", "autoregressive": "tab:gray"}


def _fmt(value: float, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def _drafter(report: dict) -> str:
    """The drafter's family as reports name it (reports written before the family was recorded: DFlash)."""
    return FAMILIES[report.get("drafter_family", "dflash")].title


def _label(report: dict, method: str) -> str:
    if method == "dflash":
        return _drafter(report)
    return LABELS[method] + (f" ({report['mtp_drafts']} drafts)" if method == "mtp" else "")


def print_report(report: dict, console=None) -> None:
    """The tables (see the module docstring) and, when some greedy output differed from autoregressive decoding's,
    a warning naming the methods."""
    from rich.console import Console
    from rich.table import Table

    # Written to a file or a pipe, rich would assume 80 columns and cut the numbers to "3.…": 11 columns need ~120.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    drafter = _drafter(report)
    title = f"{drafter}, block {report['block_size']}, temperature {report['temperature']}"
    if report.get("refine"):
        title += f", {len(report['refine']) + 1} passes"
    if report.get("verify"):
        title += f", {report['verify']} verification"
    if report.get("verify_length", "full") != "full":
        title += f", drafts verified by {report['verify_length']}"
    table = Table(title=title)
    speeds = (f"{drafter} tok/s", "AR tok/s", "PL tok/s", "PL tau", "x AR", "ceiling", "x PL")
    columns = ("set", "n", "tau", "p95", *speeds)
    for column in columns:
        table.add_column(column, justify="left" if column == "set" else "right", no_wrap=column == "set")
    rows = [("overall", report)] + list(report["per_category"].items())
    for name, s in rows:
        tps = s["tokens_per_second"]
        table.add_row(
            name,
            str(s["num_prompts"]),
            _fmt(s["tau"]),
            _fmt(s["acceptance_length_p95"], 1),
            _fmt(tps["dflash"], 1),
            _fmt(tps.get("autoregressive", math.nan), 1),
            _fmt(tps.get("prompt_lookup", math.nan), 1),
            _fmt(s["prompt_lookup_tau"]),
            _fmt(s["speedup"], 2, "x"),
            _fmt(s["implied_ceiling"], 2, "x"),
            _fmt(s["speedup_vs_prompt_lookup"], 2, "x"),
        )
    console.print(table)
    rates = " ".join(_fmt(r, 2) for r in report["per_position_acceptance"])
    # A DSpark drafter whose anchor slot drafts too offers block_size drafts, others block_size - 1.
    console.print(f"per-position acceptance (draft 1..{len(report['per_position_acceptance'])}): {rates}")
    if report.get("verify_length", "full") != "full":
        verified = report["methods"]["dflash"]["drafts_verified_per_round"]
        console.print(f"drafts verified per round: {_fmt(verified)} of {len(report['per_position_acceptance'])}")
    console.print(
        f"decode step {_fmt(report['decode_step_ms'])} ms (AR), {drafter} round {_fmt(report['round_ms'])} ms "
        f"({report.get('backend', '?')}): implied ceiling tau x step / round = {_fmt(report['implied_ceiling'])}x, "
        f"measured speedup {_fmt(report['speedup'])}x (prompt processing included)"
    )
    console.print(
        f"{drafter}: prefill {_fmt(report.get('prefill_ms'))} ms per prompt, steady-state speedup "
        f"{_fmt(report.get('steady_speedup'))}x (decode phase, prefill excluded: the ceiling), end-to-end speedup "
        f"{_fmt(report['speedup'])}x"
    )
    _print_methods(report, console)
    if "per_prompt" in report:
        _print_timing(report, console)
    if report.get("confidence_calibration"):
        _print_calibration(report, console)
    if report.get("context_lengths"):
        _print_context_lengths(report, console)
    _warn_slow_prompts(report, console)
    if report["greedy_mismatches"]:
        which = ", ".join(f"{_label(report, m)} {n}" for m, n in report["greedy_mismatches_by_method"].items() if n)
        console.print(
            f"[yellow]warning: prompts decoded differently from autoregressive greedy decoding: {which} (expected "
            "only from low-precision near-ties)[/yellow]"
        )


def _print_methods(report: dict, console) -> None:
    """Every method on the same prompts: tau, tokens/s, speedup over autoregressive decoding, acceptance by position."""
    from rich.table import Table

    table = Table(title="every method on the same prompts (speedup: over autoregressive decoding)")
    for column in ("method", "tau", "p95", "tok/s", "speedup", "ms / round", "acceptance by draft position"):
        table.add_column(column, justify="left" if column in ("method", "acceptance by draft position") else "right")
    for method, s in report["methods"].items():
        rates = s["per_position_acceptance"]
        shown = " ".join(_fmt(r, 2) for r in rates[:8]) + (" …" if len(rates) > 8 else "")
        table.add_row(
            _label(report, method),
            _fmt(s["tau"]),
            _fmt(s["acceptance_length_p95"], 1),
            _fmt(s["tokens_per_second"], 1),
            _fmt(s["speedup"], 2, "x"),
            _fmt(s["round_ms"]),
            shown,
        )
    console.print(table)


def _print_timing(report: dict, console) -> None:
    """Per method: mean prefill and first round, median steady round, the mean round, and the speedups."""
    from rich.table import Table

    table = Table(title="where the time goes (per prompt: mean prefill and first round, median steady round)")
    columns = ("method", "prefill ms", "first round ms", "steady ms / round", "ms / round", "steady x AR", "speedup")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for method, s in report["methods"].items():
        table.add_row(
            _label(report, method),
            _fmt(s.get("prefill_ms")),
            _fmt(s.get("first_round_ms")),
            _fmt(s.get("steady_round_ms")),
            _fmt(s["round_ms"]),
            _fmt(s.get("steady_speedup"), 2, "x"),
            _fmt(s["speedup"], 2, "x"),
        )
    console.print(table)


SLOW_SHOWN = 8  # slow prompts named in the warning


def _warn_slow_prompts(report: dict, console) -> None:
    """A warning naming each prompt whose steady rounds were over twice its method's median, with a hint why."""
    from rich.text import Text

    from flashdraft.speculative.prompt_stats import SLOW_FACTOR, SLOW_HINT

    slow = [(None, row) for row in report.get("slow_prompts") or ()]
    for entry in report.get("context_lengths") or ():
        slow += [(entry["context_length"], row) for row in entry.get("slow_prompts") or ()]
    if not slow:
        return
    slow.sort(key=lambda entry: -entry[1]["times_median"])  # the slowest first; a loaded machine flags many
    shown, rest = slow[:SLOW_SHOWN], len(slow) - SLOW_SHOWN
    lines = [
        f"  {_label(report, r['method'])}, prompt {r['prompt'] + 1} ({r['category']}, {r['prompt_tokens']} tokens"
        + ("" if length is None else f", context {length}")
        + f", {r['backend']}): steady round {_fmt(r['steady_round_ms'])} ms, {_fmt(r['times_median'], 1)}x the "
        f"median {_fmt(r['median_steady_round_ms'])} ms; prefill {_fmt(r['prefill_ms'])} ms, first round "
        f"{_fmt(r['first_round_ms'])} ms"
        for length, r in shown
    ]
    if rest > 0:
        lines.append(f"  ... and {rest} more (the JSON report's slow_prompts lists them all)")
    head = f"warning: {len(slow)} prompt(s) with steady rounds over {SLOW_FACTOR:g}x their method's median:"
    # As plain text: a category is the user's, and brackets in it must not read as markup.
    console.print(Text("\n".join([head, *lines, f"  hint: {SLOW_HINT}"]), style="yellow"))


def _print_calibration(report: dict, console) -> None:
    """The confidence head's predicted acceptance per draft position against the observed."""
    from rich.table import Table

    table = Table(title="confidence head: predicted against observed acceptance, by draft position")
    columns = ("draft", "predicted c", "observed", "rounds reached", "predicted survival", "observed survival")
    for column in columns:
        table.add_column(column, justify="right")
    for row in report["confidence_calibration"]:
        table.add_row(
            str(row["position"]),
            _fmt(row["predicted"], 3),
            _fmt(row["observed"], 3),
            str(row["rounds"]),
            _fmt(row["predicted_survival"], 3),
            _fmt(row["observed_survival"], 3),
        )
    console.print(table)
    console.print(
        "predicted c: mean c_k over the rounds in which every earlier draft was accepted; observed: the fraction "
        "of them that accepted draft k. Survival: prod c_j (j <= k) against the fraction of rounds accepting drafts "
        "1 .. k."
    )


def _print_context_lengths(report: dict, console) -> None:
    from rich.table import Table

    table = Table(title="tau and speedup by context length (prompts left-padded with held-out text)")
    table.add_column("context", justify="right")
    table.add_column("prompt tokens", justify="right")
    methods = [m for m in report["methods_run"] if m != "autoregressive"]
    for method in methods:
        table.add_column(f"{_label(report, method)} tau", justify="right")
        table.add_column(f"{_label(report, method)} x AR", justify="right")
    for row in report["context_lengths"]:
        cells = [str(row["context_length"]), _fmt(row["prompt_tokens_mean"], 0)]
        for method in methods:
            s = row["methods"][method]
            cells += [_fmt(s["tau"]), _fmt(s["speedup"], 2, "x")]
        table.add_row(*cells)
    console.print(table)
    longest = max(row["context_length"] for row in report["context_lengths"])
    if longest > report["context_filler_tokens"]:
        console.print(
            f"note: the held-out text has {report['context_filler_tokens']} tokens; longer paddings repeat it, which "
            "favours prompt lookup"
        )


def require_matplotlib():
    """pyplot, or a ValueError (exit 2, before the models load) saying how to get it: --plot is a request, and a run
    that quietly left out the file asked for would surface only where something reads it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'flashdraft[plot]', or leave out --plot") from None
    return plt


def write_plot(report: dict, path: str | Path) -> None:
    """A PNG of three panels: DFlash's acceptance-length histogram; every speculative method's acceptance by draft
    position; tau per method, its bar labelled with the speedup over autoregressive decoding (with a context-length
    sweep: tau per method by context length)."""
    plt = require_matplotlib()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    hist = report["acceptance_length_histogram"]
    left.bar([int(k) for k in hist], list(hist.values()), color=COLORS["dflash"])
    left.set(
        xlabel="tokens per verification (acceptance length)",
        ylabel="rounds",
        title=f"{_drafter(report)} acceptance length, tau = {_fmt(report['tau'])}",
    )
    speculative = [m for m in report["methods"] if m != "autoregressive"]
    for method in speculative:
        rates = report["methods"][method]["per_position_acceptance"]
        middle.plot(range(1, len(rates) + 1), rates, marker="o", color=COLORS[method], label=_label(report, method))
    middle.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="acceptance by draft position")
    middle.legend()
    if report.get("context_lengths"):
        lengths = [row["context_length"] for row in report["context_lengths"]]
        for method in speculative:
            taus = [row["methods"][method]["tau"] for row in report["context_lengths"]]
            right.plot(lengths, taus, marker="o", color=COLORS[method], label=_label(report, method))
        right.set(xscale="log", xlabel="context length (tokens)", ylabel="tau", title="tau by context length")
        right.set_xticks(lengths, [str(n) for n in lengths])
        right.minorticks_off()
        right.legend()
    else:
        methods = list(report["methods"])
        taus = [report["methods"][m]["tau"] for m in methods]
        bars = right.bar([_label(report, m) for m in methods], taus, color=[COLORS[m] for m in methods])
        right.bar_label(bars, labels=[_fmt(report["methods"][m]["speedup"], 2, "x") for m in methods])
        right.margins(y=0.12)  # room for the labels above the tallest bar
        right.set(ylabel="tau (bar labels: speedup over AR)", title="tau per method")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
