"""Tests of flashdraft.speculative.engine: on the CPU in float64 with graphs off (exact to rounding), and on a CUDA
device in float32 with the CUDA graphs on (skipped without one)."""

from __future__ import annotations

import pytest
import torch

# (device, dtype, graphs): exactness in float64 on the CPU; the captured graphs and the GPU kernels in float32.
CONFIGS = [
    pytest.param(("cpu", torch.float64, False), id="cpu-f64"),
    pytest.param(
        ("cuda", torch.float32, True),
        id="cuda-f32-graphs",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]

# Logit tolerance against the reference: float64 rounding; float32 through different kernels (fla, Triton, cuBLAS).
ATOL = {torch.float64: 1e-10, torch.float32: 2e-4}
