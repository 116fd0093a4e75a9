"""The one loader of a target: the bundled one, a directory or a hub id — whole (decoding) or frozen (training)."""

import pytest
import torch

from flashdraft import bundled
from flashdraft.config import TargetConfig
from flashdraft.drafter.config import build_target_layer_ids
from flashdraft.fastpath.patch import is_patched
from flashdraft.target import load_causal_lm, load_frozen_target, load_tokenizer, target_directory
from flashdraft.target.tiny import random_tiny_model


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_load_causal_lm_of_a_directory_is_the_saved_model(tmp_path, family):
    saved = random_tiny_model(family, 4, seed=5)
    saved.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    model = load_causal_lm(tmp_path, dtype=torch.float64, device="cpu")
    assert not model.training and next(model.parameters()).dtype == torch.float64
    if family == "qwen3_5":
        assert is_patched(model)  # the device-aware fast path, not fla's GPU-only kernels
    with torch.no_grad():
        want = saved.double().eval()(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-10, atol=1e-10)


def test_load_causal_lm_bundled_auto_and_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = load_causal_lm(bundled.BUNDLED)  # auto: the CPU, float32
    assert model.config.num_hidden_layers == 8 and is_patched(model) and not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert not getattr(model, "use_kernels", False)  # no Hub kernels swapped in
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="device = cuda, but no CUDA device"):
        load_causal_lm(bundled.BUNDLED, device="cuda")


def test_the_bundled_target_loads_like_any_directory():
    assert target_directory(bundled.BUNDLED) == bundled.target_dir()
    assert len(load_tokenizer(bundled.BUNDLED)) == len(bundled.load_tokenizer())


def test_load_frozen_target_bundled_spreads_num_features_layers():
    target = load_frozen_target(TargetConfig(), device="cpu", dtype=torch.float32, num_features=3)
    assert target.target_layer_ids == build_target_layer_ids(8, 3) and target.name_or_path == bundled.BUNDLED
    chosen = load_frozen_target(TargetConfig(), layer_ids=[1, 4], device="cpu", dtype=torch.float32)
    assert chosen.target_layer_ids == [1, 4] and len(chosen.decoder.layers) == 5


def test_load_frozen_target_takes_the_dtype_of_its_config():
    target = load_frozen_target(TargetConfig(dtype="bfloat16"), layer_ids=[1], device="cpu")
    assert target.dtype == torch.bfloat16


def test_load_frozen_target_of_a_directory_captures_the_saved_model(tmp_path):
    random_tiny_model("qwen3_5", 4, seed=3).save_pretrained(tmp_path)
    target = load_frozen_target(
        TargetConfig(path=str(tmp_path)), layer_ids=None, device="cpu", dtype=torch.float32, num_features=2
    )
    assert target.target_layer_ids == build_target_layer_ids(4, 2) and target.name_or_path == str(tmp_path)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    full = random_tiny_model("qwen3_5", 4, seed=3).eval()
    with torch.no_grad():
        hidden = full(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hidden[i + 1] for i in target.target_layer_ids], dim=-1)
    torch.testing.assert_close(target.capture(ids), want)


def test_the_bundled_frozen_target_is_the_whole_one_truncated():
    """The frozen bundled target (read truncated from disk) captures what the whole bundled model computes."""
    whole = load_causal_lm(bundled.BUNDLED, dtype=torch.float32, device="cpu")
    frozen = load_frozen_target(bundled.BUNDLED, layer_ids=[1, 3], device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 1000, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = whole(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(frozen.capture(ids), torch.cat([hidden[2], hidden[4]], dim=-1))
