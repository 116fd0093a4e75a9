"""What a save writes: a drafter directory that loads on its own, and a trainer state that is JSON and agrees on
the step."""

import pytest
import torch

from flashdraft.drafter import DFlashDraftModel
from flashdraft.train.checkpoint import CheckpointManager

from . import assert_same, make_run, trained


def test_drafter_dir_loads_with_from_pretrained(tmp_path):
    drafter, optimizer, scheduler = trained()
    path = CheckpointManager(tmp_path).save(2, drafter, optimizer, scheduler, {})
    loaded = DFlashDraftModel.from_pretrained(path / "drafter")
    assert_same(loaded.state_dict(), drafter.state_dict(), "weights")
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids) == (4, 250, [1, 2])


def test_trainer_state_must_be_json_and_agree_on_the_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"trainer_state\['bad'\] is not JSON-serialisable"):
        manager.save(1, *make_run(), {"bad": torch.zeros(1)})
    with pytest.raises(ValueError, match="trainer_state\\['step'\\] = 5 but the checkpoint is for step 1"):
        manager.save(1, *make_run(), {"step": 5})
    assert manager.checkpoints() == [] and manager.latest() is None
