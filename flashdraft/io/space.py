"""Writes that run out of room — a full device (ENOSPC), a quota (EDQUOT), a file-size limit (EFBIG: `ulimit -f`,
or the filesystem's own) — reported as one error that names the path, the space needed and the space free.

    with room_for(out / "checkpoints", needed=estimate, what="checkpoint step_00000200"):
        ...write...

The libraries that write for us wrap the operating system's error: torch.save raises a RuntimeError whose context is
the OSError, safetensors a SafetensorError that says "(os error 28)". `no_room` finds the errno in either form.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from flashdraft.io import OutputError

NO_ROOM = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file grew past the file-size limit",
}
# How the errno reads in messages of libraries that do not keep it: the C library's text and Rust's "os error N".
_IN_TEXT = {
    errno.ENOSPC: re.compile(r"No space left on device|os error 28\b"),
    errno.EDQUOT: re.compile(r"Disk quota exceeded|os error 122\b"),
    errno.EFBIG: re.compile(r"File too large|os error 27\b"),
}


class StorageFull(OutputError):
    """A write failed for lack of room; `errno` is ENOSPC, EDQUOT or EFBIG."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code


def no_room(exc: BaseException) -> int | None:
    """ENOSPC, EDQUOT or EFBIG when `exc`, or an exception it was raised from or during, is a write out of room."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc.errno
        for code, pattern in _IN_TEXT.items():
            if pattern.search(str(exc)):
                return code
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def room_for(
    path: str | os.PathLike, needed: int | Callable[[], int], what: str, hint: str | None = None
) -> Iterator[None]:
    """Turn a write out of room inside the body into StorageFull: "`what` at `path`: the reason (about `needed`
    bytes needed, N free)" plus `hint` (what is still intact, how to continue). Other errors pass unchanged.
    `needed` may be a function, asked after the failure (an estimate that grows with the work done)."""
    try:
        yield
    except StorageFull:
        raise
    except Exception as exc:
        code = no_room(exc)
        if code is None:
            raise
        size = needed() if callable(needed) else needed
        raise StorageFull(describe(code, Path(path), size, what, hint), code) from exc


def describe(code: int, path: Path, needed: int, what: str, hint: str | None = None) -> str:
    reason = NO_ROOM[code]
    if code == errno.EFBIG:
        limit = file_size_limit()
        reason += f" (ulimit -f: {human(limit)} per file)" if limit is not None else " of the filesystem"
    free = free_bytes(path)
    room = f"{human(free)} free there" if free is not None else "free space unknown"
    text = f"cannot write {what} at {path}: {reason}; it needs about {human(needed)}, {room}"
    return f"{text}. {hint}" if hint else text


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem of `path` (or of its nearest existing parent)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def file_size_limit() -> int | None:
    """This process's RLIMIT_FSIZE in bytes, or None when unlimited (or not a POSIX system)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def human(n: int | float) -> str:
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
