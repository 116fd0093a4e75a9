"""flashdraft export: reference-format output, README command lines, checks against the target (the command's exit
codes: tests/cli/test_export.py)."""

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
