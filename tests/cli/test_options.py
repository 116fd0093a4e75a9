"""One style for every command: --config YAML, dotted overrides and shortcut flags generated from the schema."""

import argparse
import importlib

import pytest

from flashdraft import cli
from flashdraft.cli import options
from flashdraft.config import CHOICES, fields_of, to_dict

# command words -> (module, a field the YAML file sets and its value, a dotted override and the field it sets)
COMMANDS = {
    ("train",): ("train", ("optim.lr", 0.001), ("train.seed=7", "train.seed", 7)),
    ("features",): ("features", ("data.max_length", 100), ("train.seed=7", "train.seed", 7)),
    ("prepare",): ("prepare", ("data.max_length", 100), ("prepare.workers=2", "prepare.workers", 2)),
    ("regenerate",): ("regenerate", ("regenerate.batch_size", 3), ("regenerate.seed=5", "regenerate.seed", 5)),
    ("eval",): ("eval", ("eval.temperature", 0.5), ("eval.seed=3", "eval.seed", 3)),
    ("export",): ("export", ("export.out", "o"), ("export.drafter=d", "export.drafter", "d")),
    ("doctor",): ("doctor", ("doctor.probe_layers", 2), ("doctor.json=true", "doctor.json", True)),
    ("bench", "train-step"): ("bench", ("bench.steps", 3), ("bench.warmup=0", "bench.warmup", 0)),
}
# A value each shortcut accepts, as typed on the command line (the field's type and choices give the rest).
SAMPLES = {
    "eval.baselines": "ar,mtp",
    "eval.refine": "1,3",
    "eval.context_lengths": "64,32",
    "prepare.template_kwargs": '{"enable_thinking": false}',
    "data.max_length": "64",
    "eval.engine": "off",
}


def _module(words):
    return importlib.import_module(f"flashdraft.cli.{COMMANDS[words][0]}")


def _parse(words, *argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flashdraft")
    _module(words).add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args([*words, *argv])


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _shortcut_argv(shortcut) -> list[str]:
    field = fields_of()[shortcut.field]
    if shortcut.negate or field.hint is bool:
        return [shortcut.name]
    if shortcut.repeat:
        return [shortcut.name, "a.jsonl", shortcut.name, "b.jsonl"]
    if shortcut.field in SAMPLES:
        return [shortcut.name, SAMPLES[shortcut.field]]
    if shortcut.field in CHOICES:
        return [shortcut.name, CHOICES[shortcut.field][-1]]
    default = field.default
    value = default + 1 if isinstance(default, int | float) and not isinstance(default, bool) else 2
    return [shortcut.name, "some/path" if field.hint in (str, str | None) else str(value)]


def _override(shortcut, argv) -> str:
    if shortcut.negate:
        return f"{shortcut.field}=false"
    if len(argv) == 1:
        return f"{shortcut.field}=true"
    if shortcut.repeat:
        return f"{shortcut.field}=[{', '.join(argv[1::2])}]"
    value = argv[1]
    return f"{shortcut.field}=[{value}]" if "," in value and not value.startswith("{") else f"{shortcut.field}={value}"


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_a_config_file_and_an_override_reach_the_command(words, tmp_path, monkeypatch):
    (dotted, value), (override, field, expected) = COMMANDS[words][1:]
    section, name = dotted.split(".")
    config = tmp_path / "c.yaml"
    config.write_text(f"{section}:\n  {name}: {value}\n")
    seen = {}

    def execute(cfg, args):
        seen["cfg"] = cfg
        return 0

    monkeypatch.setattr(_module(words), "execute", execute)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main([*words, "--config", str(config), override]) == 0
    assert _get(seen["cfg"], dotted) == value and _get(seen["cfg"], field) == expected


@pytest.mark.parametrize(
    "words, shortcut",
    [(words, s) for words in COMMANDS for s in _module(words).SHORTCUTS],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else v.name,
)
def test_a_shortcut_is_its_dotted_override(words, shortcut):
    argv = _shortcut_argv(shortcut)
    by_flag = options.load(_parse(words, *argv))
    by_override = options.load(_parse(words, _override(shortcut, argv)))
    assert to_dict(by_flag) == to_dict(by_override)
    assert _get(by_flag, shortcut.field) != fields_of()[shortcut.field].default  # the flag did set something


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_an_unknown_field_is_an_error_naming_it(words, capsys):
    section = COMMANDS[words][1][0].split(".")[0]
    assert cli.main([*words, f"{section}.no_such_field=1"]) == 2
    err = capsys.readouterr().err
    assert f"override {section}.no_such_field=1: unknown field {section}.no_such_field" in err, err


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_help_config_lists_every_field_of_every_section(words, capsys):
    assert cli.main([*words, "--help-config"]) == 0
    printed = capsys.readouterr().out
    for name in fields_of():
        assert f"\n{name} = " in f"\n{printed}", name


def test_shortcuts_are_generated_from_the_schema(capsys):
    """Name, type, choices, default and help of a shortcut come from its field and the docstring under it."""
    with pytest.raises(SystemExit):
        _parse(("eval",), "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens MAX_NEW_TOKENS Tokens generated per prompt. [eval.max_new_tokens; default 256]" in text
    assert "--verify {block,token}" in text and "--dtype {auto,bfloat16,float16,float32}" in text
    # A flag that turns its field off says so first (its field's description is of the field, not of the flag).
    assert "--no-progress eval.progress = false. eval.progress: Show a progress bar. [default true]" in text
    args = _parse(("eval",), "--max-new-tokens", "8", "--no-progress", "--target", "T")
    assert options.flags_given(args) == [
        ("--target T", "target.path", "T"),
        ("--max-new-tokens 8", "eval.max_new_tokens", 8),
        ("--no-progress", "eval.progress", False),
    ]
    with pytest.raises(SystemExit):
        _parse(("eval",), "--limit", "many")  # argparse checks the field's type
    assert "argument --limit: invalid int value: 'many'" in capsys.readouterr().err


def test_a_bad_shortcut_value_names_the_flag_and_the_field(capsys):
    assert cli.main(["eval", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens 0: eval.max_new_tokens = 0: must be >= 1" in capsys.readouterr().err
    assert cli.main(["prepare", "--data", "x.jsonl", "--out", "o", "--workers", "0"]) == 2
    assert "--workers 0: prepare.workers = 0: must be >= 1 or null" in capsys.readouterr().err


def test_a_shortcut_and_an_override_that_disagree_are_an_error(capsys):
    assert cli.main(["eval", "--max-new-tokens", "8", "eval.max_new_tokens=9"]) == 2
    assert "--max-new-tokens 8 and eval.max_new_tokens=9 disagree: give one of them" in capsys.readouterr().err
    cfg = options.load(_parse(("eval",), "--max-new-tokens", "8", "eval.max_new_tokens=8"))
    assert cfg.eval.max_new_tokens == 8  # the same value twice is no conflict


def test_required_settings_name_their_flags_and_fields(tmp_path, capsys):
    assert cli.main(["regenerate", "--data", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "required: --out, --target (or regenerate.out, target.path in --config or as overrides)" in err
    config = tmp_path / "c.yaml"
    config.write_text("target: {path: somewhere}\nregenerate: {out: o.jsonl}\n")
    args = _parse(("regenerate",), "--config", str(config), "--data", "x.jsonl")
    options.require(args, options.load(args), "regenerate.data", "regenerate.out", named=("target.path",))


def test_nproc_relaunches_the_same_command_line():
    args = _parse(("train",), "--nproc", "2", "--out", "o", "--resume", "optim.lr=1e-3")
    assert options.relaunch_argv(args, "train") == ["train", "--out", "o", "--resume", "optim.lr=1e-3"]
    args = _parse(("features",), "--config", "c.yaml", "--out", "s3://b/f", "--nproc", "2")
    assert options.relaunch_argv(args, "features") == ["features", "--config", "c.yaml", "--out", "s3://b/f"]
