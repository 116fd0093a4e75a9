"""One step of the engine, run eagerly or replayed from a CUDA graph captured once.

A step is a function of static buffers only (inputs are written into buffers before it runs, outputs copied
into buffers inside it), so its graph can be replayed with new data. Capture follows torch's recipe: warm-up
calls on a side stream (they also run Triton autotuning and cuBLAS set-up, which must not happen inside a
capture), then one capture. Warm-up calls really run: a caller captures before it fills its caches.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable

import torch


class Step:
    """`step()` runs `fn` eagerly, or replays its CUDA graph once `capture()` has recorded it."""

    def __init__(self, fn: Callable[[], None], name: str):
        self.fn, self.name = fn, name
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self, pool=None, warmup: int = 2) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with _no_garbage_collection(), torch.cuda.graph(graph, pool=pool):
                self.fn()
        except Exception as exc:
            raise RuntimeError(f"capturing step '{self.name}': {exc}") from exc
        self.graph = graph

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()

    def reset(self) -> None:
        self.graph = None


@contextlib.contextmanager
def _no_garbage_collection():
    """Collect now, and not during the capture.

    A dead reference cycle (an engine dropped for a larger one: its steps hold bound methods of it) may hold
    CUDA graphs and memory; collected in the middle of a capture, their destructors free device memory, which is
    illegal while a stream is capturing and spoils the capture ("operation failed due to a previous error
    during capture"). torch.cuda.graph no longer collects on entry (torch.compiler.config.force_cudagraph_gc).
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_all(steps: list[Step]) -> None:
    """Capture every step into graphs sharing one memory pool.

    Sharing is safe because the steps run one after another on one stream and every value that outlives a
    step lives in a buffer allocated outside the graphs.
    """
    pool = torch.cuda.graph_pool_handle()
    for step in steps:
        step.capture(pool)
    torch.cuda.synchronize()


def capture_or_warn(step: Step, pool) -> str | None:
    """Capture `step` into `pool`; a capture that fails is warned about and leaves the step eager (a kernel that
    cannot be captured must not cost the user the generation). Returns the error, or None."""
    try:
        with torch.inference_mode():
            step.capture(pool)
    except Exception as exc:
        step.reset()
        warnings.warn(f"flashdraft engine: {exc}; running it eagerly", stacklevel=3)
        return f"{type(exc).__name__}: {exc}"
    return None
