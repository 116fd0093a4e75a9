"""Many processes: a job under torchrun, and what training does across its ranks. One process is rank 0 of 1, and
every function here is then the identity or does nothing.

- ranks.py: this process's place in the job (`world()`) and a barrier through the job's store; all a lower layer
  needs (the offline features of data/features.py, the checkpoints).
- job.py: the job itself: `launch` (torchrun from `--nproc`), `session` (the process group around a command, rank-0
  output, an error on one rank stops all), `main_first`, `broadcast`.
- faults.py: a rank that fails, dies or stops, seen from the others: the watch thread (errors and a heartbeat through
  the job's store) and collective failures turned into errors naming the rank (`train.collective_timeout_s`).
- data_parallel.py: a training step split over the ranks, sums across them, the drafter (and optionally the target)
  sharded with FSDP2.
- stop.py: a SIGTERM or Ctrl-C that every rank agrees on, so the loop checkpoints and leaves after the same step.

The command-line modules use the package's names: `distributed.launched()`, `distributed.launch(...)`,
`distributed.session(...)`.
"""

from flashdraft.distributed.job import broadcast, launch, launched, main_first, session
from flashdraft.distributed.ranks import World, barrier, initialized, world

__all__ = ["World", "barrier", "broadcast", "initialized", "launch", "launched", "main_first", "session", "world"]
