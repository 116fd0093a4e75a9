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


# Kernel families, by substrings of their names (first match wins): where a profiled call's GPU time goes.
KERNEL_FAMILIES = (
    # attention before GEMM: cuDNN's attention kernels carry "sm90_" in their names too
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("GEMM", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "splitk", "sm90_", "cublas")),
    (
        "delta rule (fla)",
        ("gated_delta", "fused_recurrent", "chunk_", "recompute_w_u", "solve_tril", "inverse", "kkt", "cumsum"),
    ),
    ("conv (flashdraft)", ("causal_conv",)),
    ("norms", ("rms", "layer_norm", "norm_fwd", "layernorm", "l2norm")),
    ("softmax", ("softmax",)),
    ("copies / index", ("copy", "index", "cat", "gather", "scatter")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((family for family, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other elementwise")


def kernel_breakdown(fn, cuda: bool = True, top: int = 15) -> dict:
    """Profile one call of `fn` (already warm): GPU time by kernel family and the `top` kernels (on a CPU, torch
    ops' self CPU time instead, so a smoke run exercises the same code)."""
    from torch.profiler import ProfilerActivity, profile

    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    kernels: dict[str, list] = {}
    for evt in prof.events():
        if evt.device_type != kind:
            continue
        row = kernels.setdefault(evt.name, [0, 0.0])
        row[0] += 1
        row[1] += (evt.device_time if cuda else evt.self_cpu_time_total) / 1e3  # us -> ms
    families: dict[str, list] = {}
    for name, (count, ms) in kernels.items():
        fam = families.setdefault(kernel_family(name), [0, 0.0])
        fam[0] += count
        fam[1] += ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "gpu_ms": sum(ms for _, ms in kernels.values()),
        "kernels": sum(c for c, _ in kernels.values()),
        "families": {f: {"count": c, "ms": ms} for f, (c, ms) in sorted(families.items(), key=lambda kv: -kv[1][1])},
        "top": [{"name": k[:120], "count": c, "ms": ms} for k, (c, ms) in ranked],
    }
