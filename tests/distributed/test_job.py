"""The job under torchrun: an error on one rank stops every rank with that rank's message, on one node and when the
failing rank is on another node while rank 0 works alone, in no collective."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.distributed.torchrun import RUN, run_env, site, torchrun

pytestmark = pytest.mark.slow


FAIL_IN_STEP_ON_RANK_1 = """
    if RANK == "1":
        import flashdraft.train.loop as loop

        def boom(*args, **kwargs):
            raise ValueError("injected failure on rank 1")

        loop.train_step = boom
"""


def test_an_error_on_rank_1_stops_every_rank_with_its_message(tmp_path):
    env = run_env(site(tmp_path, FAIL_IN_STEP_ON_RANK_1))
    start = time.monotonic()
    run = torchrun(["train", "--out", str(tmp_path / "run"), *RUN], env=env, timeout=120)
    assert run.returncode != 0
    assert "flashdraft train (rank 1): error: injected failure on rank 1" in run.stderr, run.stderr[-3000:]
    assert time.monotonic() - start < 90  # start-up included; a hang would be the 120 s timeout above


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rank 1 fails while loading the target; rank 0 is busy tokenising (a sleep standing for hours of it).
FAIL_ON_RANK_1_WHILE_RANK_0_WORKS = """
    import flashdraft.data, flashdraft.target.load

    if RANK == "1":
        def boom(*args, **kwargs):
            raise ValueError("injected failure on rank 1")

        flashdraft.target.load.target_directory = boom
    if RANK == "0":
        import time

        def slow(*args, **kwargs):
            time.sleep(600)

        flashdraft.data.prepare_shards = slow
"""


def test_a_failure_on_another_node_stops_a_rank_that_is_not_in_a_collective(tmp_path):
    """Two torchrun agents (two "nodes" of one process each, c10d rendezvous on this machine). Rank 1 fails while
    rank 0 works alone, in no collective, on the other node: torchrun's fail-fast stops only the failing node's
    processes, and no collective is there to fail. The error watch stops rank 0 within seconds, and it prints
    rank 1's message."""
    env = run_env(site(tmp_path, FAIL_ON_RANK_1_WHILE_RANK_0_WORKS))
    port = _free_port()
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=fdtest",
        "-m",
        "flashdraft",
        "train",
        "--out",
        str(tmp_path / "run"),
        *RUN,
    ]
    nodes = []
    for _ in range(2):
        # The first agent binds the rendezvous endpoint (hosts its store) and, with the lower pid, gets rank 0:
        # then the failing node takes nothing down with it that rank 0's node depends on.
        nodes.append(
            subprocess.Popen(
                common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
            )
        )
        time.sleep(3)
    try:
        outputs = [p.communicate(timeout=150) for p in nodes]  # rank 0 alone would sleep 600 s
    finally:
        for p in nodes:  # the agent and its workers (a killed agent would leave a sleeping worker behind)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    stderr = "".join(err for _, err in outputs)
    assert all(p.returncode != 0 for p in nodes), stderr[-3000:]
    assert "flashdraft train (rank 1): error: injected failure on rank 1" in stderr, stderr[-3000:]
    assert "flashdraft train: stopping every rank: rank 1 failed: injected failure on rank 1" in stderr, stderr[-3000:]
