"""Grow a trained DFlash drafter: more layers and/or wider MLPs that start as the same function, to fine-tune.

    python tools/grow_drafter.py --drafter flashdraft/bundled/drafter --out build/tiny_target/grown \\
        --intermediate-size 1280 [--extra-layers 2]
    flashdraft train --config examples/tiny_target/drafter.yaml target.path=bundled \\
        drafter.init_from=build/tiny_target/grown [drafter.num_layers=5] ...

Training a larger drafter from scratch costs the steps the trained one already took. Growing keeps them: each new
layer is a copy of the last trained layer with its two output projections (attention `o_proj`, MLP `down_proj`)
zeroed, so it adds nothing to the residual stream until training moves them; each new MLP channel gets fresh
`gate_proj`/`up_proj` rows and a zero `down_proj` column, so it too adds nothing at first. The grown drafter drafts
exactly what the original drafts (checked here before writing), and gradients reach every new weight from the
first step on through the zeroed projections.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from flashdraft.drafter import DFlashDraftModel

SAME_FUNCTION = 1e-9
"""The largest relative output difference (in float64) of a grown drafter that computes the same function."""


def grow(drafter: DFlashDraftModel, extra_layers: int = 0, intermediate_size: int | None = None) -> DFlashDraftModel:
    """A float32 copy of `drafter` with `extra_layers` more layers and MLPs `intermediate_size` wide (None: as now),
    computing the same function. ValueError for a negative count or a narrower MLP."""
    config = copy.deepcopy(drafter.config)
    layers, width = config.num_hidden_layers, config.intermediate_size
    intermediate_size = width if intermediate_size is None else intermediate_size
    if extra_layers < 0:
        raise ValueError(f"--extra-layers must be >= 0, got {extra_layers}")
    if intermediate_size < width:
        raise ValueError(f"--intermediate-size {intermediate_size} is narrower than the drafter's {width}")
    config.num_hidden_layers = layers + extra_layers
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * extra_layers
    config.intermediate_size = intermediate_size
    grown = DFlashDraftModel(config).float()  # fresh init: only the new MLP rows keep it
    old = {name: w.float() for name, w in drafter.state_dict().items()}
    state = grown.state_dict()
    with torch.no_grad():
        for name, weight in state.items():
            parts = name.split(".")
            if parts[0] == "layers" and int(parts[1]) >= layers:
                parts[1] = str(layers - 1)  # a new layer starts as a copy of the last trained one
            source = old[".".join(parts)]
            if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                weight[:width].copy_(source)
            elif name.endswith("mlp.down_proj.weight"):
                weight.zero_()
                weight[:, :width].copy_(source)
            else:
                weight.copy_(source)
        for i in range(layers, layers + extra_layers):
            state[f"layers.{i}.self_attn.o_proj.weight"].zero_()
            state[f"layers.{i}.mlp.down_proj.weight"].zero_()
    grown.load_state_dict(state)
    return grown


def output_difference(a: DFlashDraftModel, b: DFlashDraftModel, context: int = 40, seed: int = 0) -> float:
    """Largest difference of two drafters' hidden outputs on one random block and context, relative to the largest
    output. Computed on float64 copies: a wider MLP sums its products in another order, which float32 rounds
    differently, by an amount that depends on the CPU's matmul kernels; float64 leaves only a difference in the
    function."""
    gen = torch.Generator().manual_seed(seed)
    width = a.config.hidden_size
    features = torch.randn(1, context, width * len(a.target_layer_ids), generator=gen, dtype=torch.float64)
    block = torch.randn(1, a.block_size, width, generator=gen, dtype=torch.float64)
    positions = torch.arange(context + a.block_size)[None]
    with torch.no_grad():
        outs = [
            copy.deepcopy(m).double()(position_ids=positions, noise_embedding=block, target_hidden=features)
            for m in (a, b)
        ]
    return ((outs[0] - outs[1]).abs().max() / outs[0].abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", type=Path, required=True, help="the trained drafter's checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="where the grown drafter is written")
    p.add_argument("--extra-layers", type=int, default=0)
    p.add_argument("--intermediate-size", type=int, default=None, help="the MLPs' new width (default: unchanged)")
    a = p.parse_args(argv)
    drafter = DFlashDraftModel.from_pretrained(a.drafter)
    dtype = next(drafter.parameters()).dtype  # the grown drafter is written in the dtype it was read in
    try:
        grown = grow(drafter, a.extra_layers, a.intermediate_size)
    except ValueError as exc:
        raise SystemExit(f"grow_drafter: {exc}") from None
    gap = output_difference(drafter, grown)
    if gap > SAME_FUNCTION:
        raise SystemExit(f"grow_drafter: the grown drafter differs from {a.drafter} by {gap:.3g}; not written")
    grown.to(dtype).save_pretrained(a.out)
    count = sum(w.numel() for w in grown.parameters())
    print(
        f"{a.out}: {grown.config.num_hidden_layers} layers, MLPs {grown.config.intermediate_size} wide, "
        f"{count:,} parameters (was {sum(w.numel() for w in drafter.parameters()):,}); same outputs "
        f"(largest relative difference {gap:.1g}); fine-tune with drafter.init_from={a.out} "
        f"drafter.num_layers={grown.config.num_hidden_layers}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
