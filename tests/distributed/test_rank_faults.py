"""The faults of a multi-rank job, with real processes: torchrun, 2 ranks on gloo on the CPU, the short run of
torchrun.py (4 steps, a checkpoint every 2) with `train.collective_timeout_s` = TIMEOUT. A sitecustomize.py in the
workers injects each fault at a fixed point (as in test_job.py), so a run fails the same way every time:

- a rank killed (SIGKILL) mid-step: the other leaves at once, naming it; `torchrun --max-restarts 1` restarts the
  job, which resumes from the last checkpoint by itself and ends with the uninterrupted run's losses;
- a rank stopped (SIGSTOP) in a checkpoint write: the other stops TIMEOUT seconds later naming it and the operation,
  and no checkpoint is half-written;
- preemption: SIGTERM to torchrun and to every worker at once, as Slurm sends it: every rank stops after the same
  step with one checkpoint, and `--resume` gives the uninterrupted run's losses;
- SIGTERM to one rank: the same coordinated stop.

The uninterrupted run is conftest.py's `two_procs` (the collective timeout does not change the numbers).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from flashdraft.train.checkpoint import CheckpointManager
from tests.distributed.torchrun import RUN, descendants, run_env, site

pytestmark = pytest.mark.slow
TIMEOUT = 5
FAST = [*RUN, f"train.collective_timeout_s={TIMEOUT}"]

HOOKS = """
import atexit
import signal
import time

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
MARKS = MARKS_DIR


def mark(name):
    with open(os.path.join(MARKS, name), "w") as f:
        f.write(f"{time.time()!r} {os.getpid()}")


def mark_leaving():  # "left" when this process ends, whichever way (a watch thread ends it with os._exit)
    real_exit = os._exit

    def leave(code):
        mark("left")
        real_exit(code)

    os._exit = leave
    atexit.register(mark, "left")


def at_call(module, name, n, act):
    original, calls = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            act()
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
"""


def _hooked(tmp_path: Path, case: str) -> tuple[dict, Path]:
    marks = tmp_path / "marks"
    marks.mkdir()
    code = textwrap.dedent(HOOKS).replace("MARKS_DIR", repr(str(marks))) + textwrap.dedent(case)
    return run_env(site(tmp_path, code)), marks


def _when(marks: Path, name: str) -> float:
    return float((marks / name).read_text().split()[0])


def _pid(marks: Path, name: str) -> int:
    return int((marks / name).read_text().split()[1])


def _job(command: list[str], env: dict | None = None, timeout: int = 240, during=None) -> tuple[int, str]:
    """Run `command` (torchrun or `flashdraft --nproc`) to its end: (exit status, its output); `during()` is called
    every 0.2 s meanwhile. A job that outlives `timeout` fails the test, and no process of it is left behind (the
    workers have sessions of their own: they are found by their parent)."""
    with tempfile.TemporaryFile("w+") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env or run_env())
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if during is not None:
                during()
            time.sleep(0.2)
        hung = proc.poll() is None
        if hung:
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        sink.seek(0)
        output = sink.read()
    if hung:
        pytest.fail(f"the job did not end within {timeout} s:\n{output[-4000:]}")
    return proc.returncode, output


def _torchrun(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *options]


def _train(out: Path, *extra: str) -> list[str]:
    return ["-m", "flashdraft", "train", "--out", str(out), *FAST, *extra]


def _losses(out: Path) -> dict[int, float]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _checkpoints(out: Path) -> list[int]:
    """The steps of the run's checkpoints, each verified against its manifest; nothing else but the `latest`
    pointer and the `.tmp-` leftovers of an interrupted save (never read, removed by the next save) is there."""
    manager = CheckpointManager(out)
    for _, path in manager.checkpoints():
        manager.verify(path)
    others = {p.name for p in manager.root.iterdir()} - {p.name for _, p in manager.checkpoints()} - {"latest"}
    assert all(name.startswith(".tmp-") for name in others), others
    return [step for step, _ in manager.checkpoints()]


KILL_RANK_1_IN_STEP_3 = """
if RANK == "1" and ATTEMPT == 0:
    import flashdraft.distributed.data_parallel as data_parallel

    def die():
        mark("killed")
        os.kill(os.getpid(), signal.SIGKILL)

    at_call(data_parallel, "sum_stats", 3, die)  # after step 3's backward, before the all-reduce of its losses
if RANK == "0" and ATTEMPT == 0:
    mark_leaving()
"""


def test_a_rank_killed_mid_step_is_named_and_torchrun_restarts_the_job_which_resumes_exactly(two_procs, tmp_path):
    env, marks = _hooked(tmp_path, KILL_RANK_1_IN_STEP_3)
    out = tmp_path / "run"
    rc, output = _job(_torchrun("--max-restarts=1") + _train(out), env)
    assert rc == 0, output[-4000:]
    assert "flashdraft train (rank 0): error: rank 1 is gone" in output, output[-4000:]
    assert "rank 0's all_reduce (from flashdraft/distributed/data_parallel.py:sum_stats, step 3) lost its" in output
    # Rank 0 left by itself, in the second or two it takes to see which rank stopped beating (torchrun's SIGKILL
    # would have come 30 s after its SIGTERM).
    assert _when(marks, "left") - _when(marks, "killed") < 10, output[-4000:]
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} (step 2)" in output, output[-4000:]
    assert _losses(out) == _losses(two_procs[0])
    assert _checkpoints(out) == [2, 4]


STOP_RANK_1_IN_A_CHECKPOINT = """
if RANK == "1":
    import flashdraft.train.checkpoint.manager as manager

    def stall():
        mark("stopped")
        os.kill(os.getpid(), signal.SIGSTOP)

    at_call(manager, "write_sharded", 2, stall)  # the checkpoint of step 4, its directory made by rank 0
if RANK == "0":
    mark_leaving()
"""


def test_a_stopped_rank_stops_the_job_within_the_timeout_naming_it_and_nothing_is_half_written(tmp_path):
    env, marks = _hooked(tmp_path, STOP_RANK_1_IN_A_CHECKPOINT)
    out = tmp_path / "run"

    def end_the_stopped_rank():
        # torchrun SIGKILLs a stopped worker 30 s after its SIGTERM (a fixed wait on a failed group): spare the test
        # that wait once rank 0 has left.
        if (marks / "left").exists() and not (marks / "ended").exists():
            (marks / "ended").touch()
            with contextlib.suppress(ProcessLookupError):
                os.kill(_pid(marks, "stopped"), signal.SIGKILL)

    rc, output = _job(_torchrun() + _train(out), env, timeout=120, during=end_the_stopped_rank)
    assert rc != 0, output[-4000:]
    # Rank 0's watch noticed the silence, or its collective timed out first: either way rank 1 and the operation
    # rank 0 was waiting in are named, TIMEOUT seconds after rank 1 stopped (its last beat may precede the stop by
    # a poll, 0.5 s; the upper bound leaves room for a loaded 2-core machine, far below NCCL's 10 minutes).
    assert re.search(r"rank 1 (failed: it )?stopped answering: no heartbeat for \d+ s", output), output[-4000:]
    assert "(from flashdraft/train/checkpoint/save.py:write_sharded, step 4)" in output, output[-4000:]
    assert TIMEOUT - 1 <= _when(marks, "left") - _when(marks, "stopped") < TIMEOUT + 25, output[-4000:]
    assert _checkpoints(out) == [2]
    assert CheckpointManager(out).latest() == CheckpointManager(out).path_for(2)


PREEMPT_AT_STEP_3 = """
def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


if RANK == "0" and not os.path.exists(os.path.join(MARKS, "preempted")):
    import flashdraft.train.loop as loop

    def preempt():  # as Slurm does: torchrun and every worker get SIGTERM at once (torchrun passes it on again)
        mark("preempted")
        agent = os.getppid()
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == agent]
        for pid in [agent, *workers]:
            os.kill(pid, signal.SIGTERM)

    at_call(loop, "train_step", 3, preempt)
"""


def test_preemption_checkpoints_once_stops_every_rank_and_resumes_exactly(two_procs, tmp_path):
    env, _ = _hooked(tmp_path, PREEMPT_AT_STEP_3)
    out = tmp_path / "run"
    # `flashdraft train --nproc 2` becomes torchrun (exec): the signal reaches torchrun, not a wrapper.
    flashdraft = [sys.executable, "-m", "flashdraft", "train", "--nproc", "2", "--out", str(out), *FAST]
    rc, output = _job(flashdraft, env)
    assert rc != 0, output[-4000:]  # torchrun's status after a signal; each worker exits 143
    assert "stopped by SIGTERM after step 3" in output, output[-4000:]
    assert _checkpoints(out) == [2, 3]
    assert list(_losses(out)) == [1, 2, 3]
    rc, output = _job(flashdraft + ["--resume"], env)
    assert rc == 0, output[-4000:]
    assert _losses(out) == _losses(two_procs[0])


SIGTERM_TO_RANK_1_AT_STEP_3 = """
if RANK == "1":
    import flashdraft.train.loop as loop

    at_call(loop, "train_step", 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
"""


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_one_checkpoint(two_procs, tmp_path):
    env, _ = _hooked(tmp_path, SIGTERM_TO_RANK_1_AT_STEP_3)
    out = tmp_path / "run"
    rc, output = _job(_torchrun() + _train(out), env)
    assert rc != 0 and "exitcode  : 143" in output, output[-4000:]  # torchrun's report of its workers
    assert "stopped by another rank's signal after step 3" in output, output[-4000:]  # rank 0, not signalled
    assert _checkpoints(out) == [2, 3]
    reference = _losses(two_procs[0])
    assert _losses(out) == {step: reference[step] for step in (1, 2, 3)}
