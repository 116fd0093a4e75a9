"""Tests of flashdraft.speculative.engine: on the CPU in float64 with graphs off (exact to rounding), and on a CUDA
device in float32 with the CUDA graphs on (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class HostReads(TorchDispatchMode):
    """The operators run inside it that a CUDA graph cannot capture, in `found`: a device value read on the host
    (`.item()`, `bool(t)`, a 0-d tensor used as a Python index all reach `_local_scalar_dense`) or an output whose
    shape depends on values (nonzero, masked_select, indexing with a boolean mask). On the CPU, where the engine runs
    its steps eagerly, this is how a step that a GPU would refuse to capture shows. Run the step under no_grad, not
    inference mode: there a CPU tensor's value is read without passing through the dispatcher."""

    HOST = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.HOST:
            self.found.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
        ):
            self.found.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))
