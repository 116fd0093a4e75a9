"""This process's place among the ranks of a job, and a barrier over them. Without a process group (one process)
it is rank 0 of 1 and the barrier does nothing.

    here = ranks.world()          # World(rank, size, local_rank); here.is_main on rank 0
    ranks.barrier()               # every rank waits here for the others, however long they take

The process group itself (set up, torn down, errors that stop every rank) is `job.py`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# Waits on the work of one rank (writing a checkpoint, evaluating) go through the job's store with this bound, not
# through a collective with the process group's timeout (train.collective_timeout_s): a rank that fails, dies or
# stops ends them through job.py's error watch and heartbeat instead.
LONG_WAIT = timedelta(days=7)

_store: dist.Store | None = None  # the job's store, while `job.session` runs
_barriers = 0


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def initialized() -> bool:
    """Whether a process group is initialised (under torchrun, inside `job.session`)."""
    return dist.is_available() and dist.is_initialized()


def world() -> World:
    """This process's place in the job; rank 0 of 1 when no process group is initialised."""
    if not initialized():
        return World()
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def attach(store: dist.Store | None) -> None:
    """Set (job.session) or clear the store `barrier` waits on."""
    global _store, _barriers
    _store, _barriers = store, 0


def barrier() -> None:
    """Every rank waits here until all have arrived. Through the job's store, with no collective timeout: the others
    may wait here for as long as one rank works alone."""
    global _barriers
    here = world()
    if here.size == 1:
        return
    if _store is None:
        dist.barrier()
        return
    _barriers += 1
    key = f"barrier/{_barriers}"
    if _store.add(key, 1) == here.size:
        _store.set(f"{key}/done", "1")
    _store.wait([f"{key}/done"], LONG_WAIT)
