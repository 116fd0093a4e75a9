"""The manifest: it lists every file, a partial or corrupt newest checkpoint is skipped with a warning (each check
of the manifest field by field), another format version stops the resume, files it does not list are never loaded."""

import json
import logging

import pytest
import torch

from flashdraft.train.checkpoint import FORMAT_VERSION, CheckpointError, CheckpointFormatError, CheckpointManager

from . import LOGGER, assert_same, drop_manifest, edit_manifest, make_run, saved_steps, trained


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


# ---- partial and corrupt checkpoints ----------------------------------------------------------------------------


def flip_byte(path):
    file = path / "drafter" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x40
    file.write_bytes(bytes(data))
    return "drafter/model.safetensors: sha256 differs"


def truncate(path):
    file = path / "optimizer.pt"
    file.write_bytes(file.read_bytes()[:100])
    return "optimizer.pt: 100 bytes"


def remove_file(path):
    (path / "rng.pt").unlink()
    return "rng.pt is missing"


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


# ---- verified, not trusted --------------------------------------------------------------------------------------


def test_another_format_version_stops_the_resume_instead_of_being_skipped(tmp_path):
    run = make_run()
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, *run, {})
    newer = manager.save(2, *run, {})
    edit_manifest(newer, lambda m: m.update(format=FORMAT_VERSION + 1))
    message = f"{newer / 'MANIFEST.json'}: checkpoint format 2, but this flashdraft reads format 1"
    # Falling back to step 1 would resume from it and then prune step 2 as an abandoned continuation.
    with pytest.raises(CheckpointFormatError, match=message):
        manager.latest()
    with pytest.raises(CheckpointFormatError, match=message):
        manager.load(newer, *make_run())
    assert saved_steps(manager) == [1, 2]


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
