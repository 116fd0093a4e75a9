"""A rank that fails, dies or stops, seen from the other ranks: the watch thread of every rank (errors and a
heartbeat, through the job's store) and collective failures turned into errors that name the rank and the operation.

- Errors: the first rank to fail writes "rank<TAB>kind<TAB>message" to the store key `error`; every rank's watch
  thread polls it and, when another rank failed, exits the process at once (rank 0 printing the message). The store
  also reaches ranks on other nodes that sit in a collective or work alone.
- Heartbeat: every rank's watch thread adds 1 to the store key `beat/RANK` every POLL_SECONDS; rank 0 follows every
  rank's counter, the others rank 0's. A counter that has not moved for `train.collective_timeout_s` (a process
  stopped by SIGSTOP or a debugger, hung in the kernel, or on a node that is gone) stops the job: the rank that
  noticed publishes it as that rank's failure, naming what it was itself waiting in. A process busy computing still
  beats: the thread needs the GIL only now and then.
- Collectives: an exception from a collective (gloo: "Connection closed by peer" when a peer died, "Timed out
  waiting ..." after the process group's timeout) becomes a RankFault (`explain`) naming the ranks whose heartbeat
  stopped, the collective, the flashdraft function that called it and the step.
- NCCL: a collective that times out ends the process from NCCL's watchdog (torch's default
  TORCH_NCCL_ASYNC_ERROR_HANDLING=3), whose message names the operation and its sequence number but not the peer;
  the heartbeat names a stopped rank when it notices first.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

POLL_SECONDS = 0.5
# The exit codes of a rank that leaves because another failed (cli/exit_codes.py's, which this layer cannot import):
# EXIT_CHECK_FAILED after another rank's error, EXIT_RANK_LOST after a rank died or stopped answering.
EXIT_CHECK_FAILED = 1
EXIT_RANK_LOST = 5
ERROR_KEY = "error"
_PACKAGE = Path(__file__).resolve().parents[1]
_step: str | None = None


class RankFault(RuntimeError):
    """A rank of the job died or stopped answering; the message names it and what this rank was doing."""

    exit_code = EXIT_RANK_LOST


def note(what: str | None) -> None:
    """What the job is at (e.g. "step 12"), for the messages of a rank fault."""
    global _step
    _step = what


class Watch:
    """The watch thread of one rank (the module docstring): `start`, `stop`, `publish(exc)` of this rank's failure."""

    def __init__(self, store, rank: int, size: int, command: str, silence_s: float) -> None:
        self.store, self.rank, self.size, self.command, self.silence_s = store, rank, size, command, silence_s
        self.failed = False
        self.main = threading.get_ident()  # the thread whose stack says what this rank is doing
        # The stack of the collective that failed, while the main thread explains it (`explain` waits a second and
        # more): what this rank was doing, which the watch must report rather than the explaining code's frames.
        self.failed_call: list[traceback.FrameSummary] | None = None
        now = time.monotonic()
        # The counters this rank follows: (value, when it last moved on this host's clock); none moved yet.
        self.seen = {r: (-1, now) for r in (range(size) if rank == 0 else [0]) if r != rank}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashdraft-watch", daemon=True)

    def start(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def publish(self, exc: BaseException) -> None:
        self.failed = True  # before the write: this rank's own watcher must not exit before the CLI prints
        plain = isinstance(exc, ValueError | OSError | RankFault)
        message = str(exc) if plain else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyboardInterrupt):
            message = "interrupted"
        kind = "lost" if isinstance(exc, RankFault) else "error"
        try:
            self.store.compare_set(ERROR_KEY, "", f"{self.rank}\t{kind}\t{message}")
        except Exception as err:  # the store is gone: torchrun's fail-fast still stops the others
            print(f"could not tell the other ranks about the failure: {err}", file=sys.stderr, flush=True)

    def quiet(self, window: float) -> dict[int, float]:
        """{rank: seconds without a heartbeat} of the other ranks whose counter does not move for `window` seconds."""
        others = [r for r in range(self.size) if r != self.rank]
        before = {r: self.store.add(f"beat/{r}", 0) for r in others}
        time.sleep(window)
        now = time.monotonic()
        return {
            r: max(window, now - self.seen[r][1]) if r in self.seen else window
            for r in others
            if self.store.add(f"beat/{r}", 0) == before[r]
        }

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            mine = False
            try:
                self.store.add(f"beat/{self.rank}", 1)
                self._look()
                if not self.store.check([ERROR_KEY]):
                    now = time.monotonic()
                    silent = {r: now - t for r, (_, t) in self.seen.items() if now - t >= self.silence_s}
                    if not silent:
                        continue
                    mine = self._report(silent)
                rank, kind, message = self.store.get(ERROR_KEY).decode().split("\t", 2)
            except Exception as err:
                if self._stop.is_set():
                    return
                rank, kind, message = "?", "lost", f"lost contact with the job's store ({type(err).__name__}: {err})"
            if self.failed or self._stop.is_set():
                return
            if self.rank == 0 or mine:
                print(
                    f"flashdraft {self.command}: stopping every rank: rank {rank} failed: {message}",
                    file=sys.stderr,
                    flush=True,
                )
            sys.stdout.flush()
            os._exit(EXIT_RANK_LOST if kind == "lost" else EXIT_CHECK_FAILED)

    def _look(self) -> None:
        now = time.monotonic()
        for r, (value, _) in list(self.seen.items()):
            count = self.store.add(f"beat/{r}", 0)
            if count != value:
                self.seen[r] = (count, now)

    def _report(self, silent: dict[int, float]) -> bool:
        """Publish the silence of `silent` as the failure of its first rank; whether this rank's word was the one
        stored (another failure may have come first)."""
        rank, seconds = min(silent.items())
        frames = self.failed_call or _stack(sys._current_frames().get(self.main))
        waiting = doing(frames, self.rank)
        message = (
            f"it stopped answering: no heartbeat for {seconds:.0f} s (its process stopped or hung, or its node lost; "
            f"train.collective_timeout_s = {self.silence_s:g}){f'; {waiting}' if waiting else ''}"
        )
        value = f"{rank}\tlost\t{message}"
        return self.store.compare_set(ERROR_KEY, "", value).decode() == value


def explain(exc: BaseException, watch: Watch | None, timeout_s: float) -> RankFault | None:
    """`exc` (or an exception it was raised from) as a RankFault when it is a collective that failed for want of
    another rank; None for any other error. Takes about a second: it watches which ranks still beat."""
    failed = next((e for e in _chain(exc) if _from_a_collective(e)), None)
    if failed is None:
        return None
    text = str(failed)
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    call = _stack(failed.__traceback__)
    if watch is not None:
        watch.failed_call = call
    quiet = watch.quiet(3 * POLL_SECONDS) if watch is not None else {}
    rank = watch.rank if watch is not None else int(os.environ.get("RANK", 0))
    what = doing(call, rank, waiting=False) or f"rank {rank}'s collective"
    if not quiet:
        head = (
            "no rank is silent: every rank's process still answers (one may wait in another collective, or the "
            "network failed)"
        )
    elif timed_out:
        head = (
            f"{_ranks(quiet)} stopped answering: no heartbeat for {max(quiet.values()):.0f} s (a process stopped or "
            "hung, or a node lost)"
        )
    else:
        head = f"{_ranks(quiet)} {'is' if len(quiet) == 1 else 'are'} gone: killed or crashed, or its node lost"
    how = f"timed out after {timeout_s:g} s (train.collective_timeout_s)" if timed_out else "lost its connection"
    first_line = text.strip().splitlines()[0] if text.strip() else type(failed).__name__
    return RankFault(f"{head}; {what} {how} [{first_line}]")


def doing(frames: list[traceback.FrameSummary], rank: int, waiting: bool = True) -> str:
    """ "rank 0 was waiting in all_reduce (from flashdraft/train/loop.py:train_step, step 3)" from a stack, outermost
    frame first; "" when neither torch.distributed nor flashdraft is on it."""
    c10d = [f for f in frames if _posix(f).endswith("/torch/distributed/distributed_c10d.py")]
    torch_dist = [f for f in frames if "/torch/distributed/" in _posix(f)]
    ours = [f for f in frames if _in_package(f)]
    callers = [f for f in ours if Path(f.filename).name not in _PLUMBING]
    if c10d:
        op = c10d[0].name  # the public call (all_gather_object), not the collectives inside it
    elif torch_dist:
        module = _posix(torch_dist[-1]).split("/torch/", 1)[1].removesuffix(".py").replace("/", ".")
        op = f"torch.{module}.{torch_dist[-1].name}"
    elif ours and Path(ours[-1].filename).name in ("ranks.py", "job.py"):
        op = f"{Path(ours[-1].filename).stem}.{ours[-1].name} (a wait through the store)"
    else:
        op = None
    where = None
    if callers:
        where = f"{Path(callers[-1].filename).resolve().relative_to(_PACKAGE.parent).as_posix()}:{callers[-1].name}"
    if op is None and where is None:
        return ""
    context = ", ".join(x for x in (f"from {where}" if where else None, _step) if x)
    subject = f"rank {rank} was waiting in" if waiting else f"rank {rank}'s"
    return f"{subject} {op or 'its work'}" + (f" ({context})" if context else "")


# flashdraft's own modules of the job's plumbing: a message names the function that called them.
_PLUMBING = ("faults.py", "job.py", "ranks.py")


def _ranks(found: dict[int, float]) -> str:
    return ("rank " if len(found) == 1 else "ranks ") + ", ".join(str(r) for r in sorted(found))


def _posix(frame: traceback.FrameSummary) -> str:
    return frame.filename.replace("\\", "/")


def _in_package(frame: traceback.FrameSummary) -> bool:
    return Path(frame.filename).resolve().is_relative_to(_PACKAGE)


def _stack(source) -> list[traceback.FrameSummary]:
    """The frames of a traceback or of a thread's current frame, outermost first."""
    if source is None:
        return []
    if hasattr(source, "tb_frame"):
        return list(traceback.extract_tb(source))
    return list(traceback.extract_stack(source))


def _chain(exc: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _from_a_collective(exc: BaseException) -> bool:
    """A failure of the process group itself: torch's DistError, or gloo's RuntimeError, raised in torch.distributed."""
    if isinstance(exc, RankFault) or not isinstance(exc, RuntimeError):
        return False
    if not any("/torch/distributed/" in _posix(f) for f in _stack(exc.__traceback__)):
        return False
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or "gloo" in text or "pair closure" in text or "Connection closed" in text
