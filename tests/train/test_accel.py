"""How the drafter runs in a training step: train.attention / train.compile resolved per device, the mask rule."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDraftModel
from flashdraft.drafter.recipe import build_blocks, dense_block_mask
from flashdraft.tiny_configs import tiny_config
from flashdraft.train.accel import (
    attention_kind,
    compile_enabled,
    compile_layers,
    drafter_mask,
    mask_rule,
    static_shapes,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_attention_kind_per_device():
    assert attention_kind("auto", CPU) == "sdpa" and attention_kind("auto", CUDA) == "flex"
    assert attention_kind("sdpa", CUDA) == "sdpa" and attention_kind("flex", CUDA) == "flex"
    with pytest.raises(ValueError, match="train.attention = flex needs a CUDA device"):
        attention_kind("flex", CPU)
    with pytest.raises(ValueError, match="train.attention = 'dense'"):
        attention_kind("dense", CPU)


def test_compile_setting_per_device():
    assert compile_enabled("auto", CUDA) and not compile_enabled("auto", CPU)
    assert compile_enabled(True, CPU) and not compile_enabled(False, CUDA)
    with pytest.raises(ValueError, match="train.compile"):
        compile_enabled("yes please", CPU)


def test_static_shapes_follow_compile_unless_set():
    assert static_shapes("auto", True, CPU) and static_shapes("auto", "auto", CUDA)
    assert not static_shapes("auto", "auto", CPU) and not static_shapes("auto", False, CUDA)
    assert static_shapes(True, False, CPU) and not static_shapes(False, True, CUDA)
    with pytest.raises(ValueError, match="train.static_shapes"):
        static_shapes("always", True, CPU)
    with pytest.raises(ConfigError, match="train.static_shapes"):
        load_config(None, ["train.static_shapes=sometimes"])


def test_config_fields_validate():
    cfg = load_config(None, ["train.attention=sdpa", "train.compile=false"])
    assert (cfg.train.attention, cfg.train.compile) == ("sdpa", False)
    assert load_config(None, []).train.compile == "auto"
    with pytest.raises(ConfigError, match="train.attention"):
        load_config(None, ["train.attention=xformers"])
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=sometimes"])


def _drafter(**overrides):
    torch.manual_seed(0)
    return DFlashDraftModel.from_target(tiny_config("qwen3", num_layers=8), num_layers=2, block_size=4,
                                        mask_token_id=5, **overrides)  # fmt: skip


def _batch():
    ids = torch.arange(30).view(2, 15) % 11 + 6
    loss_mask = torch.ones_like(ids)
    return build_blocks(ids, loss_mask, [torch.tensor([2, 5, 9]), torch.tensor([4])], 4, mask_token_id=5)


def test_mask_follows_the_layers_rule():
    full, sliding = _drafter(), _drafter(layer_types=["sliding_attention"] * 2, sliding_window=3)
    batch = _batch()
    assert mask_rule(full.config) == {"window": None, "causal": False}
    assert mask_rule(sliding.config) == {"window": 3, "causal": True}
    assert torch.equal(drafter_mask(batch, full.config, "sdpa"), dense_block_mask(batch))
    dense = drafter_mask(batch, sliding.config, "sdpa")
    assert torch.equal(dense, dense_block_mask(batch, window=3, causal=True))
    assert not torch.equal(dense, dense_block_mask(batch))
    block = drafter_mask(batch, sliding.config, "flex")
    assert isinstance(block, BlockMask)
    B, _, Q, K = dense.shape
    assert torch.equal(create_mask(block.mask_mod, B, 1, Q, K, device="cpu"), dense)


def test_mixed_layer_rules_are_a_clear_error():
    mixed = _drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    with pytest.raises(ValueError, match="drafter.overrides.layer_types"):
        mask_rule(mixed.config)


def test_compile_layers_keeps_parameter_names():
    drafter = _drafter()
    names = [n for n, _ in drafter.named_parameters()]
    assert not compile_layers(drafter, "auto", CPU)
    assert compile_layers(drafter, True, CPU)  # wraps lazily: nothing compiles until a forward
    assert [n for n, _ in drafter.named_parameters()] == names
    assert list(drafter.state_dict()) == [n for n in _drafter().state_dict()]
