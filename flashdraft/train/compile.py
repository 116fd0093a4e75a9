"""Whether and how the drafter's layers are compiled in a training step (`train.compile`, `train.static_shapes`).

compile_drafter(drafter, cfg.train, device)   # torch.compile each decoder layer in place, as the config asks
"""

from __future__ import annotations

import torch

from flashdraft.config import resolve_switch


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """`train.compile` resolved for `device`: auto compiles on CUDA (with FlexAttention, see train/masks.py); a CPU
    compile needs a C++ toolchain and costs more than it saves at CPU sizes."""
    return resolve_switch("train.compile", setting, device.type == "cuda")


def static_shapes(setting: bool | str, compile_setting: bool | str, device: torch.device) -> bool:
    """`train.static_shapes` resolved: auto follows `train.compile`."""
    return resolve_switch("train.static_shapes", setting, compile_enabled(compile_setting, device))


def compile_layers(drafter, setting: bool | str, device: torch.device, *, dynamic: bool | None = None) -> bool:
    """torch.compile each decoder layer in place (`Module.compile`: parameter names and checkpoints unchanged).

    The layers share one code path, so one graph serves all of them; it fuses the RMSNorms, RoPE, SwiGLU and the
    autocast casts around the matmuls, and traces FlexAttention into its fused kernels. `dynamic=False` (static
    shapes) compiles each new shape on its own instead of one dynamic-shape graph. Returns whether it compiled.
    """
    if not compile_enabled(setting, device):
        return False
    for layer in drafter.layers:
        layer.compile(dynamic=dynamic)
    return True


def compile_drafter(drafter, train, device: torch.device) -> bool:
    """`compile_layers` as `train` (the config's train section) asks: static shapes compile with dynamic=False."""
    static = static_shapes(train.static_shapes, train.compile, device)
    return compile_layers(drafter, train.compile, device, dynamic=False if static else None)


__all__ = ["compile_drafter", "compile_enabled", "compile_layers", "static_shapes"]
