"""The random number generators' states in a checkpoint (rng.pt): torch CPU and CUDA, python `random`, numpy's
global RNG and any named torch.Generator, as tensors and numbers that `torch.load(weights_only=True)` reads."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

from flashdraft.train.checkpoint.manifest import CheckpointError

logger = logging.getLogger(__name__)


def capture_rng_state(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Global RNG states (torch CPU and CUDA, python, numpy) in a form `torch.load(weights_only=True)` reads."""
    version, py_state, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }


def restore_rng_state(
    state: dict, generators: dict[str, torch.Generator] | None = None, where: str | os.PathLike = "rng state"
) -> None:
    """Inverse of `capture_rng_state`: afterwards every RNG continues exactly where it was captured."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning(
                "%s: saved with %d CUDA devices, %d visible now; CUDA random numbers will differ from an "
                "uninterrupted run",
                where,
                len(cuda),
                count,
            )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    saved = state.get("generators") or {}
    for name, generator in (generators or {}).items():
        if name not in saved:
            raise CheckpointError(f"{where}: no state for generator {name!r} (saved: {sorted(saved) or 'none'})")
        generator.set_state(saved[name])
