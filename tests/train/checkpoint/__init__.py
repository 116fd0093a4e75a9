"""Tests of flashdraft.train.checkpoint, and the helpers they share: a tiny drafter with its optimizer and
scheduler, exact state comparison, and manifest edits."""

import json
import random

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from flashdraft.drafter import DFlashDraftModel
from flashdraft.target.tiny import tiny_config

LOGGER = "flashdraft.train.checkpoint"


def make_run(seed=0, fused=False, block_size=4):
    torch.manual_seed(seed)
    drafter = DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=4),
        num_layers=1,
        block_size=block_size,
        target_layer_ids=[1, 2],
        mask_token_id=250,
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    return drafter, optimizer, scheduler


def train_step(drafter, optimizer, scheduler):
    """One step on inputs drawn from the global RNG, so a wrongly restored RNG changes the result."""
    hidden = drafter(
        position_ids=torch.arange(7)[None],
        noise_embedding=torch.randn(1, 4, 64),
        target_hidden=torch.randn(1, 3, 128),
    )
    hidden.pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def trained(steps=2, **kwargs):
    run = make_run(**kwargs)
    for _ in range(steps):
        train_step(*run)
    return run


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def draws():
    return torch.rand(5), random.random(), np.random.rand(3).tolist()


def saved_steps(manager):
    return [step for step, _ in manager.checkpoints()]


def drop_manifest(path):
    (path / "MANIFEST.json").unlink()
    return "no MANIFEST.json"


def edit_manifest(path, edit):
    manifest = json.loads((path / "MANIFEST.json").read_text())
    edit(manifest)
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
