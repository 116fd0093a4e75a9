"""`flashdraft eval`: the target, the drafter, the baselines (the target's own MTP layer among them) and the prompts
built from the arguments, checked against each other, then flashdraft.speculative.evaluate.evaluate (which says
what the command reports) and its report printed, written as JSON and plotted (flashdraft.speculative.report)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from flashdraft.cli.exit_codes import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK
from flashdraft.speculative.context import ContextFiller
from flashdraft.speculative.evaluate import evaluate
from flashdraft.speculative.prompts import load_prompts
from flashdraft.speculative.report import print_report, require_matplotlib, write_plot
from flashdraft.target import mtp

# --baselines names (short and long) -> the methods of flashdraft.speculative.evaluate.
BASELINE_NAMES = {
    "ar": "autoregressive",
    "autoregressive": "autoregressive",
    "pl": "prompt_lookup",
    "prompt_lookup": "prompt_lookup",
    "mtp": "mtp",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="speculative decoding with a DFlash drafter: tau, acceptance, speedup")
    p.add_argument("--target", help="target model (HF id or directory)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint (HF id or directory), or a training run directory")
    p.add_argument("--prompts", help="JSONL of {'messages': [...]} or {'prompt': str}, optional 'category'")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--block-size", type=int, default=None, help="drafted block incl. anchor (default: drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--json", dest="json_out", default=None, help="write the report as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of the acceptance statistics here (needs matplotlib)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--ignore-eos", action="store_true", help="always decode --max-new-tokens tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--engine",
        choices=("auto", "on", "off"),
        default="auto",
        help="on: flashdraft's engine (static caches, CUDA graphs; dense Qwen3.5/Qwen3 on CUDA); off: transformers; "
        "auto (default): the engine on a CUDA target it supports, else transformers",
    )
    p.add_argument(
        "--baselines",
        default=None,
        help="comma-separated, decoded beside DFlash: ar (autoregressive), prompt_lookup, mtp (the target's own "
        "MTP layer). Default: ar,prompt_lookup, plus mtp when the target checkpoint ships MTP weights",
    )
    p.add_argument("--mtp-drafts", type=int, default=3, help="MTP: chained drafts per round (default 3)")
    p.add_argument(
        "--refine",
        default=None,
        help="comma-separated, e.g. 1,3,7: draft each block in passes, fixing that many drafts after each pass and "
        "drafting the rest again conditioned on them (a drafter trained with recipe.reveal > 0; when sampling, every "
        "method decodes in the plain loop); 'each': one more draft fixed per pass (1, 2, ..., block size - 2)",
    )
    p.add_argument(
        "--verify",
        choices=("block", "token"),
        default="block",
        help="when sampling (--temperature > 0), how each method verifies a block of drafts: block (default: block "
        "verification, which judges the drafts together and accepts more per round) or token (token by token, as "
        "most servers do); both keep the target's distribution exactly",
    )
    p.add_argument(
        "--context-lengths",
        default=None,
        help="comma-separated token counts, e.g. 1024,8192,32768: also decode every prompt left-padded to each "
        "length with held-out text, and report tau and speedup per method per length",
    )
    p.add_argument(
        "--context-text",
        default=None,
        help="JSONL of {'prompt': str} (optional 'response', 'source') whose text pads the prompts for "
        "--context-lengths (default: the bundled held-out standard-library code)",
    )
    p.set_defaults(run=run)


def _parse_baselines(value: str | None) -> tuple[str, ...] | None:
    """--baselines -> method names (None: the default, decided once the target is known)."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in names if v not in BASELINE_NAMES]
    if unknown or not names:
        raise ValueError(
            f"--baselines: unknown {', '.join(unknown) or 'empty list'}; choose from ar, prompt_lookup, mtp"
        )
    return tuple(dict.fromkeys(BASELINE_NAMES[v] for v in names))


def _parse_refine(value: str | None) -> tuple[int, ...] | str:
    if not value:
        return ()
    if value == "each":  # expanded once the block size is known
        return value
    try:
        counts = tuple(int(v) for v in value.split(","))
    except ValueError:
        counts = ()
    if not counts or any(b <= a for a, b in zip((0, *counts), counts, strict=False)):
        raise ValueError(
            f"--refine: expected ascending comma-separated counts of drafts, e.g. 1,3,7, or each; got {value!r}"
        )
    return counts


def _parse_lengths(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        lengths = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--context-lengths: expected comma-separated token counts, got {value!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--context-lengths: expected positive token counts, got {value!r}")
    return sorted(set(lengths))


def _device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device), getattr(torch, dtype)


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


def run(args) -> int:
    from flashdraft import bundled

    if not args.target and not args.drafter:
        # The bundled default: its tiny trained target, the drafter `flashdraft train` wrote to runs/default (or,
        # before any run, the drafter shipped with it), its held-out prompts.
        from flashdraft.train.checkpoint import CheckpointManager

        latest = CheckpointManager(bundled.DEFAULT_RUN).latest() if bundled.DEFAULT_RUN.is_dir() else None
        if latest is None:
            print(
                f"flashdraft eval: no run in {bundled.DEFAULT_RUN}: evaluating the drafter shipped with the "
                "bundled target",
                file=sys.stderr,
            )
        args.target = bundled.BUNDLED
        args.drafter = str(bundled.drafter_dir() if latest is None else latest / "drafter")
        args.prompts = args.prompts or str(bundled.eval_prompts())
    if not args.target or not args.drafter:
        print(
            "flashdraft eval: give both --target and --drafter (or neither, for the bundled default)", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    if (Path(args.drafter) / "checkpoints").is_dir():  # a training run's directory: its latest checkpoint
        from flashdraft.train.checkpoint import CheckpointManager

        latest = CheckpointManager(args.drafter).latest()
        if latest is None:
            print(
                f"flashdraft eval: --drafter {args.drafter} is a training run with no complete checkpoint yet",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        args.drafter = str(latest / "drafter")
    if not args.prompts:
        print("flashdraft eval: give --prompts FILE.jsonl", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.block_size is not None and args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2 (the anchor plus one drafted token), got {args.block_size}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.mtp_drafts < 1:
        raise ValueError(f"--mtp-drafts must be >= 1, got {args.mtp_drafts}")
    baselines = _parse_baselines(args.baselines)
    refine = _parse_refine(args.refine)
    context_lengths = _parse_lengths(args.context_lengths)
    if not Path(args.prompts).is_file():  # before loading the models, which can take minutes
        raise FileNotFoundError(f"prompts file {args.prompts} does not exist")
    if args.context_text and not Path(args.context_text).is_file():
        raise FileNotFoundError(f"--context-text file {args.context_text} does not exist")
    if args.plot:
        require_matplotlib()  # fail before the long part
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashdraft import fastpath
    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.fastpath.patch import linear_attention_layers
    from flashdraft.hub import check_checkpoint, resolve_model_dir

    device, dtype = _device_and_dtype(args.device, args.dtype)
    is_bundled = args.target == bundled.BUNDLED
    # A hub id is read from the cache unless HF_HUB_OFFLINE=0 (no silent downloads); safetensors only.
    directory = bundled.target_dir() if is_bundled else resolve_model_dir(args.target, what="target")
    if baselines is None:
        baselines = ("autoregressive", "prompt_lookup") + (("mtp",) if mtp.has_mtp(directory) else ())
    if "mtp" in baselines:
        mtp.require_mtp(directory)  # before the models load, which can take minutes
    if is_bundled:
        tokenizer = bundled.load_tokenizer()
        target = bundled.build_target(dtype=dtype, device=device).eval()
    else:
        check_checkpoint(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
        target = AutoModelForCausalLM.from_pretrained(
            directory, trust_remote_code=False, dtype=dtype, use_safetensors=True
        )
        target = target.to(device).eval()
    prompts = load_prompts(args.prompts, tokenizer, args.limit)
    if linear_attention_layers(target):
        try:
            fastpath.enable(target, strict=device.type == "cuda")
        except fastpath.FastPathError as exc:
            print(
                f"flashdraft eval: the fast path is incomplete, timings would be meaningless:\n{exc}", file=sys.stderr
            )
            return EXIT_CHECK_FAILED
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
    check_fit(drafter, target, tokenizer, args.drafter, args.target)
    if refine == "each":
        refine = tuple(range(1, (args.block_size or drafter.block_size) - 1))
    stops = [] if args.ignore_eos else _stop_token_ids(target, tokenizer)
    mtp_head = mtp.load_mtp(target, directory) if "mtp" in baselines else None
    # Held-out text for the padding: by default the bundled evaluation prompts (files no training here saw).
    context_text = args.context_text or bundled.eval_prompts()
    filler = ContextFiller.from_jsonl(context_text, tokenizer) if context_lengths else None

    report = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        block_size=args.block_size,
        stop_token_ids=stops,
        seed=args.seed,
        progress=not args.no_progress,
        engine={"auto": None, "on": True, "off": False}[args.engine],
        baselines=baselines,
        mtp_head=mtp_head,
        mtp_drafts=args.mtp_drafts,
        context_lengths=context_lengths,
        context_filler=filler,
        refine=refine,
        verify=args.verify,
    )
    report.update(
        target=str(args.target),
        drafter=str(args.drafter),
        prompts=str(args.prompts),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
    )
    print_report(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
    return EXIT_OK


def _json_safe(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
