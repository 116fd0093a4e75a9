"""What every `flashdraft` command accepts, built in one place: `--config YAML`, dotted `section.field=value`
overrides, `--help-config`, and shortcut flags generated from the config schema (flashdraft/config/).

    flashdraft eval --config run.yaml --max-new-tokens 64 eval.temperature=1 target.dtype=bfloat16

A shortcut is a config field: `--max-new-tokens 64` is `eval.max_new_tokens=64`. Its name (unless the command
names it: `--target` is target.path), type, choices, default and help come from the field and the docstring under
it. Precedence: the defaults, the YAML file (`--config`, or the command's default file), the overrides, the
shortcuts; a shortcut and an override that set one field to different values are an error naming both.
"""

from __future__ import annotations

import argparse
import functools
import json
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashdraft.cli.exit_codes import EXIT_OK


@dataclass(frozen=True)
class Shortcut:
    """A command-line flag that sets one config field."""

    field: str
    """The dotted field, e.g. "eval.max_new_tokens"."""
    flag: str = ""
    """The flag; default: "--" and the field's last part with dashes (--max-new-tokens)."""
    negate: bool = False
    """A bool field the flag sets to false (--no-progress: eval.progress=false)."""
    repeat: bool = False
    """A list field given once per item (--data A --data B); other list fields take comma-separated items."""
    metavar: str | None = None

    @property
    def name(self) -> str:
        return self.flag or "--" + ("no-" if self.negate else "") + self.field.rpartition(".")[2].replace("_", "-")

    @property
    def dest(self) -> str:
        return f"shortcut:{self.field}"


def shortcuts(*fields: str) -> tuple[Shortcut, ...]:
    """Shortcuts named after their fields: `shortcuts("eval.limit")` is --limit."""
    return tuple(Shortcut(f) for f in fields)


def add(
    parser: argparse.ArgumentParser,
    execute: Callable[[object, argparse.Namespace], int],
    shortcuts: Sequence[Shortcut] = (),
    *,
    default_config: str | Path | None = None,
) -> None:
    """Give `parser` --config, --help-config, `shortcuts` and the dotted overrides; its `run(args)` loads the config
    and calls `execute(cfg, args)`. `default_config`: the YAML file read when --config is not given."""
    from flashdraft.config import fields_of

    fields = fields_of()
    default = "the bundled default" if default_config is not None else "none"
    parser.add_argument(
        "--config", default=None, metavar="YAML", help=f"YAML config (see examples/); default: {default}"
    )
    parser.add_argument(
        "--help-config", action="store_true", help="list every config field with its default and meaning"
    )
    for shortcut in shortcuts:
        _add_shortcut(parser, shortcut, fields[shortcut.field])
    parser.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="dotted config overrides, e.g. optim.lr=3e-4"
    )
    parser.set_defaults(run=functools.partial(run, execute), shortcuts=tuple(shortcuts), default_config=default_config)


def run(execute, args: argparse.Namespace) -> int:
    if args.help_config:
        print_fields()
        return EXIT_OK
    return execute(load(args), args)


def print_fields() -> None:
    from rich.console import Console
    from rich.markup import escape

    from flashdraft.config import describe_fields

    console = Console()
    for name, default, doc in describe_fields():
        console.print(f"[bold]{name}[/] = {escape(default)}\n    {escape(' '.join(doc.split()))}")


def load(args: argparse.Namespace, base: dict | None = None):
    """The command's validated RunConfig: its YAML file, the overrides and the shortcuts given, over `base`."""
    from flashdraft.config import load_config

    return load_config(_config_path(args), args.overrides, flags=flags_given(args), base=base)


def explicit(args: argparse.Namespace) -> set[str]:
    """The dotted fields the command line (or its --config file) set: what a command tells from a default."""
    from flashdraft.config import explicit_fields

    return explicit_fields(_config_path(args), args.overrides, flags=flags_given(args))


def flags_given(args: argparse.Namespace) -> list[tuple[str, str, object]]:
    """(label, dotted field, value) of every shortcut given, e.g. ("--limit 2", "eval.limit", 2)."""
    from flashdraft.config import fields_of

    fields = fields_of()
    given = []
    for s in args.shortcuts:
        value = getattr(args, s.dest, None)
        if value is None:
            continue
        if _takes_no_value(s):
            label = s.name
        elif s.repeat:
            label = " ".join(f"{s.name} {v}" for v in value)
        else:
            label = f"{s.name} {_shown(value)}"
        if isinstance(value, str) and _list_hint(fields[s.field].hint):
            value = _items(value, fields[s.field].hint)
        given.append((label, s.field, value))
    return given


def require(args: argparse.Namespace, cfg, *fields: str, named: Sequence[str] = ()) -> None:
    """A ValueError naming the flags (or fields) of `fields` that are unset in `cfg`, and of `named` that the command
    line and its --config file leave at their defaults."""
    from flashdraft.config.commands import field_value

    missing = [f for f in fields if field_value(cfg, f) in (None, [], "")]
    missing += sorted(set(named) - explicit(args)) if named else []
    if missing:
        flags = {s.field: s.name for s in args.shortcuts}
        raise ValueError(
            f"required: {', '.join(flags.get(f, f) for f in missing)} (or {', '.join(missing)} in --config or as "
            "overrides)"
        )


def add_nproc_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="run N data-parallel processes on this machine (launches torchrun --standalone; sets "
        "NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set)",
    )


def relaunch_argv(args: argparse.Namespace, command: str) -> list[str]:
    """The arguments of this command again, without --nproc: what each torchrun worker runs."""
    argv = [command] + (["--config", str(args.config)] if args.config else [])
    for s in args.shortcuts:
        value = getattr(args, s.dest, None)
        if value is not None and _takes_no_value(s):
            argv.append(s.name)
        elif isinstance(value, list):
            argv += [x for v in value for x in (s.name, str(v))]
        elif value is not None:
            argv += [s.name, json.dumps(value) if isinstance(value, dict) else str(value)]
    argv += [f"--{flag}" for flag in ("resume", "debug") if getattr(args, flag, False)]
    return argv + list(args.overrides)


def _takes_no_value(s: Shortcut) -> bool:
    from flashdraft.config import fields_of

    return s.negate or _plain(fields_of()[s.field].hint) is bool


def _config_path(args: argparse.Namespace):
    return args.config or args.default_config


def _add_shortcut(parser: argparse.ArgumentParser, s: Shortcut, field) -> None:
    from flashdraft.config import CHOICES

    hint = _plain(field.hint)
    doc = " ".join(field.doc.split()).replace("%", "%%")
    default = json.dumps(field.default, ensure_ascii=False)
    help_text = f"{doc} [{s.field}; default {default}]"
    if s.negate:  # the flag turns the field off: say so before the field's own description
        help_text = f"{s.field} = false. {s.field}: {doc} [default {default}]"
    common = dict(dest=s.dest, default=None, help=help_text)
    metavar = s.metavar or s.field.rpartition(".")[2].upper()
    if hint is bool:
        parser.add_argument(s.name, action="store_const", const=not s.negate, **common)
    elif s.repeat:
        parser.add_argument(s.name, action="append", metavar=metavar, **common)
    elif typing.get_origin(hint) is dict:
        parser.add_argument(s.name, type=_json_object(s.name), metavar=s.metavar or "JSON", **common)
    elif set(typing.get_args(hint)) == {bool, str}:  # a switch: true | false | auto
        parser.add_argument(s.name, type=_switch, metavar="{auto,on,off}", **common)
    elif hint in (int, float):
        parser.add_argument(s.name, type=hint, metavar=metavar, **common)
    elif s.field in CHOICES:
        parser.add_argument(s.name, choices=CHOICES[s.field], **common)
    else:
        parser.add_argument(s.name, metavar=metavar, **common)


def _plain(hint):
    """`hint` without its None: `int | None` -> int."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _list_hint(hint) -> bool:
    return any(typing.get_origin(a) is list for a in (hint, *typing.get_args(hint)))


def _items(text: str, hint) -> list | str:
    """A comma-separated flag value as the items of a list field (each read as YAML: 1024 is a number); a single
    word stays a word when the field also takes one (eval.refine: each)."""
    import yaml

    items = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            try:
                items.append(yaml.safe_load(part))
            except yaml.YAMLError:
                items.append(part)
    if len(items) == 1 and isinstance(items[0], str) and str in typing.get_args(hint):
        return items[0]
    return items


def _switch(text: str) -> bool | str:
    words = {"on": True, "true": True, "off": False, "false": False, "auto": "auto"}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from auto, on, off)")
    return words[text.lower()]


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _json_object(flag: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(
                f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {text!r}"
            )
        return value

    parse.__name__ = flag
    return parse


def training_run(path) -> tuple[Path, dict] | None:
    """(the drafter of its latest complete checkpoint, its config.json) of a training run's directory (one holding
    checkpoints/); None for any other path. A run with no complete checkpoint yet is a ValueError."""
    run = Path(path)
    if not (run / "checkpoints").is_dir():
        return None
    from flashdraft.train.checkpoint import CheckpointManager

    latest = CheckpointManager(run).latest()
    if latest is None:
        raise ValueError(f"--drafter {path} is a training run with no complete checkpoint yet")
    saved = run / "config.json"
    return latest / "drafter", json.loads(saved.read_text()) if saved.is_file() else {}
