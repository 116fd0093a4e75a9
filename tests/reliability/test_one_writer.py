"""One writer per output directory, with real processes.

- Two `python -m flashdraft train --out X` started together: one trains; the other exits with code 4 within 5 s,
  naming the holder (pid, host, since). The trainer is then killed with SIGKILL: its lock stays behind, and the next
  run (`--resume`) takes it over with a notice naming the dead process and finishes the run.
- Under torchrun (2 ranks, gloo on the CPU): rank 0 holds the lock and every rank checks that it sees rank 0's lock;
  a rank that sees another directory (no shared filesystem) stops the job, and so does a lock held by another run.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashdraft.io import lock

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RUN = ["train.max_steps=6", "log.every=1", "log.checkpoint_every=2", "data.eval_prompts=null", "train.device=cpu"]
EXIT_OUTPUT = 4


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "COLUMNS": "250",
    }


def _train(out: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flashdraft", "train", "--out", str(out), *RUN, *extra]
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=_env(), cwd=log.parent, start_new_session=True
    )


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def test_two_runs_started_together_one_trains_and_a_killed_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_train(out, log) for log in logs]
    started = time.monotonic()
    _wait_for(lambda: any(p.poll() is not None for p in procs), 120, "one of the two runs to stop")
    refused_after = time.monotonic() - started
    (loser, loser_log), (winner, _) = sorted(zip(procs, logs, strict=True), key=lambda pl: pl[0].poll() is None)
    text = loser_log.read_text()
    assert loser.returncode == EXIT_OUTPUT, text
    assert refused_after < 5, f"the second run took {refused_after:.1f} s to refuse"
    assert (
        f"{out} is in use by another run: flashdraft train, pid {winner.pid} on host {socket.gethostname()}, "
        "since " in text
    )
    assert "step 1/" not in text and "Traceback" not in text
    holder = json.loads(lock.lock_path(out).read_text())
    assert holder["pid"] == winner.pid

    # SIGKILL the trainer once it has a checkpoint: nothing releases its lock.
    step2 = out / "checkpoints" / "step_00000002" / "MANIFEST.json"
    _wait_for(step2.is_file, 300, "the first checkpoint")
    assert winner.poll() is None, "the run finished before it could be killed: make it longer"
    os.killpg(winner.pid, signal.SIGKILL)
    winner.wait()
    assert json.loads(lock.lock_path(out).read_text())["pid"] == winner.pid

    log = tmp_path / "c.log"
    resumed = _train(out, log, "--resume")
    assert resumed.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"{out}: taking over the lock of flashdraft train, pid {winner.pid} on host {socket.gethostname()}" in text
    assert f"process {winner.pid} no longer runs" in text
    assert "resumed from" in text and (out / "checkpoints" / "step_00000006" / "MANIFEST.json").is_file()
    assert not lock.lock_path(out).exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


# ---- torchrun ---------------------------------------------------------------------------------------------------

# Rank 0 takes the lock (before the process group, as `flashdraft train` does), then every rank checks it; rank 1
# checks `elsewhere` instead when asked: a node whose OUT is another directory.
SCRIPT = textwrap.dedent("""
    import os, sys
    from flashdraft.io import lock
    from flashdraft import distributed

    out, mode = sys.argv[1], sys.argv[2]
    seen = os.path.join(out, "elsewhere") if mode == "split" and os.environ["RANK"] == "1" else out
    with lock.hold(out, "train"), distributed.session("cpu", "train", output=seen):
        print(f"rank {os.environ['RANK']} checked the lock", flush=True)
""")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())


def test_under_torchrun_rank_0_holds_the_lock_and_every_rank_checks_it(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    ok = _torchrun(str(script), str(out), "shared")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "rank 0 checked the lock" in ok.stdout and "rank 1 checked the lock" in ok.stdout
    assert not lock.lock_path(out).exists()

    split = _torchrun(str(script), str(out), "split")
    assert split.returncode != 0
    assert f"rank 1 (host {socket.gethostname()}) sees no lock at {out}/elsewhere/" in split.stderr
    assert "the output directory must be one filesystem shared by every node" in split.stderr
    assert "rank 1 checked the lock" not in split.stdout


def test_under_torchrun_a_busy_output_directory_stops_the_job_at_once(tmp_path):
    out = tmp_path / "out"
    with lock.hold(out, "train"):
        started = time.monotonic()
        job = _torchrun("-m", "flashdraft", "train", "--out", str(out), *RUN)
        took = time.monotonic() - started
    assert job.returncode != 0
    assert f"{out} is in use by another run: flashdraft train, pid {os.getpid()} on host" in job.stderr
    assert not (out / "config.json").exists() and not (out / "checkpoints").exists()
    assert took < 120, f"{took:.0f} s"  # refused before any model or data loaded
