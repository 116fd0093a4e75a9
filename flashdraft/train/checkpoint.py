"""Resumable training checkpoints, written atomically and verified against a manifest before use.

    checkpoints = CheckpointManager(cfg.log.out, keep=cfg.log.keep_checkpoints)
    if (path := checkpoints.latest()) is not None:
        trainer_state = checkpoints.load(path, drafter, optimizer, scheduler)  # weights, optimizer, scheduler, RNG
    ...
    checkpoints.save(step, drafter, optimizer, scheduler, {"epoch": epoch, "batch_in_epoch": i})

One checkpoint, `OUT/checkpoints/step_00000123/`:

    drafter/             the drafter's `save_pretrained` (the reference format: flashdraft export, SGLang, vLLM)
    optimizer.pt         optimizer.state_dict()  } torch.save, read back with weights_only=True: tensors and plain
    scheduler.pt         scheduler.state_dict()  } Python values only, never arbitrary pickled objects
    rng.pt               torch CPU / CUDA, python `random` and numpy global RNG states, as tensors and numbers
    trainer_state.json   the loop's position (step, epoch, ...), anything JSON-serialisable
    MANIFEST.json        size and sha256 of every other file, written last

Everything is written into `OUT/checkpoints/.tmp-step_.../`, fsynced, and renamed to its final name, so a kill at
any moment leaves the previous checkpoints untouched and either no new checkpoint or a complete one. The rename is
the commit; afterwards `OUT/checkpoints/latest` (a one-line file naming the newest directory, for tools and
people) is replaced atomically and checkpoints beyond `keep` are deleted. `latest()` does not trust the pointer: it
verifies checkpoints newest first and falls back, with a warning, past any that is partial or corrupt.

Verified, not trusted: MANIFEST.json must parse and carry this FORMAT_VERSION (another version is an error that
stops the resume, not a checkpoint to skip: skipping it would resume from an older one and then prune the newer
ones). Every file it lists must be a known part of a checkpoint, present, of its size and sha256; a file on disk that
it does not list is named in a warning and never read (weights are loaded by the manifest's list, not by a glob).
`load` hashes the very bytes it deserialises, in the same pass, so nothing changed after a verification is loaded.

Saving happens under the output directory's lock (flashdraft.io.lock: taken by `flashdraft train` for the whole run,
or here for the save), so removing leftovers of interrupted saves and pruning never touch another run's files. A
save that runs out of room (disk full, quota, `ulimit -f`) removes its temporary directory and raises StorageFull
naming the directory, the space needed and the newest intact checkpoint.

Under torchrun (a process group is initialised) `save` and `load` are collective — every rank calls them — and
the optimizer and model state go through torch.distributed.checkpoint instead of optimizer.pt:

    sharded/             DCP: each rank writes its shards of {"model", "optimizer"} (FSDP2 DTensors), rank 0
                         .metadata; loading re-shards, so a checkpoint of N ranks resumes on M (or on one process)
    drafter/ scheduler.pt rng.pt trainer_state.json   rank 0 (drafter/ from the gathered full weights, so the
                         exported drafter is the same bytes whichever N wrote it; rng.pt is rank 0's RNG)

Rank 0 still builds the checkpoint in a `.tmp-` directory, writes the manifest over every rank's files and renames
it: the same atomicity and damaged-checkpoint skipping (OUT must be one shared filesystem for all nodes). A
one-process checkpoint resumes under torchrun too (its optimizer.pt is loaded whole and sharded).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from flashdraft.io import lock
from flashdraft.io.atomic import atomic_write_text, fsync_tree, replace_directory, write_synced
from flashdraft.io.space import room_for

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
POINTER = "latest"
TMP_PREFIX = ".tmp-"
REQUIRED_FILES = ("drafter/config.json", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json")
SHARDED = "sharded"
# What a manifest may list: the files above, the drafter's save_pretrained directory, DCP's sharded directory.
KNOWN_DIRS = ("drafter/", f"{SHARDED}/")
# A checkpoint written under torchrun has its optimizer state in DCP's sharded files instead of optimizer.pt.
SHARDED_INSTEAD = {"optimizer.pt": f"{SHARDED}/.metadata"}
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 8 << 20
# Room for what is not a tensor (configs, pickled containers, the manifest) in the size estimate of a checkpoint.
_OVERHEAD = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is partial, corrupt or does not fit the model; the message names the path and what is wrong."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint of another format version: not damage to skip, but a version mismatch to resolve."""


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
        rng = capture_rng_state(generators)
        state_json = _trainer_state_json(step, trainer_state)
        if _distributed():
            return self._save_sharded(step, drafter, optimizer, scheduler, rng, state_json)
        final = self.path_for(step)
        with lock.hold(self.out, "train") as held, self._room(final, _estimate_bytes(drafter, optimizer)):
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp(held)
            tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.root))
            try:
                _unwrap(drafter).save_pretrained(tmp / "drafter")
                _torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
                _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
                _torch_save(rng, tmp / "rng.pt")
                write_synced(tmp / "trainer_state.json", state_json)
                files = _hash_files(tmp, sorted(_relative_files(tmp)))
                manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
                write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                fsync_tree(tmp)
                self._install(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._write_pointer(final.name)
            self._prune(step, held)
        logger.info("checkpoint %s written", final)
        return final

    def _save_sharded(self, step: int, drafter: nn.Module, optimizer, scheduler, rng: dict, state_json: str) -> Path:
        """`save` under torchrun: every rank writes its DCP shards into rank 0's temporary directory, then rank 0
        adds the replicated files, the manifest, and publishes the directory as in one process."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        main = dist.get_rank() == 0
        final = self.path_for(step)
        with contextlib.ExitStack() as stack:
            held = stack.enter_context(lock.hold(self.out, "train")) if main else None
            # drafter/ holds the gathered weights once more, beside their shards
            stack.enter_context(self._room(final, _estimate_bytes(drafter, optimizer, weights_twice=True)))
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
                model_state, optim_state = get_state_dict(drafter, optimizer)
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp / SHARDED)
                if main:
                    _save_plain_drafter(drafter, full, tmp / "drafter")
                    _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
                    _torch_save(rng, tmp / "rng.pt")
                    write_synced(tmp / "trainer_state.json", state_json)
                    files = _hash_files(tmp, sorted(_relative_files(tmp)))
                    manifest = {"format": FORMAT_VERSION, "step": step, "ranks": dist.get_world_size(), "files": files}
                    write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                    fsync_tree(tmp)
                    self._install(tmp, final)
            except BaseException:
                if main:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            # Nobody goes on (and e.g. saves again, or resumes from it) before the checkpoint is published.
            dist.barrier()
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
        if _distributed():
            import torch.distributed as dist

            box = [self._latest() if dist.get_rank() == 0 else None]
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
        """Check the checkpoint against its MANIFEST.json, hashing every file; returns the manifest.

        Raises CheckpointError naming the checkpoint and the file: no manifest (the save did not finish), a
        garbled one, a file missing, of the wrong size or with the wrong hash, a required file not listed, a
        listed file that is no part of a checkpoint; CheckpointFormatError for another format version. Files on
        disk that the manifest does not list are named in a warning (and never loaded).
        """
        path = Path(path)
        manifest, entries = _read_manifest(path)
        _check_hashes(path, entries, list(entries))
        return manifest

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
        were. DCP's shard files, which DCP reads itself, are hashed just before (on rank 0 under torchrun).
        Either kind of checkpoint (one process, or sharded by any number of ranks) loads in either setting.
        """
        path = Path(path)
        _, entries = _read_manifest(path)
        sharded = SHARDED_INSTEAD["optimizer.pt"] in entries
        # A sharded checkpoint's drafter/ weights are its exported copy: the model state comes from the shards.
        read = [n for n in entries if not n.startswith(f"{SHARDED}/") and not (sharded and _is_weights(n))]
        self._verify_once(path, entries, [n for n in entries if n not in read])
        blobs = _read_verified(path, entries, read)
        state = _json(path, "trainer_state.json", blobs)
        model = _unwrap(drafter)
        _check_drafter_config(_json(path, "drafter/config.json", blobs), model, path / "drafter" / "config.json")
        if _distributed() or sharded:
            _load_state_dicts(path, model, optimizer, blobs)
        else:
            try:
                model.load_state_dict(_weights(path, blobs), strict=True)
            except RuntimeError as exc:
                raise CheckpointError(f"{path / 'drafter'}: weights do not fit the drafter: {exc}") from None
            try:
                optimizer.load_state_dict(_torch_load(path / "optimizer.pt", blobs["optimizer.pt"]))
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit the optimizer: {exc}") from None
        scheduler.load_state_dict(_torch_load(path / "scheduler.pt", blobs["scheduler.pt"]))
        restore_rng_state(_torch_load(path / "rng.pt", blobs["rng.pt"]), generators, where=path / "rng.pt")
        return state

    def _verify_once(self, path: Path, entries: dict, names: list[str]) -> None:
        """Hash `names` against the manifest: on rank 0 under torchrun (the others take its verdict), else here."""
        if not _distributed():
            _check_hashes(path, entries, names)
            return
        import torch.distributed as dist

        error = None
        if dist.get_rank() == 0:
            try:
                _check_hashes(path, entries, names)
            except CheckpointError as exc:
                error = str(exc)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise CheckpointError(box[0])


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


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
    optim = _torch_load(path / "optimizer.pt", blobs["optimizer.pt"])
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


def _save_plain_drafter(drafter: nn.Module, state: dict, directory: Path) -> None:
    """save_pretrained of `drafter`'s own class (not FSDP2's wrapper subclass, whose name would become the
    checkpoint's `architectures`) holding the gathered full weights `state`."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(drafter).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = cls(copy.deepcopy(drafter.config))
    plain.load_state_dict(state, assign=True, strict=True)
    plain.save_pretrained(directory)


# ---- RNG states -------------------------------------------------------------------------------------------------


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


# ---- helpers ----------------------------------------------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    """The drafter inside DDP (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


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


def _trainer_state_json(step: int, trainer_state: dict) -> str:
    state = dict(trainer_state)
    if state.setdefault("step", step) != step:
        raise ValueError(f"trainer_state['step'] = {state['step']!r} but the checkpoint is for step {step}")
    for key, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trainer_state[{key!r}] is not JSON-serialisable: {exc}") from None
    return json.dumps(state, indent=1) + "\n"


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)


def _torch_load(path: Path, data: bytes | None = None) -> Any:
    """torch.load(weights_only=True) of `data` (the verified bytes of `path`), else of the file `path`."""
    try:
        source = io.BytesIO(data) if data is not None else path
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read with torch.load(weights_only=True): {exc}") from None


def _relative_files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


def _is_weights(name: str) -> bool:
    return name.startswith("drafter/") and name.endswith(".safetensors")


def _read_manifest(path: Path) -> tuple[dict, dict[str, tuple[int, str]]]:
    """(manifest, {name: (size, sha256)}) after every check short of hashing (see `CheckpointManager.verify`)."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial checkpoint: the save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise CheckpointError(f"{manifest_path}: garbled or truncated, not JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: garbled: not a manifest (no 'files' mapping)")
    version = manifest.get("format")
    if type(version) is not int:
        raise CheckpointError(f"{manifest_path}: garbled: no format version (got {version!r})")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{manifest_path}: checkpoint format {version}, but this flashdraft reads format "
            f"{FORMAT_VERSION}: resume with the flashdraft version that wrote it, or start "
            "this run in a new output directory"
        )
    entries = {name: _entry(manifest_path, name, entry) for name, entry in manifest["files"].items()}
    missing = [name for name in REQUIRED_FILES if name not in entries and SHARDED_INSTEAD.get(name) not in entries]
    if missing:
        raise CheckpointError(f"{manifest_path}: does not list {', '.join(missing)}")
    for name, (size, _) in entries.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{file}: {actual} bytes, the manifest says {size} (truncated or changed)")
    extra = sorted(set(_relative_files(path)) - set(entries) - {MANIFEST})
    if extra:
        logger.warning("%s: %s not listed in %s: ignored, never loaded", path, ", ".join(extra), MANIFEST)
    return manifest, entries


def _entry(manifest_path: Path, name: Any, entry: Any) -> tuple[int, str]:
    """(size, sha256) of one manifest entry, after checking that it names a known file inside the checkpoint."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name or name == MANIFEST:
        raise CheckpointError(f"{manifest_path}: {name!r} is not the name of a file inside the checkpoint")
    if name not in REQUIRED_FILES and not name.startswith(KNOWN_DIRS):
        raise CheckpointError(
            f"{manifest_path}: lists {name}, which is no part of a format-{FORMAT_VERSION} checkpoint"
        )
    size = entry.get("size") if isinstance(entry, dict) else None
    digest = entry.get("sha256") if isinstance(entry, dict) else None
    if type(size) is not int or size < 0 or not isinstance(digest, str) or not _SHA256.match(digest):
        raise CheckpointError(f"{manifest_path}: the entry of {name} is garbled (size {size!r}, sha256 {digest!r})")
    return size, digest


def _check_hashes(path: Path, entries: dict[str, tuple[int, str]], names: list[str]) -> None:
    actual = _hash_files(path, names)
    for name in names:
        if actual[name]["sha256"] != entries[name][1]:
            raise CheckpointError(f"{path / name}: sha256 differs from {MANIFEST} (corrupt file)")


def _read_verified(path: Path, entries: dict[str, tuple[int, str]], names: list[str]) -> dict[str, bytes]:
    """{name: bytes} of `names`, each checked against its size and sha256 as read (files in parallel)."""

    def read(name: str) -> bytes:
        data = (path / name).read_bytes()
        size, digest = entries[name]
        if len(data) != size:
            raise CheckpointError(f"{path / name}: {len(data)} bytes, the manifest says {size} (truncated or changed)")
        if hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"{path / name}: sha256 differs from {MANIFEST} (corrupt file)")
        return data

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        return dict(zip(names, pool.map(read, names), strict=True))


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
    for name in sorted(n for n in blobs if _is_weights(n)):
        try:
            weights.update(load_safetensors(blobs[name]))
        except SafetensorError as exc:
            raise CheckpointError(f"{path / name}: not a readable safetensors file ({exc})") from None
    if not weights:
        raise CheckpointError(f"{path / MANIFEST}: lists no drafter/*.safetensors weights")
    # safetensors' load(bytes) returns the tensors in a random order per process; under torchrun every rank must
    # hand set_state_dict the same order (its collectives follow it).
    return dict(sorted(weights.items()))


def _estimate_bytes(drafter: nn.Module, optimizer: torch.optim.Optimizer, weights_twice: bool = False) -> int:
    """About the size of a checkpoint: the weights (in their dtype) and the optimizer's tensors, plus a margin.
    Sharded (DTensor) tensors count their global size."""
    weights = sum(t.numel() * t.element_size() for t in _unwrap(drafter).state_dict().values())
    moments = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return weights * (2 if weights_twice else 1) + moments + _OVERHEAD


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {size, sha256}}; files are hashed in threads (hashlib releases the GIL on large buffers)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        digests = list(pool.map(lambda name: _sha256(root / name), names))
    return {name: {"size": (root / name).stat().st_size, "sha256": d} for name, d in zip(names, digests, strict=True)}
