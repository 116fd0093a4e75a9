"""What a run loads before its first step."""

from types import SimpleNamespace

import torch

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.train.setup import load_inputs, step_blocks


def _cfg(out, *extra):
    return load_config(bundled.ASSETS / "train.yaml", ["data.eval_limit=1", f"log.out={out}", *extra])


def test_target_compile_reaches_the_frozen_target(tmp_path):
    """`target.compile` compiles the glue of the target the trainer (and `flashdraft features`) loads; auto leaves
    it eager on the CPU. torch.compile is lazy, so nothing compiles here."""
    for setting, compiled in (("false", False), ("true", True), ("auto", False)):
        cfg = _cfg(tmp_path / setting, f"target.compile={setting}")
        target = load_inputs(cfg, tmp_path / setting, console=None)[2]
        assert target.glue_compiled is compiled


def test_revealing_blocks_keeps_the_anchors():
    """recipe.reveal draws after the anchors: the same anchors with and without it, some blocks revealed, and the
    same draw again for the same (seed, epoch, sample)."""
    s = SimpleNamespace(drafter=SimpleNamespace(block_size=8, mask_token_id=999))
    ids, mask = torch.arange(200).view(2, 100), torch.ones(2, 100, dtype=torch.long)
    blocks = lambda *extra: step_blocks(s, load_config(None, ["recipe.num_anchors=16", *extra]), ids, mask, [3, 4], 1)
    plain, shown = blocks(), blocks("recipe.reveal=0.5")
    assert torch.equal(plain.anchors, shown.anchors)
    revealed = (shown.block_ids.view(2, 16, 8) != 999).sum(-1) - 1  # the anchor's token is always shown
    assert 0 < int((revealed > 0).sum()) < 32 and int((plain.block_ids.view(2, 16, 8) != 999).sum()) == 32
    assert torch.equal(blocks("recipe.reveal=0.5").block_ids, shown.block_ids)
