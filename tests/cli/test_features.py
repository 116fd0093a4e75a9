"""`flashdraft features`: the command's own checks (what it writes: tests/data/test_features.py)."""

from flashdraft.cli import main


def test_features_cli_needs_a_destination(tmp_path):
    assert main(["features", "train.max_steps=1"]) == 2
