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

The package: manifest.py (the format, MANIFEST.json and verification), save.py (writing one checkpoint's files),
load.py (restoring a run from one), rng.py (the RNG states), manager.py (the checkpoints of a run: publishing,
`latest`, pruning).
"""

from flashdraft.train.checkpoint.manager import CheckpointManager
from flashdraft.train.checkpoint.manifest import FORMAT_VERSION, CheckpointError, CheckpointFormatError
from flashdraft.train.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointManager",
    "capture_rng_state",
    "restore_rng_state",
]
