"""The layouts `flashdraft export` writes: DeepSpec's for DSpark (read back by flashdraft as the same drafter, the
target's embedding and LM head beside it), speculators' (its layer-id convention and draft counts), and the
refusals. speculators itself reads them in tests/interop/test_speculators.py."""

import json

import pytest
import torch
from safetensors.torch import load_file

from flashdraft import bundled, export
from flashdraft.drafter import DFlashDraftModel


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    """A DSpark drafter for the bundled target (random weights, a gated Markov head)."""
    target = json.loads((bundled.target_dir() / "config.json").read_text())
    torch.manual_seed(0)
    from transformers import Qwen3_5TextConfig

    drafter = DFlashDraftModel.from_target(
        Qwen3_5TextConfig(**{k: v for k, v in target.items() if k not in ("architectures",)}),
        num_layers=1,
        block_size=6,
        target_layer_ids=[1, 3],
        mask_token_id=1024,
        family="dspark",
        family_fields={"markov_rank": 16, "markov_head_type": "gated"},
    )
    path = tmp_path_factory.mktemp("dspark") / "drafter"
    drafter.save_pretrained(path)
    return path


def test_deepspec_layout_carries_the_fields_at_the_top_and_the_targets_head(dspark_dir, tmp_path):
    out = export.export_drafter(dspark_dir, tmp_path / "out", target=bundled.target_dir())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    for key, value in {"block_size": 6, "mask_token_id": 1024, "target_layer_ids": [1, 3], "markov_rank": 16}.items():
        assert config[key] == value, key
    assert config["markov_head_type"] == "gated" and config["sample_from_anchor"] is True
    weights = load_file(out / "model.safetensors")
    target = load_file(bundled.target_dir() / "model.safetensors")
    embedding = target["model.embed_tokens.weight"]
    assert torch.equal(weights["embed_tokens.weight"], embedding.to(weights["fc.weight"].dtype))
    assert torch.equal(weights["lm_head.weight"], weights["embed_tokens.weight"])  # the bundled target ties them
    # flashdraft reads DeepSpec's layout back as the same drafter.
    original = DFlashDraftModel.from_pretrained(dspark_dir)
    loaded = DFlashDraftModel.from_pretrained(out)
    assert loaded.family == "dspark" and loaded.config.dflash_config["target_layer_ids"] == [1, 3]
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert "DSPARK" in (out / "README.md").read_text()


def test_speculators_layout_counts_layers_from_the_embedding_and_names_the_verifier(dspark_dir, tmp_path):
    out = export.export_drafter(dspark_dir, tmp_path / "out", target=bundled.target_dir(), layout="speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["aux_hidden_state_layer_ids"] == [2, 4]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6  # the anchor drafts too
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(bundled.target_dir().resolve())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["markov_head_type"] == "gated" and config["sample_from_anchor"] is True
    assert "embed_tokens.weight" not in load_file(out / "model.safetensors")


@pytest.mark.parametrize(
    "layout, target, message",
    [
        ("reference", True, "the reference layout holds dflash or dflash2 drafters, not dspark"),
        ("deepspec", False, "the deepspec layout carries the target's embedding and LM head"),
        ("onnx", True, "layout 'onnx': must be one of"),
    ],
)
def test_a_layout_that_cannot_hold_the_drafter_is_refused(dspark_dir, tmp_path, layout, target, message):
    with pytest.raises(export.ExportError, match=message):
        export.export_drafter(
            dspark_dir, tmp_path / "out", target=bundled.target_dir() if target else None, layout=layout
        )
    assert not (tmp_path / "out").exists()
