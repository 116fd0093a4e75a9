"""flashdraft export: reference-format output, README command lines, checks against the target, CLI exit codes."""

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from flashdraft import export
from flashdraft.drafter import DFlashDraftModel
from flashdraft.target.tiny import tiny_config


@pytest.fixture
def drafter_dir(tmp_path):
    torch.manual_seed(0)
    model = DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=8), num_layers=2, block_size=6, target_layer_ids=[2, 6], mask_token_id=250
    )
    model.save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


def write_target(path, multimodal=False, **changes):
    text = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 8, **changes}
    config = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"}} if multimodal else text
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def run(capsys, *argv):
    parser = argparse.ArgumentParser(prog="flashdraft")
    export.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", *argv])
    code = args.run(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("multimodal", [False, True])
def test_export_with_target(tmp_path, drafter_dir, multimodal):
    target = write_target(tmp_path / "target", multimodal=multimodal)
    out = export.export_drafter(drafter_dir, tmp_path / "out", target=target / "config.json")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directories left"
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(drafter_dir / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in f.keys())
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    readme = (out / "README.md").read_text()
    path = str(out.resolve())
    assert f"--speculative-algorithm DFLASH --speculative-draft-model-path {path} --speculative-num-draft-tokens 6" in (
        readme
    )
    spec = json.dumps({"method": "dflash", "model": path, "num_speculative_tokens": 5}, separators=(",", ":"))
    assert f"vllm serve {target / 'config.json'} --speculative-config '{spec}'" in readme


def test_export_replaces_an_existing_directory(tmp_path, drafter_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    export.export_drafter(drafter_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "old.txt").exists()
    assert "vllm serve TARGET_MODEL" in (tmp_path / "out" / "README.md").read_text()


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
