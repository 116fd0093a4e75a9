"""The `flashdraft` command: train | doctor | prepare | eval | export.

    flashdraft train [--config YAML] [--out DIR] [--resume] [section.field=value ...]
    flashdraft doctor [--json] [--model tiny-family|config.json|model-dir]
    flashdraft prepare --data PATH|GLOB|s3://... --tokenizer DIR --out DIR
    flashdraft regenerate --target DIR --data IN.jsonl --out OUT.jsonl
    flashdraft eval --target T --drafter D --prompts FILE.jsonl
    flashdraft export --drafter D --out DIR [--target T]

Exit codes: 0 success; 1 a check failed (e.g. doctor: fast path incomplete); 2 bad input or usage
(the message names the file, line or field); 3 an unexpected internal error. A traceback is printed only
with --debug.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "doctor": "flashdraft.cli_doctor",
    "prepare": "flashdraft.data.prepare",
    "regenerate": "flashdraft.data.regenerate",
    "train": "flashdraft.train.cli",
    "eval": "flashdraft.spec.evaluate",
    "export": "flashdraft.export",
}

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    from flashdraft import __version__

    parser = argparse.ArgumentParser(prog="flashdraft", description="Train and evaluate DFlash drafters.")
    parser.add_argument("--version", action="version", version=f"flashdraft {__version__}")
    parser.add_argument("--debug", action="store_true", help="print full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as exc:  # a subcommand whose optional dependency is missing still shows up, with why
            p = sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(_unavailable=str(exc))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"flashdraft {args.command}: unavailable: {args._unavailable}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        if args.debug:
            raise
        print(f"flashdraft {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        if args.debug:
            raise
        print(f"flashdraft {args.command}: internal error: {type(exc).__name__}: {exc}\n(re-run with --debug for the traceback)",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
