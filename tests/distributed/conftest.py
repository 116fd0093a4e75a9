"""Fixtures of the multi-process tests: one uninterrupted 2-rank run of torchrun.py's short run, shared by the tests
that compare against it (the data-parallel and the fault tests)."""

import subprocess
import sys

import pytest

from tests.distributed.torchrun import RUN, run_env


@pytest.fixture(scope="session")
def two_procs(tmp_path_factory):
    """(OUT, the finished process) of 2 ranks, launched by `flashdraft train --nproc 2` (torchrun underneath)."""
    out = tmp_path_factory.mktemp("two")
    run = subprocess.run(
        [sys.executable, "-m", "flashdraft", "train", "--nproc", "2", "--out", str(out), *RUN],
        capture_output=True,
        text=True,
        timeout=300,
        env=run_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run
