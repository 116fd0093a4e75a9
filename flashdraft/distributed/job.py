"""The job under torchrun: the process group, rank-0-only output, one writer per output, errors that stop every rank.

    torchrun --nproc-per-node 8 -m flashdraft train --config examples/qwen3.5-27b.yaml
    flashdraft train --nproc 8 --config examples/qwen3.5-27b.yaml          # the same; sets the NCCL variables
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m flashdraft train --config examples/qwen3.5-27b.yaml             # on each of the two nodes

Without torchrun (no WORLD_SIZE in the environment) nothing here does anything: one process. How a
training step is split over the ranks, and the drafter and target sharded, is data_parallel.py's.

- NCCL on GPUs, gloo on CPUs. Only rank 0 prints and logs (other ranks: errors only).
- One writer per output directory (flashdraft.io.lock): rank 0 holds the lock of OUT, taken before the process
  group exists; `session(..., output=OUT)` has every rank check that the lock it sees is rank 0's, so a node that
  does not share OUT, or a second job on it, stops before anything is written.
- An exception on any rank is written to the job's TCP store; every other rank polls it and exits at once, rank 0
  printing the failing rank's message. torchrun's own fail-fast does the same on one node; the store also reaches
  ranks on other nodes that sit in a collective or work alone. A heartbeat through the same store stops the job
  when a rank's process is stopped or its node lost, naming that rank; a collective that fails for want of a rank
  (died: the connection closed; stopped: `train.collective_timeout_s`) ends in a RankFault naming it (faults.py).
- Under `torchrun --max-restarts N` a restarted worker group continues from the last complete checkpoint
  (flashdraft.train.resume.restarted); the store keys of each attempt are its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from flashdraft.devices import resolve_device
from flashdraft.distributed import faults, ranks
from flashdraft.distributed.ranks import LONG_WAIT, World, world

logger = logging.getLogger(__name__)

# Set for the workers by `flashdraft train --nproc` (never overriding the user's values): NVLink SHARP / multicast
# objects are not available on every machine (e.g. inside some VMs and containers) and failing to create them
# aborts NCCL's init; the plain NVLink ring/tree paths are what data parallelism needs.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The process group's timeout while the ranks start (NCCL's default; loading takes each rank its own time): the
# shorter train.collective_timeout_s holds from the end of the start on (`steady`).
START_TIMEOUT = timedelta(minutes=10)


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


_session: _Session | None = None


@contextlib.contextmanager
def session(
    device: str = "auto",
    command: str = "train",
    output: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
) -> Iterator[World]:
    """The job's process group around a command: set up under torchrun, torn down after; a no-op otherwise.

    `device` is train.device (auto | cpu | cuda): NCCL when it resolves to a GPU, else gloo. Inside, non-zero ranks
    are quiet, and an exception on any rank stops every rank (the module docstring). `output`: the directory whose
    lock rank 0 holds (flashdraft.io.lock.hold); every rank checks it before the body runs. `timeout_s`:
    train.collective_timeout_s, the heartbeat's limit at once and the collectives' from `steady()` on.
    """
    global _session
    if not launched() or _session is not None:
        yield world()
        return
    use_cuda = resolve_device(device, field="train.device").type == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    start = max(START_TIMEOUT, timedelta(seconds=timeout_s))
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("train.device = cuda, but no CUDA device is available (use auto or cpu)")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): start "
                "at most one process per GPU (--nproc / --nproc-per-node), or set train.device=cpu"
            )
        torch.cuda.set_device(local_rank)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Under this attempt's prefix of the job's store: torchrun keeps one store across its restarts (--max-restarts),
    # and the process group of a restarted worker would otherwise read the addresses of the attempt before.
    store = dist.PrefixStore("pg", _store(start, host=rank == 0))
    if use_cuda:
        device_id = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=start, device_id=device_id)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=start)
    here = world()
    _session = _Session(here, command, timeout_s)
    ok = False
    try:
        if output is not None:
            check_output_lock(output)
        yield here
        ok = True
    except BaseException as exc:
        _ignore_sigterm()
        fault = faults.explain(exc, _session.watch, timeout_s)
        _session.watch.publish(fault or exc)
        if fault is not None:
            raise fault from None
        raise
    finally:
        state, _session = _session, None
        state.close(ok)


def steady() -> None:
    """The ranks have started (collective): every rank waits for the others through the store, then each collective
    waits at most train.collective_timeout_s. No-op in one process."""
    if _session is None or _session.world.size == 1:
        return
    ranks.barrier()
    dist.set_timeout(timedelta(seconds=_session.timeout_s))


class _Session:
    def __init__(self, here: World, command: str, timeout_s: float) -> None:
        self.world, self.timeout_s = here, timeout_s
        self.store = _store(timedelta(seconds=max(timeout_s, 30)))
        self.watch = faults.Watch(self.store, here.rank, here.size, command, timeout_s)
        self.waits = 0
        ranks.attach(self.store)
        if not here.is_main:
            _quiet()
        self.watch.start()

    def close(self, ok: bool) -> None:
        self.watch.stop()
        ranks.attach(None)
        faults.note(None)
        # No barrier first: rank 0 may still be decoding alone (measured τ) after the last collective. After a
        # failure the group is left to the process exit: destroying it could wait on a peer that is gone.
        if ok:
            dist.destroy_process_group()


def _ignore_sigterm() -> None:
    """On a failure, torchrun stops the other ranks with SIGTERM at once: let this rank first say why (torchrun sends
    SIGKILL after its --shutdown-timeout)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _store(timeout: timedelta, host: bool = False) -> dist.Store:
    """A client of the job's TCP store of its own, under this attempt's prefix. torchrun's agent hosts the store;
    under another launcher rank 0 does, in the client it makes with `host=True` (its process group's).
    `timeout`: the longest one request waits (a store that stops answering ends the watch)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    client = dist.TCPStore(addr, port, is_master=host and not agent, wait_for_workers=False, timeout=timeout)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"flashdraft/{run}/{restart}/", client)


def _quiet() -> None:
    """Only rank 0 prints and logs; the others keep errors (their own failure is printed by the CLI)."""
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def check_output_lock(directory: str | os.PathLike) -> None:
    """Every rank: the lock file of `directory` that this rank sees is the one rank 0 holds (collective)."""
    from flashdraft.io import lock

    token = broadcast(lock.held_token(directory) if world().is_main else None)
    lock.check_token(directory, token, f"rank {world().rank} (host {socket.gethostname()})")


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Run the body on rank 0 first, then on the others (e.g. rank 0 writes a cache the others then read).

    The others wait on the store, with no collective timeout: rank 0 may take as long as it needs, and if it
    fails the error watch ends the wait.
    """
    if _session is None or _session.world.size == 1:
        yield
        return
    _session.waits += 1
    key = f"main_first/{_session.waits}"
    if not _session.world.is_main:
        _session.store.wait([key], LONG_WAIT)
    yield
    if _session.world.is_main:
        _session.store.set(key, "done")


def broadcast(value):
    """Rank 0's `value` (any picklable object) on every rank."""
    if world().size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m flashdraft <argv>`, run by this Python."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, "-m", "flashdraft", *argv]


def launch(nproc: int, argv: list[str]) -> NoReturn:
    """`flashdraft <argv> --nproc N`: become `torchrun_command(N, argv)`, with the NCCL variables of `NCCL_ENV`
    (unless already set). Replaces this process (exec), so a signal sent to it (a scheduler's SIGTERM, `timeout`,
    Ctrl-C) reaches torchrun, which passes it on to every rank; its exit status is torchrun's."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    env = {**NCCL_ENV, **os.environ}
    cmd = torchrun_command(nproc, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)
