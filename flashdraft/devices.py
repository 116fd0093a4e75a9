"""Which device and dtype a run uses, and the autocast its drafter computes under: the one place "auto" is decided.

device = resolve_device("auto")              # cuda when there is one, else cpu
dtype = resolve_dtype("auto", device)        # bf16 on the GPU, float32 on the CPU
with autocast(device): ...                   # bf16 compute over float32 weights on the GPU; off on the CPU

Every command (train, features, eval, regenerate, doctor, bench) and every loader (flashdraft.target.load) resolves
its device and dtype settings here; tests/test_entry_points.py fails on a module that decides "auto" itself.
"""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str | torch.device, *, field: str = "device") -> torch.device:
    """`name` ("auto", "cpu", "cuda", "cuda:1", or a torch.device) as a torch.device; "auto" is cuda when one is
    available. `field` names the setting in the error raised when cuda is asked for and there is none."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{field} = {name}, but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`name` ("auto", "bfloat16", "float16", "float32", or a torch.dtype) as a torch.dtype; "auto" is bf16 on a
    GPU, float32 else."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 compute on the GPU with float32 master weights; plain float32 on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
