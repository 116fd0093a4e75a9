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


def test_auto_compiles_only_runs_long_enough_to_pay_back():
    """The rule of `auto` on a GPU: compile when 10% of the run's compute at the GPU's peak reaches the minute a
    compile costs; the bundled default never does, a 27B-shaped run of a few hundred steps does."""
    from flashdraft.train.compile import COMPILE_GAIN, COMPILE_SECONDS, compile_pays_back

    h200 = 790e12
    threshold = COMPILE_SECONDS / COMPILE_GAIN * h200
    assert compile_pays_back(threshold, h200) == (True, pytest.approx(600.0))
    assert not compile_pays_back(0.99 * threshold, h200)[0]
    assert compile_pays_back(threshold * 400 / 790, None)[0]  # an unknown GPU: a nominal 400 TFLOP/s
    # The bundled default: 192 steps of a 6.7M target and a 3-layer drafter, about 0.1 s at the H200's peak.
    tiny_step = 2 * 6.7e6 * 4 * 320 + 6 * 8e6 * 4 * 32 * 16 + 4 * 1088 * 256 * 4 * 32 * 15
    assert not compile_pays_back(192 * tiny_step, h200)[0]
    # The 27B shape at 3072 tokens: 270 TFLOP per step (bench/RESULTS.md); pays back from about 1760 steps.
    assert not compile_pays_back(1000 * 270e12, h200)[0] and compile_pays_back(2000 * 270e12, h200)[0]


@pytest.mark.parametrize("pays", [False, True])
def test_resolve_auto_compile_sets_only_the_autos_on_cuda(pays):
    from flashdraft.train.compile import resolve_auto_compile

    flops = 1e18 if pays else 1e12
    cfg = load_config(None, [])
    assert resolve_auto_compile(cfg, CUDA, flops, 790e12) == {
        "train.compile": pays,
        "target.compile": pays,
        "train.attention": "flex" if pays else "sdpa",
    }
    assert (cfg.train.compile, cfg.target.compile, cfg.train.attention) == (pays, pays, "flex" if pays else "sdpa")
    assert static_shapes(cfg.train.static_shapes, cfg.train.compile, CUDA) is pays
    given = load_config(None, ["train.compile=true", "train.attention=sdpa", "target.shard=true"])
    assert resolve_auto_compile(given, CUDA, flops, 790e12) == {}
    cpu = load_config(None, [])
    assert resolve_auto_compile(cpu, CPU, 1e30, None) == {} and cpu.train.compile == "auto"
