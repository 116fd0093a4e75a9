"""One writer per output directory: a lock file naming its holder, taken atomically, kept fresh while the holder
runs, and taken over, with a notice, once the holder is gone.

    with hold(out, "train"):       # OutputBusy, naming the holder, when a live run has `out`
        ...                        # re-entrant in one process: CheckpointManager.save holds it again

The lock is `OUT/.flashdraft-lock`, a JSON record: pid, host, command, start time, the process's start tick (from
/proc, so a reused pid is told apart) and a random token. It appears complete or not at all: the record is written
under a private name and `os.link`ed to the lock name, which fails when the name exists. While the lock is held a
daemon thread touches the file every HEARTBEAT_S seconds (its mtime is the heartbeat), after checking that it still
names this holder.

A lock whose holder is gone is taken over, with a warning naming the old holder:
- on this host: no process with that pid, a zombie, or another process under the same pid (another start tick);
- from another host (where the pid means nothing): no heartbeat for STALE_AFTER_S seconds. A holder that was only
  frozen that long finds the lock taken when it wakes, and stops before it deletes anything (`OutputLock.check`).
Takeovers go through a second file made the same way (`.flashdraft-lock.break`), so two runs that find the same stale
lock cannot both take it.

Under torchrun only rank 0 takes the lock (RANK=0 in the environment, read before any process group exists, so a
refused run stops within a second); once the group is up every rank checks that the lock it sees is rank 0's
(flashdraft.distributed.session(..., output=OUT)): all nodes must see one shared output directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from flashdraft.io import OutputError
from flashdraft.io.space import room_for

logger = logging.getLogger(__name__)

LOCK_NAME = ".flashdraft-lock"
HEARTBEAT_S = 10.0
# 12 missed heartbeats: far beyond a slow shared filesystem or a long pause of the holder, short enough that a
# crashed node's run can be restarted elsewhere within minutes.
STALE_AFTER_S = 120.0
# A takeover takes milliseconds; a break file older than this was left by a run killed in the middle of one.
BREAK_STALE_S = 30.0
# How long a run waits while another one takes over a stale lock, before it reports the directory busy.
TAKEOVER_WAIT_S = 5.0


class OutputBusy(OutputError):
    """Another live run holds the output directory."""


class OutputLockLost(OutputError):
    """The lock this run held now names another run (which took it over as stale)."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    command: str
    started: float  # time.time() when the lock was taken
    token: str
    proc_start: str | None = None  # the process's start tick (/proc/PID/stat field 22), when there is /proc

    @classmethod
    def parse(cls, raw: bytes) -> Holder:
        """The record of a lock file; ValueError when it is not one."""
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        holder = cls(
            **{k: data[k] for k in ("pid", "host", "command", "started", "token")}, proc_start=data.get("proc_start")
        )
        if not (isinstance(holder.pid, int) and holder.pid > 0 and isinstance(holder.token, str)):
            raise ValueError(f"bad pid or token: {holder.pid!r}, {holder.token!r}")
        return holder

    def describe(self, heartbeat_age: float | None = None) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(self.started)))
        beat = f", heartbeat {heartbeat_age:.0f} s ago" if heartbeat_age is not None else ""
        return f"flashdraft {self.command}, pid {self.pid} on host {self.host}, since {since}{beat}"


def lock_path(directory: str | os.PathLike, *, beside: bool = False) -> Path:
    """The lock file of `directory`: inside it, or (`beside`, for a directory that is replaced whole by a rename)
    next to it as `.NAME.flashdraft-lock`."""
    directory = Path(os.path.abspath(directory))
    return directory.parent / f".{directory.name}{LOCK_NAME}" if beside else directory / LOCK_NAME


def read_holder(path: Path) -> tuple[Holder | None, float | None, bytes | None]:
    """(holder or None if unreadable, seconds since its heartbeat, raw bytes); (None, None, None) if no lock."""
    try:
        raw = path.read_bytes()
        age = max(0.0, time.time() - path.stat().st_mtime)
    except FileNotFoundError:
        return None, None, None
    try:
        return Holder.parse(raw), age, raw
    except (ValueError, KeyError, TypeError):
        return None, age, raw


class OutputLock:
    """The lock file `path` held by this process (see the module docstring); `acquire`, `check`, `release`."""

    def __init__(
        self, path: Path, command: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S
    ) -> None:
        self.path = Path(path)
        self.command = command
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.holder: Holder | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def directory(self) -> Path:
        return self.path.parent

    def acquire(self) -> None:
        me = Holder(
            os.getpid(), socket.gethostname(), self.command, time.time(), secrets.token_hex(8), _proc_start(os.getpid())
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = self.path.with_name(f"{self.path.name}.{me.token}.tmp")
        with room_for(self.path.parent, 4096, f"the lock file {self.path}"):
            _write(mine, json.dumps(asdict(me)).encode())
        try:
            deadline = time.monotonic() + TAKEOVER_WAIT_S
            while not _create(mine, self.path):
                holder, age, raw = read_holder(self.path)
                if raw is None:
                    continue  # released between the two calls: try again
                why = self._gone(holder, age)
                if why is None:
                    raise OutputBusy(self._busy(holder, age))
                if self._take_over(mine, raw, holder, why):
                    break
                if time.monotonic() > deadline:
                    raise OutputBusy(self._busy(holder, age, "another run is taking the stale lock over"))
                time.sleep(0.05)
        finally:
            mine.unlink(missing_ok=True)
        self.holder = me
        self._thread = threading.Thread(target=self._beat, name="flashdraft-lock-heartbeat", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise OutputLockLost unless the lock file still names this holder (call before deleting anything)."""
        holder, _, raw = read_holder(self.path)
        if self._lost is None and (holder is None or holder.token != self.holder.token):
            self._lost = holder.describe() if holder else ("nobody" if raw is None else "an unreadable record")
        if self._lost is not None:
            raise OutputLockLost(
                f"{self.directory}: this run's lock ({self.path}) now names {self._lost}, which took "
                "it over as stale: stopping before this run deletes or replaces anything there"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder, _, _ = read_holder(self.path)
        if holder is not None and self.holder is not None and holder.token == self.holder.token:
            self.path.unlink(missing_ok=True)

    # ---- internals

    def _gone(self, holder: Holder | None, age: float | None) -> str | None:
        """Why the holder of the lock is gone, or None while it may be alive."""
        if holder is None:
            if age is not None and age > self.stale_after_s:
                return f"its record is unreadable and {age:.0f} s old"
            return None
        if holder.host == socket.gethostname():
            if not _alive(holder.pid, holder.proc_start):
                return f"process {holder.pid} no longer runs on {holder.host}"
            return None
        if age is not None and age > self.stale_after_s:
            return (
                f"no heartbeat for {age:.0f} s (the limit is {self.stale_after_s:.0f} s; pid {holder.pid} on "
                f"{holder.host} cannot be checked from {socket.gethostname()})"
            )
        return None

    def _take_over(self, mine: Path, raw: bytes, holder: Holder | None, why: str) -> bool:
        """Replace the stale lock whose bytes are `raw` by `mine`; False when another run got there first."""
        breaker = self.path.with_name(self.path.name + ".break")
        if not _create(mine, breaker):
            age = _age(breaker)
            if age is not None and age > BREAK_STALE_S:
                breaker.unlink(missing_ok=True)
            return False
        try:
            _, _, now = read_holder(self.path)
            if now != raw:
                return False
            os.replace(mine, self.path)
        finally:
            breaker.unlink(missing_ok=True)
        old = holder.describe() if holder is not None else "an unreadable record"
        logger.warning("%s: taking over the lock of %s: %s", self.directory, old, why)
        return True

    def _busy(self, holder: Holder | None, age: float | None, note: str = "") -> str:
        who = holder.describe(age) if holder is not None else f"a run whose lock record is unreadable ({self.path})"
        return (
            f"{self.directory} is in use by another run: {who}{'; ' + note if note else ''}. Wait for it to end, "
            f"or choose another output directory. (The lock is {self.path}; one left by a killed run is taken "
            f"over: on this host once its process is gone, from another host after {self.stale_after_s:.0f} s "
            "without a heartbeat.)"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder, _, raw = read_holder(self.path)
            if raw is not None and holder is None:
                continue  # unreadable for a moment (a shared filesystem): look again at the next beat
            if holder is None or holder.token != self.holder.token:
                self._lost = holder.describe() if holder is not None else "nobody (the file was removed)"
                logger.error(
                    "%s: lost the lock: it now names %s; this run stops before it next deletes anything there",
                    self.directory,
                    self._lost,
                )
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)


# ---- one lock per directory and process, re-entrant --------------------------------------------------------------

_HELD: dict[Path, list] = {}  # lock path -> [OutputLock, depth]
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def hold(directory: str | os.PathLike, command: str, *, beside: bool = False) -> Iterator[OutputLock | None]:
    """Hold the lock of `directory` for the body; re-entrant in this process. Under torchrun only rank 0 takes it
    (the others get None; they check it through flashdraft.distributed.session)."""
    if _rank() != 0:
        yield None
        return
    path = lock_path(directory, beside=beside)
    with _HELD_GUARD:
        entry = _HELD.get(path)
        if entry is None:
            lock = OutputLock(path, command)
            lock.acquire()
            entry = _HELD[path] = [lock, 0]
        entry[1] += 1
    try:
        entry[0].check()
        yield entry[0]
    finally:
        with _HELD_GUARD:
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[path]
                entry[0].release()


def held_token(directory: str | os.PathLike) -> str | None:
    """The token of this process's lock on `directory`, or None when it holds none."""
    entry = _HELD.get(lock_path(directory))
    return entry[0].holder.token if entry else None


def check_token(directory: str | os.PathLike, token: str | None, who: str) -> None:
    """Raise OutputError unless `directory`'s lock file, as this process sees it, carries `token` (another
    process's lock: under torchrun, rank 0's)."""
    path = lock_path(directory)
    if token is None:
        raise OutputError(f"{path}: rank 0 holds no lock on {path.parent} (take it with flashdraft.io.lock.hold)")
    holder, age, _ = read_holder(path)
    if holder is None or holder.token != token:
        seen = holder.describe(age) if holder is not None else "no lock"
        raise OutputError(
            f"{who} sees {seen} at {path}, not rank 0's lock: the output directory must be one "
            "filesystem shared by every node (and no other run may use it)"
        )


# ---- helpers ------------------------------------------------------------------------------------------------------


def _rank() -> int:
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return 0


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _create(source: Path, name: Path) -> bool:
    """Make `name` a second link of the complete file `source`; False if `name` exists. Filesystems without hard
    links get an O_EXCL create and a copy instead (a reader may then see the record half-written for a moment:
    `read_holder` calls that unreadable, and only a stale unreadable record is taken over)."""
    try:
        os.link(source, name)
        return True
    except FileExistsError:
        return False
    except OSError:
        pass
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(source.read_bytes())
        f.flush()
        os.fsync(f.fileno())
    return True


def _age(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start tick) of a process from /proc, or None without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces and parentheses
    return fields[0], fields[19]


def _proc_start(pid: int) -> str | None:
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def _alive(pid: int, proc_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc to look closer: the pid exists
    state, start = stat
    if state in ("Z", "X"):
        return False  # killed, not yet reaped by its parent
    return proc_start is None or start == proc_start
