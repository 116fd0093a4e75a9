"""GracefulStop in one process: the same signal sent twice is one stop (Slurm signals torchrun and its workers, and
torchrun passes the signal on again), and only a later Ctrl-C interrupts."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flashdraft.distributed import stop as stop_module
from flashdraft.distributed.stop import GracefulStop
from tests.distributed.torchrun import run_env

CPU = torch.device("cpu")


TWICE = """
import os, signal, torch
from flashdraft.distributed.stop import GracefulStop
from tests.distributed.torchrun import run_env

with GracefulStop() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun passing the scheduler's signal on
    print("alive", stop.requested(torch.device("cpu")), stop.signal_name)
print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
"""


def test_a_repeated_sigterm_is_one_stop_and_does_not_kill():
    """In a process of its own: a SIGTERM that kills kills the process."""
    run = subprocess.run([sys.executable, "-c", TWICE], capture_output=True, text=True, timeout=120, env=run_env())
    assert (run.returncode, run.stdout) == (0, "alive True SIGTERM\nTrue\n"), run.stderr[-2000:]


def test_a_ctrl_c_repeated_at_once_is_the_same_but_a_later_one_interrupts(monkeypatch):
    monkeypatch.setattr(stop_module, "REPEAT_S", 0.2)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested(CPU) and stop.signal_name == "SIGINT"
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, in the main thread
