"""This process's place among the ranks of a job, and a barrier over them. Without a process group (one process)
it is rank 0 of 1 and the barrier does nothing.

    here = ranks.world()          # World(rank, size, local_rank); here.is_main on rank 0
    ranks.barrier()               # every rank waits here for the others

The process group itself (set up, torn down, errors that stop every rank) is `job.py`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


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


def barrier() -> None:
    if world().size > 1:
        dist.barrier()
