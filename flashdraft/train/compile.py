"""Whether and how the drafter's layers are compiled in a training step (`train.compile`, `train.static_shapes`).

compile_drafter(drafter, cfg.train, device)   # torch.compile each decoder layer in place, as the config asks
decided = resolve_auto_compile(cfg, device, run_flops, peak_flops)   # a run's `auto`s: compile only if it pays back

The rule of `auto` on a GPU: compiling (the drafter's layers, FlexAttention, the target's glue) costs a fixed time
on a fresh machine (`COMPILE_SECONDS`) and then saves a share of every step's time (`COMPILE_GAIN`, the least share
the benchmarks saw it save; docs/benchmarks.md). It pays back when that share of the run's compute time reaches the
fixed cost. The compute time is the run's cost-model FLOPs (`telemetry.flops.step_flops`, every step at full length
and every anchor) at the GPU's peak — a lower bound of the real time — so `auto` compiles long runs of a large
target and never the bundled tiny target.
"""

from __future__ import annotations

import logging

import torch

from flashdraft.config import resolve_switch

logger = logging.getLogger(__name__)

COMPILE_SECONDS = 60.0
"""What compiling costs a run on a fresh machine, about (less with warm Inductor and Triton caches)."""
COMPILE_GAIN = 0.1
"""The least share of a step's time compiling saves where it is used (the target's forward; more of the drafter's
step)."""
NOMINAL_PEAK_FLOPS = 400e12
"""FLOP/s assumed for a GPU missing from flashdraft's table (telemetry.flops.GPUS)."""


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


def compile_pays_back(run_flops: float, peak_flops: float | None) -> tuple[bool, float]:
    """(whether compiling pays back within a run of `run_flops`, the run's seconds at `peak_flops`): see the
    module docstring."""
    seconds = run_flops / (peak_flops or NOMINAL_PEAK_FLOPS)
    return seconds * COMPILE_GAIN >= COMPILE_SECONDS, seconds


def resolve_auto_compile(cfg, device: torch.device, run_flops: float, peak_flops: float | None) -> dict:
    """Set the `auto` compile switches of `cfg` for this run on `device` (in place) and return those it set.

    On CUDA: `train.compile`, `target.compile` and `train.attention` become compiled / compiled / flex where
    compiling pays back (`compile_pays_back`), eager / eager / sdpa where it does not; `train.static_shapes` follows
    `train.compile` as before. A value given explicitly is kept. On a CPU `auto` already means eager: nothing is set.
    """
    if device.type != "cuda":
        return {}
    pays, seconds = compile_pays_back(run_flops, peak_flops)
    decided = {}
    if cfg.train.compile == "auto":
        decided["train.compile"] = cfg.train.compile = pays
    if cfg.target.compile == "auto" and not cfg.target.shard:
        decided["target.compile"] = cfg.target.compile = pays
    if cfg.train.attention == "auto":
        decided["train.attention"] = cfg.train.attention = "flex" if pays else "sdpa"
    if decided:
        logger.info(
            "auto compile: %s (the run is %.0f s of compute at the GPU's peak; a ~%.0f s compile pays back from %.0f s)",
            ", ".join(f"{k}={str(v).lower()}" for k, v in decided.items()),
            seconds,
            COMPILE_SECONDS,
            COMPILE_SECONDS / COMPILE_GAIN,
        )
    return decided


__all__ = [
    "compile_drafter",
    "compile_enabled",
    "compile_layers",
    "compile_pays_back",
    "resolve_auto_compile",
    "static_shapes",
]
