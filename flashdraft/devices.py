"""Which device and dtype a run uses, and the autocast its drafter computes under.

device = resolve_device("auto")              # cuda when there is one, else cpu
dtype = resolve_dtype("auto", device)        # bf16 on the GPU, float32 on the CPU
with autocast(device): ...                   # bf16 compute over float32 weights on the GPU; off on the CPU
"""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str, *, field: str = "device") -> torch.device:
    """`name` ("auto", "cpu", "cuda", ...) as a torch.device; "auto" is cuda when one is available. `field` names
    the setting in the error raised when cuda is asked for and there is none."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{field} = cuda, but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`name` ("auto", "bfloat16", "float16", "float32") as a torch.dtype; "auto" is bf16 on a GPU, float32 else."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 compute on the GPU with float32 master weights; plain float32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
