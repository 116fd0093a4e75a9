"""How the drafter runs in a training step: its attention path and whether its layers are compiled.

    kind = attention_kind(cfg.train.attention, device)        # "flex" or "sdpa"; auto: flex on CUDA, sdpa elsewhere
    mask = drafter_mask(batch, drafter.config, kind)           # a BlockMask, or the dense boolean mask
    compile_drafter(drafter, cfg.train, device)                # torch.compile each decoder layer in place

Both paths apply the one predicate of `recipe._visible`. FlexAttention skips the masked-out blocks (a block sees
only the context before its anchor: ~15% of the dense scores at 512 anchors over 3072 tokens) and reads K/V once
per KV head; its backward does not run on the CPU, where the dense mask with SDPA is the path (cheap at CPU sizes).
"""

from __future__ import annotations

import torch

from flashdraft.config import resolve_switch
from flashdraft.drafter.recipe import DraftBatch, dense_block_mask, flex_block_mask, layer_mask_rules

ATTENTION = ("auto", "flex", "sdpa")


def attention_kind(setting: str, device: torch.device) -> str:
    """`train.attention` resolved for `device`: "flex" or "sdpa"."""
    if setting not in ATTENTION:
        raise ValueError(f"train.attention = {setting!r}: must be one of {', '.join(ATTENTION)}")
    if setting == "auto":
        # Compiled FlexAttention at static shapes (train.static_shapes): P4 met, and on the H200 (2026-12-03) the
        # ragged-batch GPU test passed and a real tiny-target run matched the SDPA run's losses step for step.
        return "flex" if device.type == "cuda" else "sdpa"
    if setting == "flex" and device.type != "cuda":
        raise ValueError(f"train.attention = flex needs a CUDA device (training on {device.type}): FlexAttention has "
                         "no backward on the CPU; use auto or sdpa")  # fmt: skip
    return setting


def mask_rule(config) -> dict:
    """The `window`/`causal` rule all drafter layers share (`layer_mask_rules`); one training mask serves them all."""
    rules = layer_mask_rules(config)
    distinct = {tuple(sorted(r.items())) for r in rules}
    if len(distinct) > 1:
        raise ValueError(f"drafter layers mix attention rules {rules}: one training mask cannot serve them all; give "
                         "every layer the same type (drafter.overrides.layer_types)")  # fmt: skip
    return rules[0]


def drafter_mask(batch: DraftBatch, config, kind: str):
    """The drafter's `attention_mask` for `batch`: a FlexAttention `BlockMask` ("flex") or a dense boolean mask."""
    rule = mask_rule(config)
    if kind == "flex":
        # Built once per micro-batch and shared by every layer; compiled on the GPU, where the eager builder would
        # materialise (Q, T + Q) index tensors (gigabytes at 32K tokens).
        return flex_block_mask(batch, **rule, compile=batch.anchors.is_cuda)
    return dense_block_mask(batch, **rule)


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """`train.compile` resolved for `device`: auto compiles on CUDA (with flex, see above); a CPU compile needs a C++
    toolchain and costs more than it saves at CPU sizes."""
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


__all__ = [
    "ATTENTION",
    "attention_kind",
    "compile_drafter",
    "compile_enabled",
    "compile_layers",
    "drafter_mask",
    "mask_rule",
    "static_shapes",
]
