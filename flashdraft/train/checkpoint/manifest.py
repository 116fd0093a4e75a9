"""The checkpoint format: the files a checkpoint holds, its MANIFEST.json (size and sha256 of every other file,
written last), and the checks a checkpoint passes before anything in it is used (see the package docstring)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from flashdraft.io.atomic import write_synced

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
REQUIRED_FILES = ("drafter/config.json", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json")
SHARDED = "sharded"
# What a manifest may list: the files above, the drafter's save_pretrained directory, DCP's sharded directory.
KNOWN_DIRS = ("drafter/", f"{SHARDED}/")
# A checkpoint written under torchrun has its optimizer state in DCP's sharded files instead of optimizer.pt.
SHARDED_INSTEAD = {"optimizer.pt": f"{SHARDED}/.metadata"}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint is partial, corrupt or does not fit the model; the message names the path and what is wrong."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint of another format version: not damage to skip, but a version mismatch to resolve."""


def write_manifest(directory: Path, step: int, ranks: int | None = None) -> None:
    """Hash every file of `directory` and write its MANIFEST.json (`ranks`: how many wrote its shards)."""
    files = _hash_files(directory, sorted(relative_files(directory)))
    manifest: dict[str, Any] = {"format": FORMAT_VERSION, "step": step}
    if ranks is not None:
        manifest["ranks"] = ranks
    manifest["files"] = files
    write_synced(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def verify(path: str | os.PathLike) -> dict:
    """Check the checkpoint against its MANIFEST.json, hashing every file; returns the manifest.

    Raises CheckpointError naming the checkpoint and the file: no manifest (the save did not finish), a
    garbled one, a file missing, of the wrong size or with the wrong hash, a required file not listed, a
    listed file that is no part of a checkpoint; CheckpointFormatError for another format version. Files on
    disk that the manifest does not list are named in a warning (and never loaded).
    """
    path = Path(path)
    manifest, entries = read_manifest(path)
    check_hashes(path, entries, list(entries))
    return manifest


def read_manifest(path: Path) -> tuple[dict, dict[str, tuple[int, str]]]:
    """(manifest, {name: (size, sha256)}) after every check short of hashing (see `verify`)."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial checkpoint: the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise CheckpointError(f"{manifest_path}: garbled or truncated, not JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: garbled: not a manifest (no 'files' mapping)")
    version = manifest.get("format")
    if type(version) is not int:
        raise CheckpointError(f"{manifest_path}: garbled: no format version (got {version!r})")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{manifest_path}: checkpoint format {version}, but this flashdraft reads format "
            f"{FORMAT_VERSION}: resume with the flashdraft version that wrote it, or start "
            "this run in a new output directory"
        )
    entries = {name: _entry(manifest_path, name, entry) for name, entry in manifest["files"].items()}
    missing = [name for name in REQUIRED_FILES if name not in entries and SHARDED_INSTEAD.get(name) not in entries]
    if missing:
        raise CheckpointError(f"{manifest_path}: does not list {', '.join(missing)}")
    for name, (size, _) in entries.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{file}: {actual} bytes, the manifest says {size} (truncated or changed)")
    extra = sorted(set(relative_files(path)) - set(entries) - {MANIFEST})
    if extra:
        logger.warning("%s: %s not listed in %s: ignored, never loaded", path, ", ".join(extra), MANIFEST)
    return manifest, entries


def _entry(manifest_path: Path, name: Any, entry: Any) -> tuple[int, str]:
    """(size, sha256) of one manifest entry, after checking that it names a known file inside the checkpoint."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name or name == MANIFEST:
        raise CheckpointError(f"{manifest_path}: {name!r} is not the name of a file inside the checkpoint")
    if name not in REQUIRED_FILES and not name.startswith(KNOWN_DIRS):
        raise CheckpointError(
            f"{manifest_path}: lists {name}, which is no part of a format-{FORMAT_VERSION} checkpoint"
        )
    size = entry.get("size") if isinstance(entry, dict) else None
    digest = entry.get("sha256") if isinstance(entry, dict) else None
    if type(size) is not int or size < 0 or not isinstance(digest, str) or not _SHA256.match(digest):
        raise CheckpointError(f"{manifest_path}: the entry of {name} is garbled (size {size!r}, sha256 {digest!r})")
    return size, digest


def check_hashes(path: Path, entries: dict[str, tuple[int, str]], names: list[str]) -> None:
    """Hash the files `names` of the checkpoint `path` against their manifest `entries`."""
    actual = _hash_files(path, names)
    for name in names:
        if actual[name]["sha256"] != entries[name][1]:
            raise CheckpointError(f"{path / name}: sha256 differs from {MANIFEST} (corrupt file)")


def read_verified(path: Path, entries: dict[str, tuple[int, str]], names: list[str]) -> dict[str, bytes]:
    """{name: bytes} of `names`, each checked against its size and sha256 as read (files in parallel)."""

    def read(name: str) -> bytes:
        data = (path / name).read_bytes()
        size, digest = entries[name]
        if len(data) != size:
            raise CheckpointError(f"{path / name}: {len(data)} bytes, the manifest says {size} (truncated or changed)")
        if hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"{path / name}: sha256 differs from {MANIFEST} (corrupt file)")
        return data

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        return dict(zip(names, pool.map(read, names), strict=True))


def relative_files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


def is_weights(name: str) -> bool:
    return name.startswith("drafter/") and name.endswith(".safetensors")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {size, sha256}}; files are hashed in threads (hashlib releases the GIL on large buffers)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        digests = list(pool.map(lambda name: _sha256(root / name), names))
    return {name: {"size": (root / name).stat().st_size, "sha256": d} for name, d in zip(names, digests, strict=True)}
