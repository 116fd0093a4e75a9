"""Writes that a kill cannot leave half-done: build beside the destination, make it durable, publish by a rename.

Every temporary name lives in the destination's own directory, so the final `os.replace` is one rename on one file
system (atomic under POSIX). Readers see the old file or directory, or the complete new one, never a partial one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def fsync_file(f: IO) -> None:
    """Flush Python's buffer and the kernel's for an open file."""
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the names in a directory durable (a rename or a new file is only durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file, then every directory, so the rename that publishes `root` cannot outrun its contents."""
    root = Path(root)
    dirs = [root]
    for path in root.rglob("*"):
        if path.is_dir():
            dirs.append(path)
        else:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in reversed(dirs):
        fsync_dir(path)


def write_synced(path: str | os.PathLike, data: str | bytes) -> None:
    """Write a whole file and fsync it, in place: for files inside a temporary directory published later."""
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        fsync_file(f)


def atomic_write_bytes(
    path: str | os.PathLike, data: bytes, *, fsync: bool = True, tmp: str | os.PathLike | None = None
) -> None:
    """Replace `path` by `data` through a temporary file beside it and a rename.

    `fsync`: flush the file before the rename and the directory after it (durable across a power loss).
    `tmp`: the temporary name, in `path`'s directory (default `.NAME.tmp-PID`); removed if the write fails.
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if tmp.parent.resolve() != path.parent.resolve():
        raise ValueError(f"temporary file {tmp} must be in the directory of {path} (a rename across directories)")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                fsync_file(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_text(
    path: str | os.PathLike, text: str, *, fsync: bool = True, tmp: str | os.PathLike | None = None
) -> None:
    """`atomic_write_bytes` of `text` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode(), fsync=fsync, tmp=tmp)


def replace_directory(
    tmp: str | os.PathLike, path: str | os.PathLike, *, aside: str | os.PathLike | None = None, fsync: bool = True
) -> None:
    """Rename the finished directory `tmp` to `path`, replacing an existing `path`.

    The old `path` is first renamed to `aside` (default: inside a fresh `.NAME.old-*` directory beside it), then
    removed, so a kill leaves either the old or the new directory at `path` plus a hidden leftover.
    `fsync`: make the rename durable (fsync `path`'s parent).
    """
    tmp, path = Path(tmp), Path(path)
    if path.exists():
        if aside is None:
            trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            aside = trash / path.name
        else:
            trash = aside = Path(aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        os.replace(tmp, path)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def temporary_directory_beside(path: str | os.PathLike, prefix: str | None = None) -> Path:
    """A new empty directory in `path`'s parent (created if needed), named `.NAME.tmp-*` unless `prefix` is given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix if prefix is not None else f".{path.name}.tmp-", dir=path.parent))


def leftovers_beside(path: str | os.PathLike) -> list[Path]:
    """What a kill between the steps of `temporary_directory_beside` / `replace_directory` leaves beside `path`:
    its `.NAME.tmp-*` and `.NAME.old-*` entries."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    names = (f".{path.name}.tmp-", f".{path.name}.old-")
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(names))


def remove_leftovers_beside(path: str | os.PathLike) -> list[Path]:
    """Remove `leftovers_beside(path)`; returns what was removed. Only for a caller holding the lock that every
    writer of `path` takes, so that none of them is another writer's work in progress."""
    removed = leftovers_beside(path)
    for entry in removed:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
    return removed


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success it replaces `path` by a rename.

    Readers never see a half-written `path`: either the old directory or the complete new one (during the swap,
    `path` is briefly absent). On error the temporary directory is removed and `path` is left as it was.
    `fsync`: flush every file and directory before the rename, and the parent after it.
    """
    path = Path(path)
    tmp = temporary_directory_beside(path)
    try:
        yield tmp
        if fsync:
            fsync_tree(tmp)
        replace_directory(tmp, path, fsync=fsync)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
