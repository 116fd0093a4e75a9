"""CheckpointManager: exact round trip (weights, optimizer, scheduler, RNG, trainer state), keep-N pruning,
partial / corrupt checkpoints skipped with a warning, atomicity when a save dies half-way."""

import copy
import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from flashdraft.drafter import DFlashDraftModel
from flashdraft.tiny_configs import tiny_config
from flashdraft.train import checkpoint
from flashdraft.train.checkpoint import CheckpointError, CheckpointManager

LOGGER = "flashdraft.train.checkpoint"


def make_run(seed=0, fused=False, block_size=4):
    torch.manual_seed(seed)
    drafter = DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=4),
        num_layers=1,
        block_size=block_size,
        target_layer_ids=[1, 2],
        mask_token_id=250,
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return drafter, optimizer, scheduler


def train_step(drafter, optimizer, scheduler):
    """One step on inputs drawn from the global RNG, so a wrongly restored RNG changes the result."""
    hidden = drafter(
        position_ids=torch.arange(7)[None],
        noise_embedding=torch.randn(1, 4, 64),
        target_hidden=torch.randn(1, 3, 128),
    )
    hidden.pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def trained(steps=2, **kwargs):
    run = make_run(**kwargs)
    for _ in range(steps):
        train_step(*run)
    return run


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def draws():
    return torch.rand(5), random.random(), np.random.rand(3).tolist()


def saved_steps(manager):
    return [step for step, _ in manager.checkpoints()]


# ---- round trip -------------------------------------------------------------------------------------------------


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


def test_files_are_weights_only_loadable_and_manifest_lists_everything(tmp_path):
    path = CheckpointManager(tmp_path).save(3, *trained(), {"epoch": 0})
    manifest = json.loads((path / "MANIFEST.json").read_text())
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in files if f != "MANIFEST.json"]
    assert {"drafter/config.json", "drafter/model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt"} <= set(files)
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(path / name, weights_only=True)
    assert json.loads((path / "trainer_state.json").read_text()) == {"epoch": 0, "step": 3}
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_drafter_dir_loads_with_from_pretrained(tmp_path):
    drafter, optimizer, scheduler = trained()
    path = CheckpointManager(tmp_path).save(2, drafter, optimizer, scheduler, {})
    loaded = DFlashDraftModel.from_pretrained(path / "drafter")
    assert_same(loaded.state_dict(), drafter.state_dict(), "weights")
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids) == (4, 250, [1, 2])


def test_pickled_objects_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": LambdaLR}, path)  # a class reference: needs the unrestricted unpickler
    with pytest.raises(CheckpointError, match="evil.pt.*weights_only"):
        checkpoint._torch_load(path)


def test_trainer_state_must_be_json_and_agree_on_the_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"trainer_state\['bad'\] is not JSON-serialisable"):
        manager.save(1, *make_run(), {"bad": torch.zeros(1)})
    with pytest.raises(ValueError, match="trainer_state\\['step'\\] = 5 but the checkpoint is for step 1"):
        manager.save(1, *make_run(), {"step": 5})
    assert manager.checkpoints() == [] and manager.latest() is None


def test_load_refuses_a_drafter_of_another_recipe(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, *make_run(), {})
    with pytest.raises(CheckpointError, match="block_size = 4, but the drafter being resumed has 8"):
        manager.load(manager.latest(), *make_run(block_size=8))


# ---- keep N -----------------------------------------------------------------------------------------------------


def test_keeps_the_most_recent_n(tmp_path):
    run = make_run()
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        manager.save(step, *run, {})
    assert saved_steps(manager) == [30, 40]
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "step_00000030", "step_00000040"]
    manager.save(40, *run, {"again": True})  # same step: replaced in place
    assert saved_steps(manager) == [30, 40]
    assert manager.load(manager.latest(), *run) == {"again": True, "step": 40}


def test_saving_an_earlier_step_drops_the_abandoned_newer_ones(tmp_path):
    run = make_run()
    manager = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3):
        manager.save(step, *run, {})
    manager.save(2, *run, {})  # the run resumed from step 1 and reached step 2 again
    assert saved_steps(manager) == [1, 2]
    assert manager.latest().name == "step_00000002"


# ---- partial and corrupt checkpoints ----------------------------------------------------------------------------


def flip_byte(path):
    file = path / "drafter" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40
    file.write_bytes(bytes(data))
    return "drafter/model.safetensors: sha256 differs"


def drop_manifest(path):
    (path / "MANIFEST.json").unlink()
    return "no MANIFEST.json"


def truncate(path):
    file = path / "optimizer.pt"
    file.write_bytes(file.read_bytes()[:100])
    return "optimizer.pt: 100 bytes"


def remove_file(path):
    (path / "rng.pt").unlink()
    return "rng.pt is missing"


@pytest.mark.parametrize("damage", [flip_byte, drop_manifest, truncate, remove_file])
def test_corrupt_newest_falls_back_with_a_warning(tmp_path, caplog, damage):
    run = trained()
    manager = CheckpointManager(tmp_path, keep=3)
    good = manager.save(1, *run, {"which": "good"})
    bad = manager.save(2, *run, {"which": "bad"})
    assert manager.latest() == bad
    reason = damage(bad)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager.latest() == good
    assert "step_00000002" in caplog.text and reason in caplog.text
    with pytest.raises(CheckpointError, match=reason):
        manager.load(bad, *make_run())
    assert manager.load(manager.latest(), *make_run()) == {"which": "good", "step": 1}


def test_no_usable_checkpoint_gives_none(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    drop_manifest(manager.save(1, *make_run(), {}))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager.latest() is None
    assert "no MANIFEST.json" in caplog.text


def test_tmp_dirs_are_ignored_then_cleaned(tmp_path, caplog):
    run = make_run()
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, *run, {})
    # What a kill just before the final rename leaves: a complete-looking directory under a temporary name.
    shutil.copytree(good, manager.root / ".tmp-step_00000002-abc")
    (manager.root / ".tmp-step_00000003-def").mkdir()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager.latest() == good
    assert caplog.text == ""
    manager.save(2, *run, {})
    assert not list(manager.root.glob(".tmp-*"))


# ---- a save that dies -------------------------------------------------------------------------------------------


def test_crash_mid_save_leaves_the_previous_state(tmp_path, monkeypatch):
    run = trained()
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, *run, {})
    real_save = checkpoint._torch_save

    def dying_save(obj, path):
        if path.name == "scheduler.pt":
            raise OSError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(checkpoint, "_torch_save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, *run, {})
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "step_00000001"]
    assert manager.latest() == good
    assert (manager.root / "latest").read_text().strip() == "step_00000001"


def test_crash_after_the_rename_keeps_the_complete_new_checkpoint(tmp_path, monkeypatch):
    run = trained()
    manager = CheckpointManager(tmp_path)
    manager.save(1, *run, {})

    def dying_pointer(self, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(CheckpointManager, "_write_pointer", dying_pointer)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, *run, {})
    assert manager.latest().name == "step_00000002"
    assert manager.load(manager.latest(), *make_run()) == {"step": 2}
