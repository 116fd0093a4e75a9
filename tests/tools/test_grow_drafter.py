"""tools/grow_drafter.py: a grown drafter drafts exactly what the original does, every new weight
gets a gradient from the first step, it saves and loads as a drafter of its new size, and bad sizes are refused."""

import pytest
import torch

from flashdraft import bundled
from flashdraft.drafter import DFlashDraftModel
from tests.scripts import TOOLS, load_script


def load_grow():
    return load_script(TOOLS / "grow_drafter.py")


@pytest.fixture(scope="module")
def shipped():
    return DFlashDraftModel.from_pretrained(bundled.drafter_dir()).float()


@pytest.mark.parametrize(("extra", "width"), [(2, None), (0, 1280), (1, 960)])
def test_a_grown_drafter_computes_the_same_function_and_every_new_weight_learns(shipped, extra, width):
    grow = load_grow()
    grown = grow.grow(shipped, extra, width)
    assert grown.config.num_hidden_layers == shipped.config.num_hidden_layers + extra
    assert grown.config.intermediate_size == (width or shipped.config.intermediate_size)
    assert len(grown.config.layer_types) == grown.config.num_hidden_layers
    # Same outputs on fresh random inputs, several of them, to float64 rounding (the grown model adds exact zeros).
    for seed in range(3):
        assert grow.output_difference(shipped, grown, seed=seed) <= grow.SAME_FUNCTION
    # The original is untouched, and a different drafter is told apart (the check can fail).
    other = grow.grow(shipped, extra, width)
    with torch.no_grad():
        other.layers[-1].mlp.down_proj.weight.add_(0.01)
    assert grow.output_difference(shipped, other) > 1e-4

    width0 = shipped.config.intermediate_size
    positions = torch.arange(40 + grown.block_size)[None]
    hidden = grown(
        position_ids=positions,
        noise_embedding=torch.randn(1, grown.block_size, grown.config.hidden_size),
        target_hidden=torch.randn(1, 40, grown.config.hidden_size * len(grown.target_layer_ids)),
    )
    hidden.square().sum().backward()
    new = [f"layers.{i}." for i in range(shipped.config.num_hidden_layers, grown.config.num_hidden_layers)]
    for name, weight in grown.named_parameters():
        if any(name.startswith(prefix) for prefix in new) and name.endswith(("o_proj.weight", "down_proj.weight")):
            assert weight.grad.abs().sum() > 0, name  # zero weights, but not a dead end
        if width and name.endswith("down_proj.weight"):
            assert weight.grad[:, width0:].abs().sum() > 0, name


def test_the_script_writes_a_loadable_drafter_and_refuses_bad_sizes(tmp_path, capsys):
    grow = load_grow()
    out = tmp_path / "grown"
    assert grow.main(["--drafter", str(bundled.drafter_dir()), "--out", str(out), "--extra-layers", "1"]) == 0
    loaded = DFlashDraftModel.from_pretrained(out)
    assert len(loaded.layers) == 4 and loaded.target_layer_ids == [1, 2, 3, 4, 5]
    assert loaded.mask_token_id == DFlashDraftModel.from_pretrained(bundled.drafter_dir()).mask_token_id
    assert "drafter.num_layers=4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="narrower than the drafter's 640"):
        grow.main(["--drafter", str(bundled.drafter_dir()), "--out", str(tmp_path / "x"), "--intermediate-size", "320"])
    with pytest.raises(SystemExit, match="must be >= 0"):
        grow.main(["--drafter", str(bundled.drafter_dir()), "--out", str(tmp_path / "y"), "--extra-layers", "-1"])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
