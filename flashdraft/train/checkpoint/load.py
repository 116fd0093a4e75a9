"""Restoring a run from one checkpoint: weights, optimizer, scheduler and RNG states, and the trainer state.

Every file this process deserialises is hashed in the same pass (the bytes read are the bytes checked), and all of
them before anything is restored. Either kind of checkpoint (one process, or sharded by any number of ranks) loads
in either setting: torch.distributed.checkpoint's state-dict API re-shards.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from flashdraft.distributed import ranks
from flashdraft.train.checkpoint.manifest import (
    MANIFEST,
    SHARDED,
    SHARDED_INSTEAD,
    CheckpointError,
    check_hashes,
    is_weights,
    read_manifest,
    read_verified,
)
from flashdraft.train.checkpoint.rng import restore_rng_state


def restore(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generators: dict[str, torch.Generator] | None = None,
) -> dict:
    """Verify `path`, restore the weights of `model` (the drafter, unwrapped), the optimizer, scheduler and RNG
    states; returns the trainer_state. A damaged checkpoint leaves the model and optimizer as they were. DCP's
    shard files, which DCP reads itself, are hashed just before (on rank 0 under torchrun)."""
    path = Path(path)
    _, entries = read_manifest(path)
    sharded = SHARDED_INSTEAD["optimizer.pt"] in entries
    # A sharded checkpoint's drafter/ weights are its exported copy: the model state comes from the shards.
    read = [n for n in entries if not n.startswith(f"{SHARDED}/") and not (sharded and is_weights(n))]
    _verify_once(path, entries, [n for n in entries if n not in read])
    blobs = read_verified(path, entries, read)
    state = _json(path, "trainer_state.json", blobs)
    _check_drafter_config(_json(path, "drafter/config.json", blobs), model, path / "drafter" / "config.json")
    if ranks.initialized() or sharded:
        _load_state_dicts(path, model, optimizer, blobs)
    else:
        try:
            model.load_state_dict(_weights(path, blobs), strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{path / 'drafter'}: weights do not fit the drafter: {exc}") from None
        try:
            optimizer.load_state_dict(torch_load(path / "optimizer.pt", blobs["optimizer.pt"]))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit the optimizer: {exc}") from None
    scheduler.load_state_dict(torch_load(path / "scheduler.pt", blobs["scheduler.pt"]))
    restore_rng_state(torch_load(path / "rng.pt", blobs["rng.pt"]), generators, where=path / "rng.pt")
    return state


def _verify_once(path: Path, entries: dict, names: list[str]) -> None:
    """Hash `names` against the manifest: on rank 0 under torchrun (the others take its verdict), else here."""
    if not ranks.initialized():
        check_hashes(path, entries, names)
        return
    import torch.distributed as dist

    error = None
    if dist.get_rank() == 0:
        try:
            check_hashes(path, entries, names)
        except CheckpointError as exc:
            error = str(exc)
    ranks.barrier()  # while rank 0 hashes, the others wait through the store, not in a collective
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])


def _load_state_dicts(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, blobs: dict) -> None:
    """Model and optimizer state through torch.distributed.checkpoint's state-dict API, which re-shards: from a
    sharded checkpoint (any number of ranks) or a one-process one (loaded whole), into a sharded or plain model.
    `blobs`: the verified bytes of the checkpoint's other files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    sharded = path / SHARDED
    if "optimizer.pt" not in blobs:
        model_state, optim_state = get_state_dict(model, optimizer)
        try:
            dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=sharded)
        except Exception as exc:  # DCP reports a mismatch as a CheckpointException listing every rank's error
            raise CheckpointError(f"{sharded}: does not fit the drafter and optimizer: {exc}") from None
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        return
    weights = _weights(path, blobs)
    optim = torch_load(path / "optimizer.pt", blobs["optimizer.pt"])
    # optimizer.pt numbers the parameters in the order the optimizer was given them (the trainable ones, in
    # module order); the state-dict API names them by their module path.
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    try:
        optim = {
            "state": {names[i]: v for i, v in optim["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]],
        }
        set_state_dict(
            model,
            optimizer,
            model_state_dict=weights,
            optim_state_dict=optim,
            options=StateDictOptions(full_state_dict=True, strict=True),
        )
    except (IndexError, KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path}: weights or optimizer.pt do not fit the drafter: {exc}") from None


def _check_drafter_config(saved: dict, model: nn.Module, where: Path) -> None:
    """Weights of the same shapes can still belong to another recipe (block size, mask token, target layers)."""
    dflash = saved.get("dflash_config") or {}
    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        if not hasattr(model, name):
            continue
        value = dflash.get(name, saved.get(name))
        if value is not None and value != getattr(model, name):
            raise CheckpointError(
                f"{where}: {name} = {value!r}, but the drafter being resumed has "
                f"{getattr(model, name)!r}; resume with the configuration the checkpoint was trained with"
            )


def torch_load(path: Path, data: bytes | None = None) -> Any:
    """torch.load(weights_only=True) of `data` (the verified bytes of `path`), else of the file `path`."""
    try:
        source = io.BytesIO(data) if data is not None else path
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read with torch.load(weights_only=True): {exc}") from None


def _json(path: Path, name: str, blobs: dict[str, bytes]) -> dict:
    try:
        value = json.loads(blobs[name].decode("utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{path / name}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path / name}: expected a JSON object, got {type(value).__name__}")
    return value


def _weights(path: Path, blobs: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The drafter's tensors from the *.safetensors files the manifest lists (never from a glob)."""
    weights = {}
    for name in sorted(n for n in blobs if is_weights(n)):
        try:
            weights.update(load_safetensors(blobs[name]))
        except SafetensorError as exc:
            raise CheckpointError(f"{path / name}: not a readable safetensors file ({exc})") from None
    if not weights:
        raise CheckpointError(f"{path / MANIFEST}: lists no drafter/*.safetensors weights")
    # safetensors' load(bytes) returns the tensors in a random order per process; under torchrun every rank must
    # hand set_state_dict the same order (its collectives follow it).
    return dict(sorted(weights.items()))
