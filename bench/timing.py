"""The one timing helper the benchmarks share: CUDA events around single calls, median of many."""

from __future__ import annotations

import torch


def events_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` between two CUDA events, synchronising after each call.

    Host work inside `fn` (Python, launches) counts: this is what one eager call costs a caller, not the GPU time
    of back-to-back calls (use triton.testing.do_bench or a CUDA graph for that).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
