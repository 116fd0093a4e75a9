"""`flashdraft eval`: the target, the drafter, the baselines (the target's own MTP layer among them) and the prompts
of the config (target section, data.eval_prompts, the eval section), checked against each other, then
flashdraft.speculative.evaluate.evaluate (which says what the command reports) and its report printed, written as
JSON and plotted (flashdraft.speculative.report).

    flashdraft eval --drafter runs/my-run        # a training run: its latest checkpoint, target and prompts
    flashdraft eval --target T --drafter D --prompts FILE.jsonl --max-new-tokens 128 eval.temperature=1
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from flashdraft import bundled
from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (
    Shortcut("target.path", flag="--target", metavar="T"),
    Shortcut("eval.drafter", metavar="D"),
    Shortcut("data.eval_prompts", flag="--prompts", metavar="FILE.jsonl"),
    *options.shortcuts("eval.temperature", "eval.block_size", "eval.max_new_tokens", "eval.limit"),
    Shortcut("eval.json", metavar="FILE"),
    Shortcut("eval.plot", metavar="FILE.png"),
    *options.shortcuts("eval.device", "target.dtype", "target.trust_remote_code", "eval.seed", "eval.ignore_eos"),
    Shortcut("eval.progress", negate=True),
    Shortcut("eval.engine"),
    Shortcut("eval.baselines", metavar="LIST"),
    Shortcut("eval.mtp_drafts"),
    Shortcut("eval.refine", metavar="LIST|each"),
    Shortcut("eval.verify"),
    Shortcut("eval.verify_length"),
    Shortcut("eval.context_lengths", metavar="LIST"),
    Shortcut("eval.context_text", metavar="FILE.jsonl"),
)
# What `--drafter RUN_DIR` takes from the run's config.json (unless given): the target and the held-out prompts.
FROM_RUN = {"target": ("path", "dtype", "trust_remote_code"), "data": ("eval_prompts",)}
BOTH = (
    "give both --target and --drafter (or --drafter alone with a training run's directory, or neither for the "
    "bundled default)"
)


class Refused(Exception):
    """The command line names no drafter and target that go together; the message says what to give."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="speculative decoding with a DFlash drafter: tau, acceptance, speedup")
    options.add(p, execute, SHORTCUTS)


def drafter_and_config(cfg, args):
    """(the drafter directory, the config) of the command line: a training run's latest checkpoint with the run's
    target and prompts under what was given; the bundled default when neither --target nor --drafter is given."""
    drafter, given = cfg.eval.drafter, options.explicit(args)
    if drafter is None:
        if "target.path" in given:
            raise Refused(BOTH)
        # The bundled default: its tiny trained target, the drafter shipped with it (what every run of the bundled
        # default is measured against), its held-out prompts.
        try:
            trained = options.training_run(bundled.DEFAULT_RUN) is not None
        except ValueError:
            trained = False
        hint = f"; the run of `flashdraft train`: flashdraft eval --drafter {bundled.DEFAULT_RUN}" if trained else ""
        print(f"flashdraft eval: the drafter shipped with the bundled target{hint}", file=sys.stderr)
        return str(bundled.drafter_dir()), cfg
    run = options.training_run(drafter)
    if run is None and "target.path" not in given:
        raise Refused(BOTH)
    if run is None:
        return drafter, cfg
    checkpoint, settings = run
    # A null there (data.eval_prompts: no measured τ in training) leaves the default.
    base = {
        part: {k: v for k in keys if (v := (settings.get(part) or {}).get(k)) is not None}
        for part, keys in FROM_RUN.items()
    }
    return str(checkpoint), options.load(args, base=base)


def prompts_of(cfg) -> str | None:
    """data.eval_prompts; "bundled": the bundled held-out prompts, for the bundled target only."""
    prompts = cfg.data.eval_prompts
    if prompts == bundled.BUNDLED:
        return str(bundled.eval_prompts()) if cfg.target.path == bundled.BUNDLED else None
    return prompts


def _stop_token_ids(target, tokenizer) -> list[int]:
    ids = set()
    for value in (getattr(target.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def check_fit(drafter, target, tokenizer, drafter_name: str, target_name: str) -> None:
    """Raise a ValueError listing every way the drafter (or the tokenizer) does not fit the target, before decoding
    (a mismatch would otherwise surface as an IndexError or a shape error deep in a forward)."""
    from flashdraft.drafter.config import target_text_config
    from flashdraft.export import check_against_target

    text = target_text_config(target.config)
    problems = check_against_target(drafter.config, text.to_dict())
    if len(tokenizer) > text.vocab_size:
        problems.append(f"tokenizer: {len(tokenizer)} tokens, more than the target's vocab_size {text.vocab_size}")
    if problems:
        raise ValueError(f"drafter {drafter_name} does not fit target {target_name}:\n  " + "\n  ".join(problems))


def execute(cfg, args) -> int:
    try:
        drafter_path, cfg = drafter_and_config(cfg, args)
    except Refused as exc:
        print(f"flashdraft eval: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    e, prompts_path = cfg.eval, prompts_of(cfg)
    if not prompts_path:
        print("flashdraft eval: give --prompts FILE.jsonl (data.eval_prompts)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not Path(prompts_path).is_file():  # before loading the models, which can take minutes
        raise FileNotFoundError(f"prompts file {prompts_path} does not exist")
    if e.context_text and not Path(e.context_text).is_file():
        raise FileNotFoundError(f"--context-text file {e.context_text} does not exist")
    if e.plot:
        from flashdraft.speculative.report import require_matplotlib

        require_matplotlib()  # fail before the long part
    return _evaluate(cfg, drafter_path, prompts_path)


def _evaluate(cfg, drafter_path: str, prompts_path: str) -> int:
    from flashdraft import fastpath
    from flashdraft.config import BASELINES
    from flashdraft.devices import resolve_device, resolve_dtype
    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.speculative.context import ContextFiller
    from flashdraft.speculative.evaluate import evaluate
    from flashdraft.speculative.prompts import load_prompts
    from flashdraft.speculative.report import print_report, write_plot
    from flashdraft.target import mtp
    from flashdraft.target.load import load_causal_lm, load_tokenizer, target_directory

    e, t = cfg.eval, cfg.target
    device = resolve_device(e.device, field="eval.device")
    dtype = resolve_dtype(t.dtype, device)
    # A hub id is read from the cache unless HF_HUB_OFFLINE=0 (no silent downloads); safetensors only.
    directory = target_directory(t.path, trust_remote_code=t.trust_remote_code)
    if e.baselines is None:
        baselines = ("autoregressive", "prompt_lookup") + (("mtp",) if mtp.has_mtp(directory) else ())
    else:
        baselines = tuple(dict.fromkeys(BASELINES[b] for b in e.baselines))
    if "mtp" in baselines:
        mtp.require_mtp(directory)  # before the models load, which can take minutes
    tokenizer = load_tokenizer(t.path, trust_remote_code=t.trust_remote_code)
    prompts = load_prompts(prompts_path, tokenizer, e.limit)
    try:
        strict = device.type == "cuda"
        target = load_causal_lm(
            t.path, dtype=dtype, device=device, trust_remote_code=t.trust_remote_code, strict=strict
        )
    except fastpath.FastPathError as exc:
        print(f"flashdraft eval: the fast path is incomplete, timings would be meaningless:\n{exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    drafter = DFlashDraftModel.from_pretrained(drafter_path, dtype=dtype).to(device).eval()
    check_fit(drafter, target, tokenizer, drafter_path, t.path)
    refine = e.refine or ()
    if refine == "each":
        refine = range(1, (e.block_size or drafter.block_size) - 1)
    stops = [] if e.ignore_eos else _stop_token_ids(target, tokenizer)
    mtp_head = mtp.load_mtp(target, directory) if "mtp" in baselines else None
    lengths = sorted(set(e.context_lengths)) if e.context_lengths else None
    # Held-out text for the padding: by default the bundled evaluation prompts (files no training here saw).
    filler = ContextFiller.from_jsonl(e.context_text or bundled.eval_prompts(), tokenizer) if lengths else None

    report = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=e.max_new_tokens,
        temperature=e.temperature,
        block_size=e.block_size,
        stop_token_ids=stops,
        seed=e.seed,
        progress=e.progress,
        engine=None if e.engine == "auto" else e.engine,
        baselines=baselines,
        mtp_head=mtp_head,
        mtp_drafts=e.mtp_drafts,
        context_lengths=lengths,
        context_filler=filler,
        refine=tuple(refine),
        verify=e.verify,
        verify_length=e.verify_length,
    )
    report.update(
        target=str(t.path),
        drafter=str(drafter_path),
        prompts=str(prompts_path),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
    )
    print_report(report)
    if e.json:
        Path(e.json).write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    if e.plot:
        write_plot(report, e.plot)
    return EXIT_OK


def _json_safe(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
