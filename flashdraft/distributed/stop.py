"""A stop requested from outside (SIGTERM from a scheduler or `timeout`, Ctrl-C): finish the step, checkpoint, exit.

Preempted jobs get a SIGTERM and some seconds of grace; without a handler Python dies at once and every step since
the last periodic checkpoint is lost. The handler only sets a flag; the loop looks at it between steps, and every rank
stops after the same step (`requested` sums the flags), whichever ranks got the signal.

The same signal often comes twice: Slurm signals every process of a job, torchrun among them, and torchrun passes the
signal on to its workers; a terminal's Ctrl-C reaches torchrun and its workers alike. So a repeated SIGTERM changes
nothing (a scheduler that wants the process gone sends SIGKILL), and a Ctrl-C repeated within REPEAT_S of the first
is the same one; a later Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal
import threading
import time

import torch

from flashdraft.distributed import data_parallel
from flashdraft.distributed.ranks import world

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_S = 2.0


class GracefulStop:
    """`with GracefulStop() as stop:` … `if stop.requested(): …` (collective: every rank must call it)."""

    def __init__(self):
        self.signal_name: str | None = None
        self._saved: dict[int, object] = {}
        self._first = 0.0

    def __enter__(self) -> GracefulStop:
        # Signal handlers can only be installed from the main thread (a trainer run inside a worker thread keeps
        # the default behaviour).
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name, self._first = signal.Signals(signum).name, time.monotonic()
            return
        if signum == signal.SIGINT and time.monotonic() - self._first > REPEAT_S:
            signal.signal(signum, self._saved.get(signum, signal.default_int_handler))
            raise KeyboardInterrupt  # a second Ctrl-C of the user's: stop now, without the checkpoint

    def requested(self, device: torch.device) -> bool:
        """Whether any rank got a stop signal (all ranks agree, so they stop after the same step)."""
        if world().size == 1:
            return self.signal_name is not None
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        return bool(data_parallel.all_sum(flag).item() > 0)
