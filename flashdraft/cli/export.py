"""`flashdraft export`: the export section (and target.path, when given, to check against) passed to
flashdraft.export.export_drafter (which says what the command does), and the serving command lines printed."""

from __future__ import annotations

import argparse
import sys

from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_BAD_INPUT, EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (
    Shortcut("export.drafter", metavar="D"),
    Shortcut("export.out", metavar="DIR"),
    Shortcut("target.path", flag="--target", metavar="T"),
    Shortcut("export.layout"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # Not flashdraft.export's docstring: importing it brings transformers and torch into every `flashdraft --help`.
    parser = subparsers.add_parser(
        "export",
        help="write a drafter for SGLang / vLLM / dflash",
        description="`flashdraft export`: write a drafter that SGLang, vLLM, speculators and the reference `dflash` "
        "package load.",
    )
    options.add(parser, execute, SHORTCUTS)
    return parser


def execute(cfg, args: argparse.Namespace) -> int:
    from transformers import Qwen3Config

    from flashdraft import bundled
    from flashdraft.drafter.config import draft_value
    from flashdraft.drafter.families import draft_offset, family_of
    from flashdraft.export import PLACEHOLDER_TARGET, export_drafter, serve_commands

    options.require(args, cfg, "export.drafter", "export.out")
    # The default target.path (the bundled target) is no claim about this drafter: checked only when given.
    target = cfg.target.path if "target.path" in options.explicit(args) else None
    try:
        run = options.training_run(cfg.export.drafter)
        drafter = run[0] if run is not None else cfg.export.drafter
        check = str(bundled.target_dir()) if target == bundled.BUNDLED else target
        layout = None if cfg.export.layout == "auto" else cfg.export.layout
        out = export_drafter(drafter, cfg.export.out, target=check, layout=layout)
    except (ValueError, OSError) as err:
        print(f"flashdraft export: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    config = Qwen3Config.from_pretrained(drafter)
    block = draft_value(config, "block_size")
    drafts = block - 1 + draft_offset(config)
    commands = serve_commands(str(out.resolve()), block, target or PLACEHOLDER_TARGET, family_of(config), drafts)
    print(f"exported {out}\n  SGLang: {commands['sglang']}\n  vLLM:   {commands['vllm']}")
    return EXIT_OK
