"""Whether the drafter's layers are compiled in a training step: train.compile / train.static_shapes resolved per
device, the config fields, and compiled layers keeping their parameter names."""

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDraftModel
from flashdraft.target.tiny import tiny_config
from flashdraft.train.compile import compile_enabled, compile_layers, static_shapes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


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
    return DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=8), num_layers=2, block_size=4, mask_token_id=5, **overrides
    )


def test_compile_layers_keeps_parameter_names():
    drafter = _drafter()
    names = [n for n, _ in drafter.named_parameters()]
    assert not compile_layers(drafter, "auto", CPU)
    assert compile_layers(drafter, True, CPU)  # wraps lazily: nothing compiles until a forward
    assert [n for n, _ in drafter.named_parameters()] == names
    assert list(drafter.state_dict()) == [n for n in _drafter().state_dict()]
