"""Where a training run's wall time went, by phase: the first-step log line, a closing line and OUT/wall_time.json.

A run's cost is not only its steps: on a freshly started GPU machine loading the target and proving its fast
kernels (their first JIT compilation and autotuning), the first step's compiles and the measured-τ decoding can
take longer than the training itself. The phases are timed where they begin and end, with the GPU synchronised at
each end; the steps are not synchronised one by one (that would slow them): their time is what the training loop
took less the phases inside it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from flashdraft.io.atomic import atomic_write_text


def synchronize() -> None:
    """Wait for the GPU, where one is in use (a CPU run has nothing to wait for)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class WallClock:
    """Seconds per named phase since the clock was made; a phase measured twice (every checkpoint) adds up."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize()
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

    def report(self) -> dict:
        """{"total_s", "phases_s" (in the order first seen), "other_s"}: other is what no phase covers (imports
        before the clock, the optimizer's build, logging)."""
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
