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

import copy
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
POINTER = "latest"
TMP_PREFIX = ".tmp-"
REQUIRED_FILES = ("drafter/config.json", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json")
SHARDED = "sharded"
# A checkpoint written under torchrun has its optimizer state in DCP's sharded files instead of optimizer.pt.
SHARDED_INSTEAD = {"optimizer.pt": f"{SHARDED}/.metadata"}
_STEP_DIR = re.compile(r"^step_(\d+)$")
_HASH_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint is partial, corrupt or does not fit the model; the message names the path and what is wrong."""


class CheckpointManager:
    """Checkpoints of one run in `OUT/checkpoints/`; keeps the `keep` most recent complete ones."""

    def __init__(self, out_dir: str | os.PathLike, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep}: must be >= 1 (the checkpoint just written is always kept)")
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep
        # path -> (size, mtime) of every manifest file when it last verified, so `load` right after `latest`
        # does not hash gigabytes twice.
        self._verified: dict[Path, tuple] = {}

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
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        final = self.path_for(step)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.root))
        try:
            _unwrap(drafter).save_pretrained(tmp / "drafter")
            _torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
            _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
            _torch_save(rng, tmp / "rng.pt")
            _write_text(tmp / "trainer_state.json", state_json)
            files = _hash_files(tmp, sorted(_relative_files(tmp)))
            manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
            _write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            _fsync_tree(tmp)
            self._install(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_pointer(final.name)
        self._prune(step)
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
        # Collective (an all-gather of every shard); only rank 0 keeps the result, in CPU memory.
        full = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        tmp = None
        if main:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
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
                _write_text(tmp / "trainer_state.json", state_json)
                files = _hash_files(tmp, sorted(_relative_files(tmp)))
                manifest = {"format": FORMAT_VERSION, "step": step, "ranks": dist.get_world_size(), "files": files}
                _write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
                _fsync_tree(tmp)
                self._install(tmp, final)
        except BaseException:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        # Nobody goes on (and e.g. saves again, or resumes from it) before the checkpoint is published.
        dist.barrier()
        if main:
            self._write_pointer(final.name)
            self._prune(step)
            logger.info("checkpoint %s written", final)
        return final

    def _install(self, tmp: Path, final: Path) -> None:
        """Rename the finished temporary directory to `final` (replacing a checkpoint of the same step)."""
        if final.exists():
            old = self.root / f"{TMP_PREFIX}old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self._verified.pop(final.resolve(), None)
        _fsync_dir(self.root)

    def _write_pointer(self, name: str) -> None:
        tmp = self.root / f"{TMP_PREFIX}{POINTER}"
        _write_text(tmp, name + "\n")
        os.replace(tmp, self.root / POINTER)
        _fsync_dir(self.root)

    def _remove_stale_tmp(self) -> None:
        """Leftovers of a save that was killed; only one process saves, so none of them is in progress."""
        for path in self.root.glob(f"{TMP_PREFIX}*"):
            logger.info("removing %s, left by an interrupted save", path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _prune(self, step: int) -> None:
        """Keep the new checkpoint and the `keep - 1` newest complete ones before it; delete the rest.

        Checkpoints with a larger step were written before the run resumed from an earlier one: they belong to
        an abandoned continuation, and `latest()` would otherwise pick them, so they go too.
        """
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
            self._verified.pop(path.resolve(), None)

    # ---- reading ---------------------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (see `verify`); warns about and skips partial or corrupt ones.

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
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s, falling back to the previous one: %s", path, exc)
                continue
            return path
        return None

    def verify(self, path: str | os.PathLike) -> dict:
        """Check every file against MANIFEST.json (size, then sha256); returns the manifest.

        Raises CheckpointError naming the checkpoint and the file: no manifest (the save did not finish), a
        file missing, of the wrong size or with the wrong hash, or a required file absent from the manifest.
        """
        path = Path(path)
        manifest_path = path / MANIFEST
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a checkpoint directory")
        if not manifest_path.is_file():
            raise CheckpointError(f"{path}: no {MANIFEST} (partial checkpoint: the save did not finish)")
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
            entries = {name: (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None
        missing = [name for name in REQUIRED_FILES if name not in entries and SHARDED_INSTEAD.get(name) not in entries]
        if missing:
            raise CheckpointError(f"{manifest_path}: does not list {', '.join(missing)}")
        stats = {}
        for name, (size, _) in entries.items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{path}: {name} is missing")
            stat = file.stat()
            if stat.st_size != size:
                raise CheckpointError(f"{file}: {stat.st_size} bytes, the manifest says {size} (truncated or changed)")
            stats[name] = (stat.st_size, stat.st_mtime_ns)
        key = path.resolve()
        if self._verified.get(key) == stats:
            return manifest
        actual = _hash_files(path, list(entries))
        for name, (_, digest) in entries.items():
            if actual[name]["sha256"] != digest:
                raise CheckpointError(f"{path / name}: sha256 differs from {MANIFEST} (corrupt file)")
        self._verified[key] = stats
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

        Either kind of checkpoint (one process, or sharded by any number of ranks) loads in either setting.
        """
        path = Path(path)
        self._verify_once(path)
        state = json.loads((path / "trainer_state.json").read_text())
        model = _unwrap(drafter)
        _check_drafter_config(path / "drafter", model)
        if _distributed() or (path / SHARDED_INSTEAD["optimizer.pt"]).is_file():
            _load_state_dicts(path, model, optimizer)
            scheduler.load_state_dict(_torch_load(path / "scheduler.pt"))
            restore_rng_state(_torch_load(path / "rng.pt"), generators, where=path / "rng.pt")
            return state
        weights = {}
        for file in sorted((path / "drafter").glob("*.safetensors")):
            weights.update(load_file(file))
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{path / 'drafter'}: weights do not fit the drafter: {exc}") from None
        try:
            optimizer.load_state_dict(_torch_load(path / "optimizer.pt"))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit the optimizer: {exc}") from None
        scheduler.load_state_dict(_torch_load(path / "scheduler.pt"))
        restore_rng_state(_torch_load(path / "rng.pt"), generators, where=path / "rng.pt")
        return state


    def _verify_once(self, path: Path) -> None:
        """`verify` on rank 0 only under torchrun (the others take its verdict); on this process otherwise."""
        if not _distributed():
            self.verify(path)
            return
        import torch.distributed as dist

        error = None
        if dist.get_rank() == 0:
            try:
                self.verify(path)
            except CheckpointError as exc:
                error = str(exc)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise CheckpointError(box[0])


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _load_state_dicts(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state through torch.distributed.checkpoint's state-dict API, which re-shards: from a
    sharded checkpoint (any number of ranks) or a one-process one (loaded whole), into a sharded or plain model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    sharded = path / SHARDED
    if (sharded / ".metadata").is_file():
        model_state, optim_state = get_state_dict(model, optimizer)
        try:
            dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=sharded)
        except Exception as exc:  # DCP reports a mismatch as a CheckpointException listing every rank's error
            raise CheckpointError(f"{sharded}: does not fit the drafter and optimizer: {exc}") from None
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        return
    weights = {}
    for file in sorted((path / "drafter").glob("*.safetensors")):
        weights.update(load_file(file))
    optim = _torch_load(path / "optimizer.pt")
    # optimizer.pt numbers the parameters in the order the optimizer was given them (the trainable ones, in
    # module order); the state-dict API names them by their module path.
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    try:
        optim = {"state": {names[i]: v for i, v in optim["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]}  # fmt: skip
        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True, strict=True))  # fmt: skip
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


def _check_drafter_config(directory: Path, model: nn.Module) -> None:
    """Weights of the same shapes can still belong to another recipe (block size, mask token, target layers)."""
    saved = json.loads((directory / "config.json").read_text())
    dflash = saved.get("dflash_config") or {}
    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        if not hasattr(model, name):
            continue
        value = dflash.get(name, saved.get(name))
        if value is not None and value != getattr(model, name):
            raise CheckpointError(
                f"{directory / 'config.json'}: {name} = {value!r}, but the drafter being resumed has "
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


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read with torch.load(weights_only=True): {exc}") from None


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _relative_files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file, then every directory, so the rename that publishes `root` cannot outrun its contents."""
    dirs = [root]
    for path in root.rglob("*"):
        if path.is_dir():
            dirs.append(path)
        else:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in reversed(dirs):
        _fsync_dir(path)
