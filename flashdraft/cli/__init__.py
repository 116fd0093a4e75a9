"""The `flashdraft` command: train | features | doctor | prepare | regenerate | eval | export | bench.

Every command reads one config: `--config YAML` (train, features and bench default to the bundled default's),
dotted `section.field=value` overrides, and shortcut flags that set one field each (`--max-new-tokens 64` is
eval.max_new_tokens=64; cli/options.py builds them from the schema, flashdraft/config/). `--help-config` lists
every field of every section.

    flashdraft train [--config YAML] [--out DIR] [--resume] [--nproc N] [section.field=value ...]
    flashdraft features [--config YAML] [--out DIR|s3://...] [--nproc N] [section.field=value ...]
    flashdraft doctor [--json] [--model tiny-family|config.json|model-dir]
    flashdraft prepare --data PATH|GLOB|s3://... --tokenizer DIR --out DIR     (or data.* in --config)
    flashdraft prepare --verify DIR|s3://...                                   (checksums of shards or features)
    flashdraft regenerate --target DIR --data IN.jsonl --out OUT.jsonl
    flashdraft eval [--drafter RUN_DIR | --target T --drafter D --prompts FILE.jsonl]
    flashdraft export --drafter D|RUN_DIR --out DIR [--target T]
    flashdraft bench train-step [--config YAML] [--seq N] [section.field=value ...]

Exit codes: 0 success; 1 a check failed (e.g. doctor: fast path incomplete; prepare --verify: damaged data); 2 bad
input or usage (the message names the file, line or field); 3 an unexpected internal error; 4 the output cannot be
written (another run holds the output directory, or the disk, a quota or a file-size limit is full: the message
names the path); 5 a rank of a multi-process job died or stopped answering (the message names it); 128 + N stopped
by signal N after a checkpoint (train: 143 for SIGTERM, 130 for Ctrl-C). A traceback is printed only with --debug.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from flashdraft.cli.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_CHECK_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT,
)
from flashdraft.io import OutputError

# subcommand -> module providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "doctor": "flashdraft.cli.doctor",
    "prepare": "flashdraft.cli.prepare",
    "regenerate": "flashdraft.cli.regenerate",
    "train": "flashdraft.cli.train",
    "features": "flashdraft.cli.features",
    "eval": "flashdraft.cli.eval",
    "export": "flashdraft.cli.export",
    "bench": "flashdraft.cli.bench",
}

__all__ = ["EXIT_BAD_INPUT", "EXIT_CHECK_FAILED", "EXIT_INTERNAL", "EXIT_OK", "EXIT_OUTPUT", "SUBCOMMANDS", "main"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of subcommand `only` alone (its module is the only one imported: the
    others pull in torch and transformers, seconds of start-up before a simple usage or config error)."""
    from flashdraft import __version__

    parser = argparse.ArgumentParser(prog="flashdraft", description="Train and evaluate DFlash drafters.")
    parser.add_argument("--version", action="version", version=f"flashdraft {__version__}")
    parser.add_argument("--debug", action="store_true", help="print full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as exc:  # a subcommand whose optional dependency is missing still shows up, with why
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(_unavailable=str(exc))
    # `flashdraft train ... --debug` as well as `flashdraft --debug train ...`: the error message says "re-run with
    # --debug", and people append it. SUPPRESS keeps a subcommand from resetting a --debug given before it.
    for p in sub.choices.values():
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="print full tracebacks on errors"
        )
    return parser


def quiet_dependency_notices() -> None:
    """Silence what a dependency says on every start and flashdraft says better itself.

    fla warns (warnings.warn, UserWarning, from fla.utils.hardware, at its import, which transformers' Qwen3.5 model
    triggers) "Triton is not supported on current platform, roll back to CPU" on any machine without a GPU
    driver. The device each layer runs on is reported by flashdraft (`flashdraft doctor`, the target's fast-path
    line). Only that message of that module is filtered; every other warning shows as before.
    """
    warnings.filterwarnings(
        "ignore", message=r"Triton is not supported on current platform", category=UserWarning, module=r"fla\."
    )


def main(argv: list[str] | None = None) -> int:
    # No download unless asked (HF_HUB_OFFLINE=0; flashdraft.hub.resolve_local_files_only): said to transformers and
    # huggingface_hub too, before build_parser imports them (they read it once, at import). Without it they contact
    # the Hub even for cached files (huggingface_hub 1.x fetches an agent registry to build request headers).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet_dependency_notices()  # before build_parser imports anything that imports fla
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    parser = build_parser(words[0] if words and words[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"flashdraft {args.command}: unavailable: {args._unavailable}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # Under torchrun every rank has its own stderr stream in the job's output: say which rank a message is from.
    where = (
        f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ else ""
    )
    try:
        return int(args.run(args) or EXIT_OK)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OutputError as exc:
        if args.debug:
            raise
        print(f"flashdraft {args.command}{where}: error: {exc}", file=sys.stderr)
        return EXIT_OUTPUT
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        if args.debug:
            raise
        print(f"flashdraft {args.command}{where}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(getattr(exc, "exit_code", None), int):  # an expected fault with a code of its own (a lost rank)
            print(f"flashdraft {args.command}{where}: error: {exc}", file=sys.stderr)
            return exc.exit_code
        print(
            f"flashdraft {args.command}{where}: internal error: {type(exc).__name__}: {exc}\n(re-run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
