"""The output directory's lock: refused while its holder lives (named in the message), taken over once it is gone
(a dead or reused pid on this host, a zombie, a silent heartbeat from another host), never by two runs at once.

Holders are real processes (a `sleep` child, a killed child), and the race is run by real processes; records of
another host are written by hand, since there is no second host here.
"""

import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from flashdraft.io import lock
from flashdraft.io.lock import Holder, OutputBusy, OutputLock, OutputLockLost

LOGGER = "flashdraft.io.lock"


def write_record(path, pid, host=None, proc_start="auto", age=0.0, command="train"):
    """A lock record as another run would leave it; `age`: seconds since its heartbeat."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if proc_start == "auto":
        proc_start = lock._proc_start(pid)
    record = {
        "pid": pid,
        "host": host or socket.gethostname(),
        "command": command,
        "started": time.time() - age,
        "token": f"other-{pid}",
        "proc_start": proc_start,
    }
    path.write_text(json.dumps(record))
    os.utime(path, (time.time() - age, time.time() - age))
    return record


def token_in(path):
    return json.loads(path.read_text())["token"]


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no process has this pid now (pids are not reused this quickly)
    return proc.pid


def test_a_live_holder_is_named_and_nothing_changes(tmp_path, sleeper):
    path = lock.lock_path(tmp_path)
    record = write_record(path, sleeper.pid)
    with pytest.raises(OutputBusy) as info:
        OutputLock(path, "train").acquire()
    message = str(info.value)
    assert (
        f"{tmp_path} is in use by another run: flashdraft train, pid {sleeper.pid} on host "
        f"{socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M', time.localtime(record['started']))}" in message
    )
    assert re.search(r"heartbeat \d s ago", message) and str(path) in message
    assert token_in(path) == record["token"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK_NAME]  # no temporary file left behind


@pytest.mark.parametrize("how", ["dead pid", "zombie", "pid reused", "unreadable and old"])
def test_a_gone_holder_on_this_host_is_taken_over_with_a_notice(tmp_path, caplog, dead_pid, sleeper, how):
    path = lock.lock_path(tmp_path)
    if how == "dead pid":
        write_record(path, dead_pid)
        why = f"process {dead_pid} no longer runs"
    elif how == "zombie":
        zombie = subprocess.Popen(["sleep", "60"])
        zombie.send_signal(signal.SIGKILL)
        time.sleep(0.5)  # killed, not reaped: os.kill(pid, 0) still succeeds
        write_record(path, zombie.pid)
        why = f"process {zombie.pid} no longer runs"
    elif how == "pid reused":
        write_record(path, sleeper.pid, proc_start="1")  # another process had this pid when it took the lock
        why = f"process {sleeper.pid} no longer runs"
    else:
        path.write_text('{"pid": 12')  # a record cut off (a filesystem without hard links)
        os.utime(path, (time.time() - 500, time.time() - 500))
        why = "its record is unreadable and 500 s old"
    held = OutputLock(path, "train")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        held.acquire()
    try:
        assert token_in(path) == held.holder.token
        assert f"{tmp_path}: taking over the lock of " in caplog.text and why in caplog.text
    finally:
        held.release()
        if how == "zombie":
            zombie.wait()
    assert not path.exists()


def test_another_host_is_trusted_until_its_heartbeat_stops(tmp_path, caplog):
    path = lock.lock_path(tmp_path)
    write_record(path, 4242, host="node-17", age=lock.STALE_AFTER_S - 30)
    with pytest.raises(OutputBusy, match=r"pid 4242 on host node-17, since .*heartbeat 9\d s ago"):
        OutputLock(path, "train").acquire()
    write_record(path, 4242, host="node-17", age=lock.STALE_AFTER_S + 30)
    held = OutputLock(path, "train")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        held.acquire()
    held.release()
    assert "taking over the lock of flashdraft train, pid 4242 on host node-17" in caplog.text
    assert re.search(r"no heartbeat for 15\d s \(the limit is 120 s", caplog.text)


def test_a_fresh_unreadable_record_is_busy(tmp_path):
    path = lock.lock_path(tmp_path)
    path.write_text("{")
    with pytest.raises(OutputBusy, match="a run whose lock record is unreadable"):
        OutputLock(path, "train").acquire()


def test_the_heartbeat_refreshes_the_mtime_and_notices_a_takeover(tmp_path, caplog):
    path = lock.lock_path(tmp_path)
    held = OutputLock(path, "train", heartbeat_s=0.05)
    held.acquire()
    os.utime(path, (time.time() - 100, time.time() - 100))
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 5
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        write_record(path, 4242, host="node-17")  # another run took it over, believing this one dead
        time.sleep(0.5)
    assert "lost the lock: it now names flashdraft train, pid 4242 on host node-17" in caplog.text
    with pytest.raises(OutputLockLost, match="now names flashdraft train, pid 4242 on host node-17"):
        held.check()
    held.release()
    assert token_in(path) == "other-4242"  # the other run's lock is left alone


def test_hold_is_reentrant_and_releases_with_the_outermost(tmp_path):
    path = lock.lock_path(tmp_path)
    with lock.hold(tmp_path, "train") as outer:
        with lock.hold(tmp_path, "checkpoint") as inner:
            assert inner is outer and lock.held_token(tmp_path) == outer.holder.token
        assert token_in(path) == outer.holder.token
    assert not path.exists() and lock.held_token(tmp_path) is None


def test_beside_puts_the_lock_next_to_the_directory(tmp_path):
    with lock.hold(tmp_path / "shards", "prepare", beside=True):
        assert (tmp_path / f".shards{lock.LOCK_NAME}").is_file() and not (tmp_path / "shards").exists()


def test_other_ranks_take_no_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with lock.hold(tmp_path, "train") as held:
        assert held is None and not lock.lock_path(tmp_path).exists()


def test_check_token_names_what_another_rank_sees(tmp_path):
    with lock.hold(tmp_path / "a", "train") as held:
        lock.check_token(tmp_path / "a", held.holder.token, "rank 1")
        with pytest.raises(
            lock.OutputError, match=rf"rank 1 sees no lock at {tmp_path}/b/{lock.LOCK_NAME}, not rank 0"
        ):
            lock.check_token(tmp_path / "b", held.holder.token, "rank 1")
    with pytest.raises(lock.OutputError, match="rank 0 holds no lock"):
        lock.check_token(tmp_path / "a", None, "rank 1")


def _race(path, start, results):
    # Every read of the lock is slow, so all racers have read the stale record before any of them acts on it:
    # only the takeover's own serialisation (the .break file and the second read) can leave one winner.
    read = lock.read_holder
    lock.read_holder = lambda p: (read(p), time.sleep(0.3))[0]
    start.wait()
    try:
        held = OutputLock(path, f"racer {os.getpid()}")
        held.acquire()
        results.put("won")
        time.sleep(3)  # hold it while the others try
        held.release()
    except OutputBusy:
        results.put("busy")


@pytest.mark.parametrize("stale", [False, True])
def test_of_processes_racing_for_a_lock_exactly_one_wins(tmp_path, dead_pid, stale):
    path = lock.lock_path(tmp_path)
    if stale:
        write_record(path, dead_pid)  # all of them find the same stale lock and try to take it over
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    racers = [ctx.Process(target=_race, args=(path, start, results)) for _ in range(6)]
    for p in racers:
        p.start()
    start.set()
    outcomes = sorted(results.get(timeout=60) for _ in racers)
    for p in racers:
        p.join(timeout=30)
    assert outcomes == ["busy"] * 5 + ["won"], outcomes
    assert not path.exists() and sorted(os.listdir(tmp_path)) == []


def test_holder_records_round_trip_and_reject_garbage():
    holder = Holder(12, "h", "train", 1.5, "t", "99")
    assert Holder.parse(json.dumps(holder.__dict__).encode()) == holder
    for raw in (b"[]", b'{"pid": 0, "host": "h", "command": "c", "started": 1, "token": "t"}', b"\xff"):
        with pytest.raises((ValueError, KeyError)):
            Holder.parse(raw)
