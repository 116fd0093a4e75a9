"""A stop requested from outside (SIGTERM from a scheduler or `timeout`, Ctrl-C): finish the step, checkpoint, exit.

Preempted jobs get a SIGTERM and some seconds of grace; without a handler Python dies at once and every step since
the last periodic checkpoint is lost. The handler only sets a flag; the loop looks at it between steps. A second
Ctrl-C interrupts at once (the default handler is back after the first).
"""

from __future__ import annotations

import signal
import threading

import torch

from flashdraft.distributed import data_parallel
from flashdraft.distributed.ranks import world

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """`with GracefulStop() as stop:` … `if stop.requested(): …` (collective: every rank must call it)."""

    def __init__(self):
        self.signal_name: str | None = None
        self._saved: dict[int, object] = {}

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
        self.signal_name = signal.Signals(signum).name
        # The next signal of this kind acts as if we were not here (a second Ctrl-C really interrupts).
        signal.signal(signum, self._saved.get(signum, signal.SIG_DFL))

    def requested(self, device: torch.device) -> bool:
        """Whether any rank got a stop signal (all ranks agree, so they stop after the same step)."""
        if world().size == 1:
            return self.signal_name is not None
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        return bool(data_parallel.all_sum(flag).item() > 0)
