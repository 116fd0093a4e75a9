"""Loading: an exact round trip (weights, optimizer, scheduler, RNG, trainer state), pickled objects refused, a
drafter of another recipe refused, and the bytes loaded are the bytes hashed."""

import copy
import os

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from flashdraft.train.checkpoint import CheckpointError, CheckpointManager, load

from . import assert_same, draws, make_run, train_step, trained


@pytest.mark.parametrize("fused", [False, True])
def test_round_trip_continues_bit_identically(tmp_path, fused):
    drafter, optimizer, scheduler = trained(fused=fused)
    manager = CheckpointManager(tmp_path)
    state = {"epoch": 1, "batch_in_epoch": 7, "tokens_seen": 12345, "note": "x"}
    path = manager.save(2, drafter, optimizer, scheduler, state)
    assert path == tmp_path / "checkpoints" / "step_00000002"
    weights = {k: v.clone() for k, v in drafter.state_dict().items()}
    opt_state, sched_state = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict())
    train_step(drafter, optimizer, scheduler)
    expected_after = {k: v.clone() for k, v in drafter.state_dict().items()}
    expected_draws = draws()

    fresh = make_run(seed=1, fused=fused)  # other weights, no optimizer state, scheduler at 0
    restored = manager.load(manager.latest(), *fresh)
    assert restored == {**state, "step": 2}
    assert_same(fresh[0].state_dict(), weights, "weights")
    assert_same(fresh[1].state_dict(), opt_state, "optimizer")
    assert_same(fresh[2].state_dict(), sched_state, "scheduler")
    train_step(*fresh)
    assert_same(fresh[0].state_dict(), expected_after, "weights one step later")
    assert_same(draws(), expected_draws, "random numbers")


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": LambdaLR}, path)  # a class reference: needs the unrestricted unpickler
    with pytest.raises(CheckpointError, match="evil.pt.*weights_only"):
        load.torch_load(path)


def test_load_refuses_a_drafter_of_another_recipe(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, *make_run(), {})
    with pytest.raises(CheckpointError, match="block_size = 4, but the drafter being resumed has 8"):
        manager.load(manager.latest(), *make_run(block_size=8))


def change_in_place(file, offset=-3):
    """Flip a byte of `file`, keeping its size and modification time (a bit rot or a careless tool)."""
    stat = file.stat()
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size and file.stat().st_mtime_ns == stat.st_mtime_ns


@pytest.mark.parametrize("name", ["drafter/model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_a_file_changed_after_verification_with_the_same_size_and_mtime_is_not_loaded(tmp_path, name):
    run = trained()
    manager = CheckpointManager(tmp_path)
    path = manager.save(2, *run, {"note": "abc"})
    assert manager.latest() == path  # verified once...
    change_in_place(path / name)  # ...then changed, size and mtime kept
    fresh = make_run(seed=1)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{path / name}: sha256 differs from MANIFEST.json"):
        manager.load(path, *fresh)
    # Nothing was restored: the bytes are all checked before any of them is used.
    assert_same(fresh[0].state_dict(), before, "weights untouched")
    assert fresh[1].state_dict()["state"] == {}
