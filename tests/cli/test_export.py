"""`flashdraft export`: the command lines it prints, its exit codes and one-line errors."""

import argparse

import pytest

from flashdraft.cli import export as export_cli
from tests.test_export import write_target


def run(capsys, *argv):
    parser = argparse.ArgumentParser(prog="flashdraft")
    export_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", *argv])
    code = args.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_success_prints_the_commands(tmp_path, drafter_dir, capsys):
    target = write_target(tmp_path / "target")
    code, out, err = run(capsys, "--drafter", str(drafter_dir), "--out", str(tmp_path / "out"), "--target", str(target))
    assert code == 0, err
    assert "--speculative-num-draft-tokens 6" in out and '"num_speculative_tokens":5' in out


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"hidden_size": 128}, "hidden_size: drafter 64, target 128"),
        ({"vocab_size": 200}, "vocab_size: target 200 has no row for the drafter's mask_token_id 250"),
        ({"num_hidden_layers": 12}, "num_target_layers: drafter 8, target num_hidden_layers 12"),
        ({"num_hidden_layers": 6}, "target_layer_ids: drafter reads target layers [6] (of [2, 6]), target num_hidden"),
    ],
)
def test_cli_mismatch_exits_2_naming_field_and_values(tmp_path, drafter_dir, capsys, changes, expected):
    target = write_target(tmp_path / "target", **changes)
    code, out, err = run(capsys, "--drafter", str(drafter_dir), "--out", str(tmp_path / "out"), "--target", str(target))
    assert code == 2
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_cli_missing_target_or_drafter(tmp_path, drafter_dir, capsys):
    code, _, err = run(capsys, "--drafter", str(drafter_dir), "--out", str(tmp_path / "o"), "--target", str(tmp_path))
    assert code == 2 and "no config.json" in err
    code, _, err = run(capsys, "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and "--drafter" in err and "no config.json" in err and "Traceback" not in err
