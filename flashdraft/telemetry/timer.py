"""Wall-clock time, the one timer of flashdraft: named phases of a run, laps between log lines, marks inside a step.

    timer = Timer(device)
    with timer.phase("target"):           # a phase: its seconds add up under its name (the device synchronised at
        ...                               # its end, so queued GPU work counts where it was queued)
    timer.lap()                           # seconds since the previous lap: a log window's time, for its throughput
    train_step(..., mark=timer.mark)      # points inside a step, recorded without a host sync (CUDA events on a GPU)
    seconds = timer.lap()                 # ...the step's wall time; timer.lap_marks: {phase: ms} between its marks
    timer.line(); timer.write(out / "wall_time.json")     # where the run's time went, by phase

A run's cost is not only its steps: on a freshly started GPU machine loading the target and proving its fast
kernels (their first JIT compilation and autotuning), the first step's compiles and the evaluations can take longer
than the training itself. The phases are timed where they begin and end; the steps are not synchronised one by one
(that would slow them): the loop takes their time as the loop's less the phases inside it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from flashdraft.io.atomic import atomic_write_text


def synchronize(device: torch.device | None = None) -> None:
    """Wait for the GPU, where one is in use (a CPU run has nothing to wait for)."""
    if device is not None and device.type != "cuda":
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Seconds since it was made: by named phase (a phase timed twice, every checkpoint, adds up), by lap, and
    between the marks of a lap. `device`: where work is queued (a CUDA device: marks are CUDA events, and a lap
    waits for the device); None synchronises whatever GPU is in use."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.started = self._lap_start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.lap_marks: dict[str, float] = {}
        self._marks: list[tuple[str, object]] = []

    # ---- phases ------------------------------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def move(self, source: str, name: str, seconds: float) -> None:
        """Count `seconds` of phase `source` as phase `name` instead (a part timed inside it, e.g. the probe)."""
        if not 0 <= seconds <= self.seconds.get(source, 0.0) + 1e-6:
            raise ValueError(f"cannot move {seconds:.3f} s of {source!r}: it has {self.seconds.get(source, 0.0):.3f} s")
        self.seconds[source] -= seconds
        self.add(name, seconds)

    def since_start(self) -> float:
        return time.perf_counter() - self.started

    # ---- laps and marks ----------------------------------------------------------------------------------------

    def lap(self) -> float:
        """Seconds since the previous lap (or since the timer was made), the device synchronised first. The marks
        of the lap that ends are resolved into `lap_marks`, {phase: ms since the mark before it} (a phase marked
        several times, once per micro-batch, adds up); the next lap starts with none."""
        synchronize(self.device)
        now = time.perf_counter()
        self.lap_marks = {}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:], strict=False):
            ms = a.elapsed_time(b) if self._cuda else (b - a) * 1e3
            self.lap_marks[name] = self.lap_marks.get(name, 0.0) + ms
        seconds, self._lap_start = now - self._lap_start, now
        self._marks = [("", self._point(now))]
        return seconds

    def mark(self, name: str) -> None:
        """The work queued since the previous mark (or the lap's start) was phase `name`."""
        self._marks.append((name, self._point()))

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _point(self, now: float | None = None):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter() if now is None else now

    # ---- the report --------------------------------------------------------------------------------------------

    def report(self) -> dict:
        """{"total_s", "phases_s" (in the order first seen), "other_s"}: other is what no phase covers (imports
        before the timer, the optimizer's build, logging)."""
        total = self.since_start()
        phases = {name: round(s, 3) for name, s in self.seconds.items()}
        return {"total_s": round(total, 3), "phases_s": phases, "other_s": round(total - sum(self.seconds.values()), 3)}

    def line(self) -> str:
        """'wall time 152.2 s: target 45.1, data 3.0, ..., other 2.0'."""
        r = self.report()
        parts = [f"{name} {s:.1f}" for name, s in r["phases_s"].items()] + [f"other {r['other_s']:.1f}"]
        return f"wall time {r['total_s']:.1f} s: " + ", ".join(parts)

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.report(), indent=1))
