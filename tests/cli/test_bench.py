"""`flashdraft bench train-step`: the table and JSON it writes, the option a bad value names."""

import json

import torch

from flashdraft import cli


def test_cli_bench_train_step_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(
        [
            "bench",
            "train-step",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--seq",
            "40",
            "--json",
            str(out),
            "recipe.num_anchors=4",
            "train.batch_size=1",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "FLOPs per step" in printed and "flashdraft" in printed and "drafter_bwd" in printed
    report = json.loads(out.read_text())
    assert report["machine"]["torch"] == torch.__version__
    (row,) = report["results"]
    assert row["seq"] == 40 and row["seq_tokens"] == 40 and row["step_s"] > 0


def test_cli_bench_bad_input_names_the_option(capsys):
    assert cli.main(["bench", "train-step", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
