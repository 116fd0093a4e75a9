"""Writing the files of one checkpoint into its temporary directory, the manifest last, everything fsynced: in one
process, or every rank's shards under torchrun. Publishing the directory is the manager's (manager.py)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashdraft.io.atomic import fsync_tree, write_synced
from flashdraft.train.checkpoint.manifest import SHARDED, write_manifest


def trainer_state_json(step: int, trainer_state: dict) -> str:
    """trainer_state.json of `step`: `trainer_state` with its step, checked JSON-serialisable key by key."""
    state = dict(trainer_state)
    if state.setdefault("step", step) != step:
        raise ValueError(f"trainer_state['step'] = {state['step']!r} but the checkpoint is for step {step}")
    for key, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trainer_state[{key!r}] is not JSON-serialisable: {exc}") from None
    return json.dumps(state, indent=1) + "\n"


@dataclass(frozen=True)
class ReplicatedState:
    """What every kind of checkpoint holds once, however many ranks wrote it: scheduler.pt, rng.pt (rank 0's RNG
    states under torchrun) and trainer_state.json (its text, from `trainer_state_json`)."""

    scheduler: Any
    rng: dict
    state_json: str

    def write(self, directory: Path) -> None:
        torch_save(self.scheduler.state_dict(), directory / "scheduler.pt")
        torch_save(self.rng, directory / "rng.pt")
        write_synced(directory / "trainer_state.json", self.state_json)


def write_checkpoint(
    directory: Path, step: int, drafter: nn.Module, optimizer: torch.optim.Optimizer, replicated: ReplicatedState
) -> None:
    """One process: the drafter (unwrapped), optimizer.pt and the replicated files, then the manifest."""
    drafter.save_pretrained(directory / "drafter")
    torch_save(optimizer.state_dict(), directory / "optimizer.pt")
    replicated.write(directory)
    write_manifest(directory, step)
    fsync_tree(directory)


def write_sharded(
    directory: Path,
    step: int,
    drafter: nn.Module,
    optimizer: torch.optim.Optimizer,
    replicated: ReplicatedState,
    full_weights: dict | None,
) -> None:
    """Under torchrun, collective: every rank writes its DCP shards of {"model", "optimizer"}; rank 0, which
    passes the gathered `full_weights` (None on the others), adds drafter/, the replicated files and the manifest."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(drafter, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory / SHARDED)
    if full_weights is None:
        return
    _save_plain_drafter(drafter, full_weights, directory / "drafter")
    replicated.write(directory)
    write_manifest(directory, step, ranks=dist.get_world_size())
    fsync_tree(directory)


def torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)


def _save_plain_drafter(drafter: nn.Module, state: dict, directory: Path) -> None:
    """save_pretrained of `drafter`'s own class (not FSDP2's wrapper subclass, whose name would become the
    checkpoint's `architectures`) holding the gathered full weights `state`."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(drafter).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = cls(copy.deepcopy(drafter.config))
    plain.load_state_dict(state, assign=True, strict=True)
    plain.save_pretrained(directory)
