"""`flashdraft export`: the arguments of the command passed to flashdraft.export.export_drafter (which says what
the command does), and the serving command lines printed."""

from __future__ import annotations

import argparse
import sys

from transformers import Qwen3Config

from flashdraft import export
from flashdraft.cli.exit_codes import EXIT_BAD_INPUT, EXIT_OK
from flashdraft.drafter.config import draft_value
from flashdraft.export import PLACEHOLDER_TARGET, export_drafter, serve_commands


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write a drafter for SGLang / vLLM / dflash",
        description=export.__doc__.split("\n\n")[0],
    )
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--target", default=None, help="target model directory or config.json to check against")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        out = export_drafter(args.drafter, args.out, target=args.target)
    except (ValueError, OSError) as err:
        print(f"flashdraft export: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    drafter_config = Qwen3Config.from_pretrained(out)
    commands = serve_commands(
        str(out.resolve()), draft_value(drafter_config, "block_size"), args.target or PLACEHOLDER_TARGET
    )
    print(f"exported {out}\n  SGLang: {commands['sglang']}\n  vLLM:   {commands['vllm']}")
    return EXIT_OK
