"""`flashdraft eval`: a DFlash drafter against what users would pick instead, prompt by prompt: autoregressive
decoding, prompt lookup, and the target's own MTP layer.

    flashdraft eval --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --prompts prompts.jsonl \\
        --max-new-tokens 512 --json eval.json --plot eval.png
    flashdraft eval --target Qwen/Qwen3.5-4B --drafter D --prompts P --baselines ar,prompt_lookup,mtp \\
        --context-lengths 1024,8192,32768

Prompts file: JSON lines, each `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the tokenizer's
chat template, generation prompt added) or `{"prompt": "raw text"}`, with an optional `"category"`.
Every method decodes every prompt with the same settings in the same loop (`flashdraft.speculative.generate`).
The baselines are chosen by `--baselines` (default: autoregressive, prompt lookup, and the MTP layer when the
target checkpoint ships one — `flashdraft.target.mtp`; `--mtp-drafts` chained drafts per round, 3 by default as
SGLang documents for Qwen3.5). Reported: tau (mean tokens per verification round = mean acceptance length, bonus
token included), its p95, per-position acceptance rates, tokens/s, and speedups — overall and per category — and
the implied ceiling `tau x decode step / round`: the decode-phase speedup that the measured costs allow (AR's time
per decode step, DFlash's time per round, prompt processing excluded), beside the measured end-to-end speedup; and
the same figures for every method (`methods`, `mtp_tau`, `mtp_speedup`). On a CUDA target the engine
(`flashdraft.speculative.engine`: static caches, CUDA graphs) decodes every method; `--engine off` forces
transformers forwards (`flashdraft.speculative.generate`'s plain loop). At temperature 0 every method's output is
also compared with autoregressive decoding (`greedy_mismatches`: expected 0 in float32; bf16 kernels can flip
near-ties, because a verification and a one-token step round differently). `--context-lengths` decodes the prompts
again, each left-padded to each length with held-out text (`flashdraft.speculative.context`), and reports tau and
speedup per method per length. The report is printed and drawn by `flashdraft.speculative.report`.

Where the time goes (`flashdraft.speculative.prompt_stats`): `per_prompt` has a row per prompt and method (prompt
tokens, new tokens, prefill ms, first-round ms, steady round ms = the median of the rounds after the first, rounds,
tau, backend); `prefill_ms` is DFlash's mean time to the first token, `steady_speedup` its decode-phase tokens/s
(prefill excluded) over autoregressive decoding's, beside the end-to-end `speedup` (it is the implied ceiling
measured: tau x step / round is the same ratio); every method has the same figures under `methods`, with the mean
first round and the median over prompts of each one's steady round. `slow_prompts` names the prompts whose steady
round time is over twice the median of their method's prompts: such a prompt was decoded differently (graphs
captured again, the plain loop, a host synchronisation per token, a growing cache), which the totals hide (each
`context_lengths` entry has its own `per_prompt` and `slow_prompts`). A drafter with a confidence head (DSpark) adds
`confidence_calibration`: per draft position, its mean predicted acceptance over the rounds that reached the
position against the acceptance observed in them, and the predicted survival against the observed rate of accepting
every draft up to it. The baselines verify as many tokens per round as the drafter (a drafter whose anchor slot
drafts verifies one more), so that every method shares one engine and its graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flashdraft.drafter.families import family_of
from flashdraft.speculative.baselines import autoregressive_generate, mtp_generate, prompt_lookup_generate
from flashdraft.speculative.context import ContextFiller
from flashdraft.speculative.engine.session import prepare, verify_width
from flashdraft.speculative.generate import generate, use_engine
from flashdraft.speculative.prompt_stats import Calibration, prompt_row, slow_prompts
from flashdraft.speculative.prompts import Prompt
from flashdraft.speculative.proposer import validate_refine
from flashdraft.speculative.result import GenerationResult
from flashdraft.speculative.sampling import validate_verify
from flashdraft.speculative.tally import Tally
from flashdraft.target.mtp import MTPHead

# Every method, in the order of the report's rows; the first is the drafter under evaluation, the rest baselines.
METHODS = ("dflash", "mtp", "prompt_lookup", "autoregressive")
BASELINES = METHODS[1:]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _summary(tallies: dict[str, Tally], num_prompts: int) -> dict:
    """DFlash's figures (and the baselines' beside them) under the report's established keys, and every method's
    under `methods`; a baseline that did not run gives NaN (and no `mtp_*` keys)."""
    dflash, ar, lookup, mtp = (tallies.get(m, Tally()) for m in ("dflash", "autoregressive", "prompt_lookup", "mtp"))
    ran = [m for m in METHODS if m in tallies]
    summary = {
        "num_prompts": num_prompts,
        "tau": dflash.tau,
        "acceptance_length_mean": dflash.tau,
        "acceptance_length_p95": dflash.p95,
        "speedup": _ratio(dflash.tokens_per_second, ar.tokens_per_second),
        # Decode-phase tokens/s over AR's (prefill excluded; equal to the implied ceiling), mean time to first token.
        "steady_speedup": _ratio(dflash.decode_tokens_per_second, ar.decode_tokens_per_second),
        "prefill_ms": dflash.prefill_ms,
        "decode_step_ms": ar.round_ms,
        "round_ms": dflash.round_ms,
        # tau x step / round: what the per-round cost allows at this tau (prefill excluded).
        "implied_ceiling": dflash.tau * _ratio(ar.round_ms, dflash.round_ms),
        "speedup_vs_prompt_lookup": _ratio(dflash.tokens_per_second, lookup.tokens_per_second),
        "prompt_lookup_tau": lookup.tau,
        "prompt_lookup_speedup": _ratio(lookup.tokens_per_second, ar.tokens_per_second),
        "tokens_per_second": {m: tallies[m].tokens_per_second for m in ran},
        "tokens": {m: tallies[m].tokens for m in ran},
        "methods": {
            m: {
                "tau": tallies[m].tau,
                "acceptance_length_p95": tallies[m].p95,
                "tokens_per_second": tallies[m].tokens_per_second,
                "speedup": _ratio(tallies[m].tokens_per_second, ar.tokens_per_second),
                "round_ms": tallies[m].round_ms,
                "steady_speedup": _ratio(tallies[m].decode_tokens_per_second, ar.decode_tokens_per_second),
                "prefill_ms": tallies[m].prefill_ms,
                "first_round_ms": tallies[m].first_round_ms,
                "steady_round_ms": tallies[m].steady_round_ms,
                "per_position_acceptance": tallies[m].position_acceptance,
                "drafts_verified_per_round": tallies[m].drafts_verified,
            }
            for m in ran
        },
    }
    if "mtp" in tallies:
        summary["mtp_tau"] = mtp.tau
        summary["mtp_speedup"] = _ratio(mtp.tokens_per_second, ar.tokens_per_second)
        summary["speedup_vs_mtp"] = _ratio(dflash.tokens_per_second, mtp.tokens_per_second)
    return summary


@dataclass
class _Run:
    """The tallies of one set of prompts (the prompts as given, or padded to one context length)."""

    overall: dict[str, Tally]
    per_category: dict[str, dict[str, Tally]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    # Prompts whose greedy output differs from autoregressive decoding's, per method.
    mismatches: dict[str, int] = field(default_factory=dict)
    backends: set[str] = field(default_factory=set)
    # One row per prompt and method (`prompt_stats.prompt_row`); DFlash's confidence predictions.
    rows: list[dict] = field(default_factory=list)
    calibration: Calibration = field(default_factory=Calibration)


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
    baselines: tuple[str, ...] = ("autoregressive", "prompt_lookup"),
    mtp_head: MTPHead | None = None,
    mtp_drafts: int = 3,
    context_lengths: list[int] | None = None,
    context_filler: ContextFiller | None = None,
    refine: tuple[int, ...] = (),
    verify: str = "block",
    verify_length: str = "full",
) -> dict:
    """Decode every prompt with DFlash and each of `baselines` (some of `BASELINES`); return the report dict.

    engine: as in `flashdraft.speculative.generate` (None: the engine on a CUDA target it supports), for all methods.
    mtp_head: the target's MTP layer (`flashdraft.target.mtp.load_mtp`), for the "mtp" baseline, with `mtp_drafts`
    chained drafts per round. context_lengths: also decode every prompt left-padded to each of these lengths by
    `context_filler`. refine: the drafter drafts each block in passes (`flashdraft.speculative.generate`); when
    sampling, every method then decodes in the plain loop. verify: how every speculative method verifies sampled
    drafts (block or token, `flashdraft.speculative.sampling`). verify_length: how many of DFlash's drafts each
    round verifies (`flashdraft.speculative.generate`; confidence: every method decodes in the plain loop).
    """
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; expected some of {list(BASELINES)}")
    if "mtp" in baselines and mtp_head is None:
        raise ValueError("the mtp baseline needs mtp_head (flashdraft.target.mtp.load_mtp)")
    if context_lengths and context_filler is None:
        raise ValueError("context_lengths needs a context_filler (flashdraft.speculative.context.ContextFiller)")
    methods = tuple(m for m in METHODS if m == "dflash" or m in baselines)
    block_size = int(drafter.block_size if block_size is None else block_size)
    refine = validate_refine(refine, block_size)  # before the first decode
    validate_verify(verify)
    device = next(target.parameters()).device
    # Decided once: every method decodes on the same path.
    engine = use_engine(target, engine, drafter, refine, temperature, verify_length)
    # The baselines verify as wide a block as the drafter: one engine (and its graphs) serves every method.
    width = verify_width(block_size, drafter)

    def decode(method: str, input_ids: torch.Tensor, max_new: int, seed: int) -> GenerationResult:
        gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        common = dict(temperature=temperature, stop_token_ids=stop_token_ids, generator=gen, engine=engine)
        if method == "autoregressive":
            return autoregressive_generate(target, input_ids, max_new, **common)
        common["verify"] = verify
        if method == "dflash":
            return generate(
                target,
                drafter,
                input_ids,
                max_new,
                block_size=block_size,
                refine=refine,
                verify_length=verify_length,
                **common,
            )
        if method == "mtp":
            return mtp_generate(target, mtp_head, input_ids, max_new, num_drafts=mtp_drafts, block_size=width, **common)
        return prompt_lookup_generate(target, input_ids, max_new, block_size=width, **common)

    sets: list[tuple[int | None, list[Prompt]]] = [(None, prompts)]
    for length in context_lengths or ():
        sets.append((length, [context_filler.padded(p, length) for p in prompts]))
    if engine:
        # Caches sized for the longest prompt and graphs captured once, outside the timed runs.
        lengths = tuple(p.input_ids.shape[-1] for _, group in sets for p in group)
        sampling = (temperature, 1.0, 0)  # the settings `decode` runs with
        prepare(target, max(lengths) + max_new_tokens, block_size, drafter, prompt_lengths=lengths, sampling=sampling)
    # Warm-up (allocator, lazy imports, autotuned kernels) so that the first timed prompt is not penalised. A few
    # blocks' worth of tokens also reaches some of the wider verifications that deferred tokens make.
    for method in methods:
        decode(method, prompts[0].input_ids, min(4 * block_size, max_new_tokens), seed)

    with _ProgressBar(progress, sum(len(group) for _, group in sets) * len(methods)) as bar:
        runs = [_decode_all(decode, methods, group, max_new_tokens, seed, temperature, bar, n) for n, group in sets]

    main = runs[0]
    dflash = main.overall["dflash"]
    greedy_checked = temperature <= 0 and "autoregressive" in methods
    mismatches = {m: sum(run.mismatches[m] for run in runs) for m in methods if m != "autoregressive"}
    report = {
        **_summary(main.overall, len(prompts)),
        # The drafter's family names it in the report; its method key stays "dflash".
        "drafter_family": family_of(getattr(drafter, "config", None)),
        "per_prompt": main.rows,
        "slow_prompts": slow_prompts(main.rows),
        "per_position_acceptance": dflash.position_acceptance,
        "acceptance_length_histogram": {
            str(length): dflash.acceptance_lengths.count(length) for length in range(1, block_size + 1)
        },
        # (prompt, method) pairs, at every context length, whose greedy output differs from autoregressive decoding.
        "greedy_mismatches": sum(mismatches.values()) if greedy_checked else None,
        "greedy_mismatches_by_method": mismatches if greedy_checked else None,
        "backend": "/".join(sorted(set().union(*(run.backends for run in runs)))),
        "block_size": block_size,
        "refine": list(refine),
        "verify_length": verify_length,
        # Greedy rounds keep the drafts equal to the target's argmax: no verification rule applies.
        "verify": verify if temperature > 0 else None,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "methods_run": list(methods),
        "per_category": {c: _summary(t, main.counts[c]) for c, t in sorted(main.per_category.items())},
    }
    if "mtp" in methods:
        report["mtp_drafts"] = mtp_drafts
    if getattr(drafter, "confidence_head", None) is not None:
        report["confidence_calibration"] = main.calibration.table()
    if context_lengths:
        report["context_filler_tokens"] = min(context_filler.distinct_tokens(p.source) for p in prompts)
        report["context_lengths"] = [
            {
                "context_length": length,
                "prompt_tokens_mean": sum(p.input_ids.shape[-1] for p in group) / len(group),
                **_summary(run.overall, len(group)),
                "per_prompt": run.rows,
                "slow_prompts": slow_prompts(run.rows),
            }
            for (length, group), run in zip(sets[1:], runs[1:], strict=True)
        ]
    return report


def _decode_all(decode, methods, prompts: list[Prompt], max_new_tokens, seed, temperature, bar, length) -> _Run:
    """Every method over `prompts` (padded to `length`, or None), tallied overall and per category."""
    run = _Run({m: Tally() for m in methods}, mismatches=dict.fromkeys(methods, 0))
    where = "" if length is None else f", context {length}"
    for i, prompt in enumerate(prompts):
        outputs = {}
        for method in methods:
            bar.describe(f"prompt {i + 1}/{len(prompts)} ({prompt.category}{where}): {method}")
            result = decode(method, prompt.input_ids, max_new_tokens, seed + i)
            bar.advance()
            outputs[method] = result.tokens
            run.backends.add(result.backend)
            run.overall[method].add(result)
            run.per_category.setdefault(prompt.category, {m: Tally() for m in methods})[method].add(result)
            run.rows.append(prompt_row(i, prompt.category, method, result, length))
            if method == "dflash":
                run.calibration.add(result)
        run.counts[prompt.category] = run.counts.get(prompt.category, 0) + 1
        if temperature <= 0 and "autoregressive" in outputs:
            for method in methods:
                run.mismatches[method] += outputs[method] != outputs["autoregressive"]
    return run


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
