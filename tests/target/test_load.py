"""The one loader of a target: the bundled one, a directory or a hub id — whole (decoding) or frozen (training)."""

import pytest
import torch

from flashdraft import bundled
from flashdraft.config import TargetConfig
from flashdraft.drafter.config import build_target_layer_ids
from flashdraft.fastpath.patch import is_patched
from flashdraft.target import build_target, load_model
from flashdraft.target.tiny import build_tiny_target


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_load_model_of_a_directory_is_the_saved_model(tmp_path, family):
    saved = build_tiny_target(family, 4, seed=5)
    saved.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    model = load_model(tmp_path, dtype=torch.float64, device="cpu")
    assert not model.training and next(model.parameters()).dtype == torch.float64
    if family == "qwen3_5":
        assert is_patched(model)  # the device-aware fast path, not fla's GPU-only kernels
    with torch.no_grad():
        want = saved.double().eval()(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-10, atol=1e-10)


def test_load_model_bundled_and_missing(tmp_path):
    model = load_model(bundled.BUNDLED, dtype=torch.float32, device="cpu")
    assert model.config.num_hidden_layers == 8 and is_patched(model) and not model.training
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


def test_build_target_bundled_spreads_num_features_layers():
    target = build_target(TargetConfig(), layer_ids=None, device="cpu", dtype=torch.float32, num_features=3)
    assert target.target_layer_ids == build_target_layer_ids(8, 3)
    chosen = build_target(TargetConfig(), layer_ids=[1, 4], device="cpu", dtype=torch.float32)
    assert chosen.target_layer_ids == [1, 4] and len(chosen.decoder.layers) == 5


def test_build_target_directory_matches_load_target(tmp_path):
    build_tiny_target("qwen3_5", 4, seed=3).save_pretrained(tmp_path)
    target = build_target(
        TargetConfig(path=str(tmp_path)), layer_ids=None, device="cpu", dtype=torch.float32, num_features=2
    )
    assert target.target_layer_ids == build_target_layer_ids(4, 2) and target.name_or_path == str(tmp_path)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    full = build_tiny_target("qwen3_5", 4, seed=3).eval()
    with torch.no_grad():
        hidden = full(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hidden[i + 1] for i in target.target_layer_ids], dim=-1)
    torch.testing.assert_close(target.capture(ids), want)
