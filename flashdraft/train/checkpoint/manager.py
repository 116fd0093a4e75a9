"""The checkpoints of one run in `OUT/checkpoints/`: each save written into a `.tmp-` directory and published by a
rename, the `latest` pointer, the newest checkpoint that verifies, pruning to the `keep` newest, all under the
output directory's lock (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashdraft.distributed import ranks
from flashdraft.io import lock
from flashdraft.io.atomic import atomic_write_text, replace_directory
from flashdraft.io.space import room_for
from flashdraft.train.checkpoint.load import restore
from flashdraft.train.checkpoint.manifest import MANIFEST, CheckpointError, CheckpointFormatError, verify
from flashdraft.train.checkpoint.rng import capture_rng_state
from flashdraft.train.checkpoint.save import ReplicatedState, trainer_state_json, write_checkpoint, write_sharded

logger = logging.getLogger(__name__)

POINTER = "latest"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Room for what is not a tensor (configs, pickled containers, the manifest) in the size estimate of a checkpoint.
_OVERHEAD = 1 << 20


class CheckpointManager:
    """Checkpoints of one run in `OUT/checkpoints/`; keeps the `keep` most recent complete ones."""

    def __init__(self, out_dir: str | os.PathLike, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep}: must be >= 1 (the checkpoint just written is always kept)")
        self.out = Path(out_dir)
        self.root = self.out / "checkpoints"
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every `step_*` directory, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    # ---- writing ---------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        drafter: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        trainer_state: dict,
        *,
        generators: dict[str, torch.Generator] | None = None,
    ) -> Path:
        """Write the checkpoint of `step` atomically, update `latest`, prune old ones; returns its directory.

        `generators`: extra named torch.Generator objects whose states are stored beside the global RNGs (pass
        the same names to `load`).
        """
        if step < 0:
            raise ValueError(f"step = {step}: must be >= 0")
        # First, before anything else can draw a random number.
        replicated = ReplicatedState(scheduler, capture_rng_state(generators), trainer_state_json(step, trainer_state))
        if ranks.initialized():
            return self._save_sharded(step, drafter, optimizer, replicated)
        final = self.path_for(step)
        with lock.hold(self.out, "train") as held, self._room(final, estimate_bytes(drafter, optimizer)):
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp(held)
            tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.root))
            try:
                write_checkpoint(tmp, step, unwrap(drafter), optimizer, replicated)
                self._install(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._write_pointer(final.name)
            self._prune(step, held)
        logger.info("checkpoint %s written", final)
        return final

    def _save_sharded(self, step: int, drafter: nn.Module, optimizer, replicated: ReplicatedState) -> Path:
        """`save` under torchrun: every rank writes its DCP shards into rank 0's temporary directory, then rank 0
        adds the replicated files, the manifest, and publishes the directory as in one process."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        main = dist.get_rank() == 0
        final = self.path_for(step)
        with contextlib.ExitStack() as stack:
            held = stack.enter_context(lock.hold(self.out, "train")) if main else None
            # drafter/ holds the gathered weights once more, beside their shards
            stack.enter_context(self._room(final, estimate_bytes(drafter, optimizer, weights_twice=True)))
            # Collective (an all-gather of every shard); only rank 0 keeps the result, in CPU memory.
            full = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            tmp = None
            if main:
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_stale_tmp(held)
                tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.root)
            box = [tmp]
            dist.broadcast_object_list(box, src=0)
            tmp = Path(box[0])
            try:
                write_sharded(tmp, step, drafter, optimizer, replicated, full if main else None)
                if main:
                    self._install(tmp, final)
            except BaseException:
                if main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            # Nobody goes on (and e.g. saves again, or resumes from it) before the checkpoint is published; through the
            # store, as rank 0 alone hashes and installs it.
            ranks.barrier()
            if main:
                self._write_pointer(final.name)
                self._prune(step, held)
                logger.info("checkpoint %s written", final)
        return final

    def _room(self, final: Path, needed: int):
        """Out of room while writing `final`: StorageFull naming the directory, the size, what is still intact."""
        previous = [p for _, p in reversed(self.checkpoints()) if p != final and (p / MANIFEST).is_file()]
        hint = (
            f"Nothing of it was kept; the newest complete checkpoint, {previous[0]}, is intact: make room, then "
            "continue with --resume"
            if previous
            else "Nothing of it was kept (there is no earlier checkpoint): make room, then start again"
        )
        return room_for(self.root, needed, f"checkpoint {final.name}", hint)

    def _install(self, tmp: Path, final: Path) -> None:
        """Rename the finished temporary directory to `final` (replacing a checkpoint of the same step); the old
        one goes aside under a `.tmp-` name, which `_remove_stale_tmp` clears if a kill leaves it."""
        replace_directory(tmp, final, aside=self.root / f"{TMP_PREFIX}old-{final.name}")

    def _write_pointer(self, name: str) -> None:
        atomic_write_text(self.root / POINTER, name + "\n", tmp=self.root / f"{TMP_PREFIX}{POINTER}")

    def _remove_stale_tmp(self, held: lock.OutputLock | None) -> None:
        """Leftovers of a save that was killed. Only under the output directory's lock, which this process holds:
        no other process saves here, so none of them is in progress."""
        if held is None:
            return
        held.check()
        for path in self.root.glob(f"{TMP_PREFIX}*"):
            logger.info("removing %s, left by an interrupted save", path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _prune(self, step: int, held: lock.OutputLock | None) -> None:
        """Keep the new checkpoint and the `keep - 1` newest complete ones before it; delete the rest (only under
        the output directory's lock, as `_remove_stale_tmp`).

        Checkpoints with a larger step were written before the run resumed from an earlier one: they belong to
        an abandoned continuation, and `latest()` would otherwise pick them, so they go too.
        """
        if held is None:
            return
        held.check()
        older, doomed = [], []
        for other_step, path in self.checkpoints():
            if other_step > step:
                logger.warning("removing %s: newer than step %d, left from before the run resumed", path, step)
                doomed.append(path)
            elif other_step < step:
                older.append(path)
        complete = [p for p in reversed(older) if (p / MANIFEST).is_file()][: self.keep - 1]
        doomed += [p for p in older if p not in complete]
        for path in doomed:
            # Rename first, so a kill during the delete leaves an ignored .tmp- directory, not a partial step_.
            trash = self.root / f"{TMP_PREFIX}del-{path.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # ---- reading ---------------------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (see `verify`); warns about and skips partial or corrupt ones.
        A checkpoint of another format version raises CheckpointFormatError instead of being skipped.

        Under torchrun rank 0 verifies and tells the others (one rank hashes, not all).
        """
        if ranks.initialized():
            import torch.distributed as dist

            box = [self._latest() if dist.get_rank() == 0 else None]
            ranks.barrier()  # while rank 0 hashes, the others wait through the store, not in a collective
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return self._latest()

    def _latest(self) -> Path | None:
        for _, path in reversed(self.checkpoints()):
            try:
                self.verify(path)
            except CheckpointFormatError:
                raise
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s, falling back to the previous one: %s", path, exc)
                continue
            return path
        return None

    def verify(self, path: str | os.PathLike) -> dict:
        """Check the checkpoint against its MANIFEST.json, hashing every file; returns the manifest (see
        `manifest.verify`: CheckpointError naming the checkpoint and the file, CheckpointFormatError for another
        format version)."""
        return verify(path)

    def load(
        self,
        path: str | os.PathLike,
        drafter: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        generators: dict[str, torch.Generator] | None = None,
    ) -> dict:
        """Verify `path`, restore weights, optimizer, scheduler and RNG states; returns the trainer_state.

        Every file this process deserialises is hashed in the same pass (the bytes read are the bytes checked),
        and all of them before anything is restored: a damaged checkpoint leaves the model and optimizer as they
        were (see load.py). Collective under torchrun.
        """
        return restore(path, unwrap(drafter), optimizer, scheduler, generators)


def unwrap(model: nn.Module) -> nn.Module:
    """The drafter inside DDP (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def estimate_bytes(drafter: nn.Module, optimizer: torch.optim.Optimizer, weights_twice: bool = False) -> int:
    """About the size of a checkpoint: the weights (in their dtype) and the optimizer's tensors, plus a margin.
    Sharded (DTensor) tensors count their global size."""
    weights = sum(t.numel() * t.element_size() for t in unwrap(drafter).state_dict().values())
    moments = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return weights * (2 if weights_twice else 1) + moments + _OVERHEAD
