"""AdamW and the warm-up + cosine learning-rate schedule of the DFlash recipe (lr 6e-4, warm-up 4%, clip 1.0)."""

from __future__ import annotations

import math

import torch

from flashdraft.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # Master weights stay float32 (the drafter is small); the GPU forward runs under bf16 autocast.
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=device.type == "cuda",
    )


def warmup_cosine(total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.0):
    """Multiplier of the peak lr at each step: linear warm-up, then cosine down to `min_lr_ratio`."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_scheduler(optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))
