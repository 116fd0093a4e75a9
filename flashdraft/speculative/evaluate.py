"""`flashdraft eval`: a DFlash drafter against autoregressive and prompt-lookup decoding, prompt by prompt.

    flashdraft eval --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --prompts prompts.jsonl \\
        --max-new-tokens 512 --json eval.json --plot eval.png

Prompts file: JSON lines, each `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the tokenizer's
chat template, generation prompt added) or `{"prompt": "raw text"}`, with an optional `"category"`.
All three methods decode every prompt with the same settings in the same loop (`flashdraft.speculative.generate`).
Reported: tau (mean tokens per verification round = mean acceptance length, bonus token included), its p95,
per-position acceptance rates, tokens/s, and speedups — overall and per category — and the implied ceiling
`tau x decode step / round`: the decode-phase speedup that the measured costs allow (AR's time per decode step,
DFlash's time per round, prompt processing excluded), beside the measured end-to-end speedup. On a CUDA target
the engine (`flashdraft.speculative.engine`: static caches, CUDA graphs) decodes all three methods; `--engine off`
forces transformers forwards (`flashdraft.speculative.generate`'s plain loop). At temperature 0 the DFlash
output is also compared with autoregressive decoding (`greedy_mismatches`: expected 0 in float32; bf16 kernels
can flip near-ties, because a verification and a one-token step round differently).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashdraft.speculative.baselines import autoregressive_generate, prompt_lookup_generate
from flashdraft.speculative.engine.session import prepare
from flashdraft.speculative.generate import generate, use_engine
from flashdraft.speculative.prompts import Prompt
from flashdraft.speculative.result import GenerationResult

METHODS = ("dflash", "autoregressive", "prompt_lookup")


@dataclass
class Tally:
    """Sums of the statistics of many generations of one method."""

    tokens: int = 0
    seconds: float = 0.0
    # After the first token (prefill excluded): seconds and verification rounds (decode steps for AR).
    decode_seconds: float = 0.0
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    position_offered: list[int] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        self.tokens += len(result.tokens)
        self.seconds += result.total_time
        self.decode_seconds += result.total_time - result.time_to_first_token
        self.rounds += result.num_rounds
        self.acceptance_lengths += result.acceptance_lengths
        for name in ("position_accepted", "position_offered"):
            mine, theirs = getattr(self, name), getattr(result, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def round_ms(self) -> float:
        """Mean milliseconds per round (per decode step for autoregressive decoding)."""
        return 1e3 * self.decode_seconds / self.rounds if self.rounds else math.nan

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else math.nan

    @property
    def p95(self) -> float:
        if not self.acceptance_lengths:
            return math.nan
        return float(torch.quantile(torch.tensor(self.acceptance_lengths, dtype=torch.float64), 0.95))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _summary(tallies: dict[str, Tally], num_prompts: int) -> dict:
    dflash, ar, lookup = (tallies[m] for m in METHODS)
    return {
        "num_prompts": num_prompts,
        "tau": dflash.tau,
        "acceptance_length_mean": dflash.tau,
        "acceptance_length_p95": dflash.p95,
        "speedup": _ratio(dflash.tokens_per_second, ar.tokens_per_second),
        "decode_step_ms": ar.round_ms,
        "round_ms": dflash.round_ms,
        # tau x step / round: what the per-round cost allows at this tau (prefill excluded).
        "implied_ceiling": dflash.tau * _ratio(ar.round_ms, dflash.round_ms),
        "speedup_vs_prompt_lookup": _ratio(dflash.tokens_per_second, lookup.tokens_per_second),
        "prompt_lookup_tau": lookup.tau,
        "prompt_lookup_speedup": _ratio(lookup.tokens_per_second, ar.tokens_per_second),
        "tokens_per_second": {m: tallies[m].tokens_per_second for m in METHODS},
        "tokens": {m: tallies[m].tokens for m in METHODS},
    }


def evaluate(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    prompts: list[Prompt],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int = 0,
    progress: bool = True,
    engine: bool | None = None,
) -> dict:
    """Decode every prompt with DFlash, autoregressive and prompt-lookup decoding; return the report dict.

    engine: as in `flashdraft.speculative.generate` (None: the engine on a CUDA target it supports), for all methods.
    """
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    block_size = int(drafter.block_size if block_size is None else block_size)
    device = next(target.parameters()).device
    engine = use_engine(target, engine, drafter)  # decided once: every method decodes on the same path

    def decode(method: str, prompt: Prompt, max_new: int, seed: int) -> GenerationResult:
        gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        common = dict(temperature=temperature, stop_token_ids=stop_token_ids, generator=gen, engine=engine)
        if method == "dflash":
            return generate(target, drafter, prompt.input_ids, max_new, block_size=block_size, **common)
        if method == "autoregressive":
            return autoregressive_generate(target, prompt.input_ids, max_new, **common)
        return prompt_lookup_generate(target, prompt.input_ids, max_new, block_size=block_size, **common)

    if engine:
        # Caches sized for the longest prompt and graphs captured once, outside the timed runs.
        prepare(target, max(p.input_ids.shape[-1] for p in prompts) + max_new_tokens, block_size, drafter)
    # Warm-up (allocator, lazy imports, autotuned kernels) so that the first timed prompt is not penalised. A few
    # blocks' worth of tokens also reaches some of the wider verifications that deferred tokens make.
    for method in METHODS:
        decode(method, prompts[0], min(4 * block_size, max_new_tokens), seed)

    overall = {m: Tally() for m in METHODS}
    per_category: dict[str, dict[str, Tally]] = {}
    counts: dict[str, int] = {}
    mismatches = 0
    backends: set[str] = set()
    with _ProgressBar(progress, len(prompts) * len(METHODS)) as bar:
        for i, prompt in enumerate(prompts):
            outputs = {}
            for method in METHODS:
                bar.describe(f"prompt {i + 1}/{len(prompts)} ({prompt.category}): {method}")
                result = decode(method, prompt, max_new_tokens, seed + i)
                bar.advance()
                outputs[method] = result.tokens
                backends.add(result.backend)
                overall[method].add(result)
                per_category.setdefault(prompt.category, {m: Tally() for m in METHODS})[method].add(result)
            counts[prompt.category] = counts.get(prompt.category, 0) + 1
            if temperature <= 0 and outputs["dflash"] != outputs["autoregressive"]:
                mismatches += 1

    dflash = overall["dflash"]
    report = {
        **_summary(overall, len(prompts)),
        "per_position_acceptance": [
            a / o if o else math.nan for a, o in zip(dflash.position_accepted, dflash.position_offered, strict=True)
        ],
        "acceptance_length_histogram": {
            str(length): dflash.acceptance_lengths.count(length) for length in range(1, block_size + 1)
        },
        "greedy_mismatches": mismatches if temperature <= 0 else None,
        "backend": "/".join(sorted(backends)),
        "block_size": block_size,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "per_category": {c: _summary(t, counts[c]) for c, t in sorted(per_category.items())},
    }
    return report


class _ProgressBar:
    """A rich progress bar on stderr, or nothing when disabled."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self.bar = Progress(*columns, console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("decoding", total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False

    def describe(self, description: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=description)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)


def _fmt(value: float, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def print_report(report: dict, console=None) -> None:
    """The table, overall and per category (PL: prompt lookup; x AR, x PL: DFlash speedup over them)."""
    from rich.console import Console
    from rich.table import Table

    # Written to a file or a pipe, rich would assume 80 columns and cut the numbers to "3.…": 11 columns need ~120.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    table = Table(title=f"DFlash, block {report['block_size']}, temperature {report['temperature']}")
    columns = ("set", "n", "tau", "p95", "DFlash tok/s", "AR tok/s", "PL tok/s", "PL tau", "x AR", "ceiling", "x PL")
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
            _fmt(tps["autoregressive"], 1),
            _fmt(tps["prompt_lookup"], 1),
            _fmt(s["prompt_lookup_tau"]),
            _fmt(s["speedup"], 2, "x"),
            _fmt(s["implied_ceiling"], 2, "x"),
            _fmt(s["speedup_vs_prompt_lookup"], 2, "x"),
        )
    console.print(table)
    rates = " ".join(_fmt(r, 2) for r in report["per_position_acceptance"])
    console.print(f"per-position acceptance (draft 1..{report['block_size'] - 1}): {rates}")
    console.print(
        f"decode step {_fmt(report['decode_step_ms'])} ms (AR), DFlash round {_fmt(report['round_ms'])} ms "
        f"({report.get('backend', '?')}): implied ceiling tau x step / round = {_fmt(report['implied_ceiling'])}x, "
        f"measured speedup {_fmt(report['speedup'])}x (prompt processing included)"
    )
    if report["greedy_mismatches"]:
        console.print(
            f"[yellow]warning: {report['greedy_mismatches']} prompt(s) decoded differently by DFlash and "
            "autoregressive greedy decoding (expected only from low-precision near-ties)[/yellow]"
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
    """A PNG with the acceptance-length histogram and the per-position acceptance rate."""
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    hist = report["acceptance_length_histogram"]
    left.bar([int(k) for k in hist], list(hist.values()), color="tab:blue")
    left.set(
        xlabel="tokens per verification (acceptance length)",
        ylabel="rounds",
        title=f"acceptance length, tau = {_fmt(report['tau'])}",
    )
    rates = report["per_position_acceptance"]
    right.plot(range(1, len(rates) + 1), rates, marker="o", color="tab:orange")
    right.set(
        xlabel="draft position in block", ylabel="acceptance rate", ylim=(0, 1.05), title="per-position acceptance"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
