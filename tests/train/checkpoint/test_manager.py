"""The checkpoints of a run: keep-N pruning, leftovers of interrupted saves ignored then cleaned, atomicity when a
save dies half-way or runs out of room, and saving only under the output directory's lock."""

import errno
import json
import logging
import os
import shutil
import subprocess

import pytest
import torch

from flashdraft.io import lock
from flashdraft.io.lock import OutputBusy, OutputLockLost
from flashdraft.io.space import StorageFull
from flashdraft.train.checkpoint import CheckpointManager, save

from . import LOGGER, make_run, saved_steps, trained

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
    real_save = save.torch_save

    def dying_save(obj, path):
        if path.name == "scheduler.pt":
            raise OSError("disk full")
        real_save(obj, path)

    monkeypatch.setattr(save, "torch_save", dying_save)
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


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_save_out_of_room_names_the_size_and_the_intact_checkpoint(tmp_path, monkeypatch, code):
    run = trained()
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, *run, {})
    real_save = save.torch_save

    def full(obj, path):
        if path.name == "optimizer.pt":
            with open(path, "wb") as f:
                torch.save(obj, f)
            raise OSError(code, os.strerror(code))
        real_save(obj, path)

    monkeypatch.setattr(save, "torch_save", full)
    with pytest.raises(StorageFull) as info:
        manager.save(2, *run, {})
    size = sum(f.stat().st_size for f in good.rglob("*") if f.is_file())
    message = str(info.value)
    assert message.startswith(f"cannot write checkpoint step_00000002 at {manager.root}: ")
    needed = float(message.split("it needs about ")[1].split(" MiB")[0])
    assert abs(needed * 2**20 - size) < 0.1 * size + 2**20  # the estimate is about the real size
    assert f"the newest complete checkpoint, {good}, is intact" in message and info.value.errno == code
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "step_00000001"]


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
