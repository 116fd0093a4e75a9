"""CheckpointManager: exact round trip (weights, optimizer, scheduler, RNG, trainer state), keep-N pruning,
partial / corrupt checkpoints skipped with a warning, a manifest checked field by field and its format version
enforced, files it does not list never loaded, the bytes loaded are the bytes hashed, atomicity when a save dies
half-way, and saving only under the output directory's lock."""

import copy
import errno
import json
import logging
import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from flashdraft.drafter import DFlashDraftModel
from flashdraft.io import lock
from flashdraft.io.lock import OutputBusy, OutputLockLost
from flashdraft.io.space import StorageFull
from flashdraft.target.tiny import tiny_config
from flashdraft.train import checkpoint
from flashdraft.train.checkpoint import CheckpointError, CheckpointFormatError, CheckpointManager

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


def edit_manifest(path, edit):
    manifest = json.loads((path / "MANIFEST.json").read_text())
    edit(manifest)
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def garble_manifest(path):
    (path / "MANIFEST.json").write_bytes(b"\x00\xff not json at all")
    return "MANIFEST.json: garbled or truncated, not JSON"


def truncate_manifest(path):
    text = (path / "MANIFEST.json").read_bytes()
    (path / "MANIFEST.json").write_bytes(text[: len(text) // 2])
    return "MANIFEST.json: garbled or truncated, not JSON"


def manifest_without_files(path):
    (path / "MANIFEST.json").write_text('{"format": 1}')
    return "MANIFEST.json: garbled: not a manifest"


def manifest_without_format(path):
    edit_manifest(path, lambda m: m.pop("format"))
    return "MANIFEST.json: garbled: no format version"


def manifest_entry_garbled(path):
    edit_manifest(path, lambda m: m["files"]["optimizer.pt"].update(sha256="not-a-digest"))
    return "the entry of optimizer.pt is garbled"


def manifest_lists_an_unknown_file(path):
    (path / "notes.bin").write_bytes(b"?")
    edit_manifest(path, lambda m: m["files"].update({"notes.bin": {"size": 1, "sha256": "0" * 64}}))
    return "lists notes.bin, which is no part of a format-1 checkpoint"


def manifest_points_outside(path):
    edit_manifest(path, lambda m: m["files"].update({"../step_00000001/rng.pt": {"size": 1, "sha256": "0" * 64}}))
    return "'../step_00000001/rng.pt' is not the name of a file inside the checkpoint"


def manifest_misses_a_required_file(path):
    edit_manifest(path, lambda m: m["files"].pop("scheduler.pt"))
    return "does not list scheduler.pt"


@pytest.mark.parametrize(
    "damage",
    [
        flip_byte,
        drop_manifest,
        truncate,
        remove_file,
        garble_manifest,
        truncate_manifest,
        manifest_without_files,
        manifest_without_format,
        manifest_entry_garbled,
        manifest_lists_an_unknown_file,
        manifest_points_outside,
        manifest_misses_a_required_file,
    ],
)
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


# ---- verified, not trusted --------------------------------------------------------------------------------------


def test_another_format_version_stops_the_resume_instead_of_being_skipped(tmp_path):
    run = make_run()
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, *run, {})
    newer = manager.save(2, *run, {})
    edit_manifest(newer, lambda m: m.update(format=checkpoint.FORMAT_VERSION + 1))
    message = f"{newer / 'MANIFEST.json'}: checkpoint format 2, but this flashdraft reads format 1"
    # Falling back to step 1 would resume from it and then prune step 2 as an abandoned continuation.
    with pytest.raises(CheckpointFormatError, match=message):
        manager.latest()
    with pytest.raises(CheckpointFormatError, match=message):
        manager.load(newer, *make_run())
    assert saved_steps(manager) == [1, 2]


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


def test_files_the_manifest_does_not_list_are_named_and_never_loaded(tmp_path, caplog):
    from safetensors.torch import save_file

    drafter, optimizer, scheduler = trained()
    manager = CheckpointManager(tmp_path)
    path = manager.save(2, drafter, optimizer, scheduler, {})
    saved = {k: v.clone() for k, v in drafter.state_dict().items()}
    # Weights that a glob over drafter/*.safetensors would load last and let win.
    save_file({k: torch.zeros_like(v) for k, v in saved.items()}, path / "drafter" / "zz-extra.safetensors")
    (path / "stray.txt").write_text("left by a tool")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager.latest() == path
        fresh = make_run(seed=1)
        manager.load(path, *fresh)
    assert f"{path}: drafter/zz-extra.safetensors, stray.txt not listed in MANIFEST.json: ignored" in caplog.text
    assert_same(fresh[0].state_dict(), saved, "weights")


# ---- one writer ---------------------------------------------------------------------------------------------------


def test_saving_needs_the_output_directory_and_cleans_up_only_under_its_lock(tmp_path):
    run = make_run()
    manager = CheckpointManager(tmp_path)
    manager.save(1, *run, {})
    in_progress = manager.root / ".tmp-step_00000002-other"  # another run's save, under way
    in_progress.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock_file = lock.lock_path(tmp_path)
        lock_file.write_text(
            json.dumps(
                {
                    "pid": holder.pid,
                    "host": os.uname().nodename,
                    "command": "train",
                    "started": 0,
                    "token": "other",
                    "proc_start": lock._proc_start(holder.pid),
                }
            )
        )
        with pytest.raises(
            OutputBusy, match=f"{tmp_path} is in use by another run: flashdraft train, pid {holder.pid}"
        ):
            manager.save(2, *run, {})
    finally:
        holder.kill()
        holder.wait()
    assert in_progress.is_dir() and saved_steps(manager) == [1]
    manager.save(2, *run, {})  # the holder is gone: taken over, and its leftovers cleaned
    assert not in_progress.exists() and saved_steps(manager) == [1, 2] and not lock.lock_path(tmp_path).exists()


def test_a_lock_taken_over_meanwhile_stops_the_save_before_it_deletes_anything(tmp_path):
    run = make_run()
    manager = CheckpointManager(tmp_path, keep=1)
    with lock.hold(tmp_path, "train"):
        manager.save(1, *run, {})
        lock.lock_path(tmp_path).write_text(
            json.dumps({"pid": 4242, "host": "node-17", "command": "train", "started": 0, "token": "theirs"})
        )
        with pytest.raises(OutputLockLost, match="now names flashdraft train, pid 4242 on host node-17"):
            manager.save(2, *run, {})
    assert saved_steps(manager) == [1]


# ---- out of room -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_save_out_of_room_names_the_size_and_the_intact_checkpoint(tmp_path, monkeypatch, code):
    run = trained()
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, *run, {})
    real_save = checkpoint._torch_save

    def full(obj, path):
        if path.name == "optimizer.pt":
            with open(path, "wb") as f:
                torch.save(obj, f)
            raise OSError(code, os.strerror(code))
        real_save(obj, path)

    monkeypatch.setattr(checkpoint, "_torch_save", full)
    with pytest.raises(StorageFull) as info:
        manager.save(2, *run, {})
    size = sum(f.stat().st_size for f in good.rglob("*") if f.is_file())
    message = str(info.value)
    assert message.startswith(f"cannot write checkpoint step_00000002 at {manager.root}: ")
    needed = float(message.split("it needs about ")[1].split(" MiB")[0])
    assert abs(needed * 2**20 - size) < 0.1 * size + 2**20  # the estimate is about the real size
    assert f"the newest complete checkpoint, {good}, is intact" in message and info.value.errno == code
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "step_00000001"]
