"""The config sections of the commands besides `train`: eval, regenerate, prepare, export, doctor, bench.

Each command reads the sections it needs from the one config (a YAML file and dotted overrides, like train): `eval`
the target's section for the target, `prepare` the data section for what to tokenise and how, `bench train-step`
the whole run. Its own section holds what only that command decides. Every field is documented by the docstring
under it (`flashdraft COMMAND --help-config` lists them); the command-line shortcuts (`--max-new-tokens`, ...) are
generated from these fields (flashdraft/cli/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# eval.baselines: the names a user may write -> the methods of flashdraft.speculative.evaluate.
BASELINES = {
    "ar": "autoregressive",
    "autoregressive": "autoregressive",
    "pl": "prompt_lookup",
    "prompt_lookup": "prompt_lookup",
    "mtp": "mtp",
}
DEVICES = ("auto", "cpu", "cuda")
COMMAND_CHOICES: dict[str, tuple[str, ...]] = {
    "eval.device": DEVICES,
    "eval.verify": ("block", "token"),
    "eval.verify_length": ("full", "confidence"),
    "regenerate.device": DEVICES,
    "regenerate.backend": ("auto", "hf", "vllm", "sglang"),
    "export.layout": ("auto", "reference", "deepspec", "speculators"),
}


@dataclass(kw_only=True)
class EvalCommand:
    """`flashdraft eval`; the target is target.path (its dtype target.dtype), the prompts data.eval_prompts."""

    drafter: str | None = None
    """The drafter: a DFlash checkpoint directory (or hub id), or a training run's directory, whose latest complete
    checkpoint is evaluated with the target, dtype and held-out prompts of its config.json (unless given here). null:
    the drafter shipped with the bundled target, on its held-out prompts."""
    device: str = "auto"
    """auto (cuda when there is one, else cpu) | cpu | cuda."""
    temperature: float = 0.0
    """Sampling temperature of every method; 0 decodes greedily."""
    seed: int = 0
    """Sampling seed (temperature > 0)."""
    max_new_tokens: int = 256
    """Tokens generated per prompt."""
    limit: int | None = None
    """Only the first N prompts; null: all of them."""
    block_size: int | None = None
    """Drafted block, the anchor included; null: the drafter's own."""
    ignore_eos: bool = False
    """Always generate max_new_tokens tokens (do not stop at the end-of-sequence token)."""
    engine: bool | str = "auto"
    """Decode with flashdraft's engine (static caches, CUDA graphs; dense Qwen3.5/Qwen3 on CUDA): true (on) | false
    (off: transformers) | auto (the engine on a CUDA target it supports, else transformers)."""
    baselines: list[str] | None = None
    """Methods decoded beside DFlash on the same prompts: ar (autoregressive), prompt_lookup, mtp (the target's own
    MTP layer). null: ar and prompt_lookup, plus mtp when the target checkpoint ships MTP weights."""
    mtp_drafts: int = 3
    """The MTP baseline's chained drafts per round."""
    refine: list[int] | str | None = None
    """Draft each block in passes, e.g. [1, 3, 7]: after each pass that many drafts are fixed and the rest drafted
    again conditioned on them (for a drafter trained with recipe.reveal > 0; when sampling, every method decodes in
    the plain loop). each: one more draft fixed per pass (1, 2, ..., block size - 2). null: one pass."""
    verify: str = "block"
    """When sampling, how each method verifies a block of drafts: block (block verification: the drafts are judged
    together, which accepts more per round) | token (token by token, as most servers do). Both keep the target's
    distribution exactly."""
    verify_length: str = "full"
    """How many of each round's drafts the target verifies: full (all) | confidence (a drafter with a confidence
    head, DSpark's: while a draft's predicted acceptance raises the round's expected tokens per second, by the cost of
    a round measured on this device first; the plain loop). Lossless either way."""
    context_lengths: list[int] | None = None
    """Token counts, e.g. [1024, 8192, 32768]: also decode every prompt left-padded to each length with held-out
    text, and report τ and speedup per method per length."""
    context_text: str | None = None
    """JSONL of {"prompt": str} (optional "response", "source") whose text pads the prompts for context_lengths;
    null: the bundled held-out standard-library code."""
    json: str | None = None
    """Also write the report as JSON to this file."""
    plot: str | None = None
    """Also draw the acceptance statistics into this PNG file (needs matplotlib)."""
    progress: bool = True
    """Show a progress bar."""


@dataclass(kw_only=True)
class RegenerateCommand:
    """`flashdraft regenerate`; the target is target.path."""

    data: list[str] = field(default_factory=list)
    """Records whose responses the target writes again: JSONL/Parquet paths, globs or s3:// URLs."""
    out: str | None = None
    """Output JSONL, appended to: running the same command again resumes where it stopped."""
    device: str = "auto"
    """auto (cuda when there is one, else cpu) | cpu | cuda."""
    backend: str = "auto"
    """auto: vLLM, then SGLang, when installed and on a GPU, else transformers | hf (transformers) | vllm |
    sglang."""
    temperature: float = 0.0
    """Sampling temperature; 0 decodes greedily."""
    max_new_tokens: int = 1024
    """Longest response generated, in tokens."""
    batch_size: int = 8
    """Records generated together (transformers backend)."""
    limit: int | None = None
    """Only the first N records; null: all of them."""
    seed: int = 0
    """Sampling seed (temperature > 0)."""
    progress: bool = True
    """Show a progress bar."""


@dataclass(kw_only=True)
class PrepareCommand:
    """`flashdraft prepare`; what it tokenises and how come from the data section (data.train, data.tokenizer,
    data.shards, data.format, data.max_length, ...), the s3:// settings from the s3 section."""

    split_marker: str | None = None
    """Text records: the loss covers only what follows this marker."""
    append_eos: bool = False
    """Text records: append the tokenizer's end-of-sequence token."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables of the chat template, e.g. {"enable_thinking": false}."""
    endpoint_url: str | None = None
    """S3-compatible endpoint of s3:// data; null: AWS_ENDPOINT_URL (or AWS's own)."""
    force: bool = False
    """Rebuild the shards, replacing a directory that holds other inputs' shards."""
    workers: int | None = None
    """Tokenising processes; the shards are the same for any number. null: 1 for small inputs, else half the cores,
    at most 8."""
    progress: bool = True
    """Show a progress bar."""
    verify: str | None = None
    """Instead of preparing: check every checksum of this shard directory, or offline features directory (local or
    s3://), and name each damaged file and record range; exit 1 when any is damaged or has no checksums."""


@dataclass(kw_only=True)
class ExportCommand:
    """`flashdraft export`; the drafter is checked against target.path when one is given."""

    drafter: str | None = None
    """The drafter to export: a checkpoint directory (config.json and safetensors), or a training run's directory
    (its latest complete checkpoint)."""
    out: str | None = None
    """Output directory, replaced atomically."""
    layout: str = "auto"
    """The checkpoint layout: auto (what the serving engines read for the drafter's family: reference for DFlash,
    deepspec for DSpark) | reference (the dflash package's; DFlash) | deepspec (DeepSpec's; DSpark, with copies of
    the target's embedding and LM head, so it needs the target's directory) | speculators (speculators 0.9's;
    DFlash and DSpark, naming the target as its verifier)."""


@dataclass(kw_only=True)
class DoctorCommand:
    """`flashdraft doctor`."""

    model: str | None = None
    """What to probe: a tiny family (qwen3_5, qwen3_5_moe, qwen3_next, qwen3), or the first probe_layers layers of a
    config.json or model directory, built with random weights. null: tiny qwen3_5."""
    probe_layers: int = 4
    """Layers of a config.json or model directory built and probed."""
    json: bool = False
    """Print one JSON object instead of tables."""
    build_log: str | None = None
    """A pip log of a failed causal-conv1d build to explain."""


@dataclass(kw_only=True)
class BenchCommand:
    """`flashdraft bench train-step`: the training step of the run the rest of the config describes (its sequence
    length is data.max_length)."""

    warmup: int = 2
    """Untimed steps first (the first one compiles)."""
    steps: int = 4
    """Timed steps."""
    json: str | None = None
    """Also write the result as JSON to this file."""


def either(words) -> str:
    """'a, b or c'."""
    words = list(words)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def command_checks(cfg, choices: dict[str, tuple[str, ...]]) -> list[tuple[str, bool, str]]:
    """(dotted field, ok, why) of every value of the command sections that a type cannot express; `choices`: the
    words each word field accepts."""
    e, r = cfg.eval, cfg.regenerate
    checks = [(name, field_value(cfg, name) in words, f"must be {either(words)}") for name, words in choices.items()]
    unknown = [b for b in e.baselines or () if b not in BASELINES]
    checks += [
        ("eval.engine", isinstance(e.engine, bool) or e.engine == "auto", "must be auto, true or false"),
        ("eval.temperature", e.temperature >= 0, "must be >= 0 (0 decodes greedily)"),
        ("eval.max_new_tokens", e.max_new_tokens >= 1, "must be >= 1"),
        ("eval.limit", e.limit is None or e.limit >= 1, "must be >= 1 or null"),
        (
            "eval.block_size",
            e.block_size is None or e.block_size >= 2,
            "must be >= 2 (the anchor plus one drafted token)",
        ),
        ("eval.mtp_drafts", e.mtp_drafts >= 1, "must be >= 1"),
        (
            "eval.baselines",
            e.baselines is None or (bool(e.baselines) and not unknown),
            f"unknown {', '.join(unknown)}; choose from ar, prompt_lookup, mtp"
            if unknown
            else "an empty list: name at least one of ar, prompt_lookup, mtp",
        ),
        (
            "eval.refine",
            e.refine is None or e.refine == "each" or _ascending(e.refine),
            "expected ascending counts of drafts, e.g. [1, 3, 7] (on the command line 1,3,7), or each",
        ),
        (
            "eval.context_lengths",
            e.context_lengths is None or (bool(e.context_lengths) and min(e.context_lengths) >= 1),
            "expected positive token counts",
        ),
        ("regenerate.temperature", r.temperature >= 0, "must be >= 0 (0 decodes greedily)"),
        ("regenerate.max_new_tokens", r.max_new_tokens >= 1, "must be >= 1"),
        ("regenerate.batch_size", r.batch_size >= 1, "must be >= 1"),
        ("regenerate.limit", r.limit is None or r.limit >= 1, "must be >= 1 or null"),
        ("prepare.workers", cfg.prepare.workers is None or cfg.prepare.workers >= 1, "must be >= 1 or null"),
        ("doctor.probe_layers", cfg.doctor.probe_layers >= 1, "must be >= 1"),
        ("bench.warmup", cfg.bench.warmup >= 0, "must be >= 0"),
        ("bench.steps", cfg.bench.steps >= 1, "must be >= 1"),
    ]
    return checks


def _ascending(counts) -> bool:
    return isinstance(counts, list) and bool(counts) and all(b > a for a, b in zip((0, *counts), counts, strict=False))


def field_value(obj, dotted: str):
    """The value of `dotted` ("section.field") in config `obj`."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_switch(name: str, setting: bool | str, auto: bool) -> bool:
    """A true | false | auto setting (`name`, for the error) resolved: `auto` is what auto means here."""
    if not is_switch(setting):
        raise ValueError(f"{name} = {setting!r}: must be auto, true or false")
    return auto if setting == "auto" else setting


def is_switch(setting: Any) -> bool:
    return isinstance(setting, bool) or setting == "auto"
