"""RNG states: the global RNGs and named generators continue exactly where they were saved."""

import random

import numpy as np
import pytest
import torch

from flashdraft.train.checkpoint import CheckpointError, CheckpointManager

from . import assert_same, draws, make_run


def test_rng_states_and_named_generators_are_restored(tmp_path):
    drafter, optimizer, scheduler = make_run()
    anchors = torch.Generator().manual_seed(123)
    manager = CheckpointManager(tmp_path)
    manager.save(0, drafter, optimizer, scheduler, {}, generators={"anchors": anchors})
    expected = (*draws(), torch.randint(0, 1000, (4,), generator=anchors))
    torch.manual_seed(99), random.seed(99), np.random.seed(99), anchors.manual_seed(99)
    manager.load(manager.latest(), drafter, optimizer, scheduler, generators={"anchors": anchors})
    assert_same((*draws(), torch.randint(0, 1000, (4,), generator=anchors)), expected)
    with pytest.raises(CheckpointError, match="no state for generator 'other'"):
        manager.load(manager.latest(), drafter, optimizer, scheduler, generators={"other": torch.Generator()})
