"""The heartbeat of faults.py in one process, over an in-memory store: which ranks are silent, and what the rank that
notices publishes (the job itself: test_rank_faults.py)."""

import threading
import time

import torch.distributed as dist

from flashdraft.cli import exit_codes
from flashdraft.distributed import faults


def _watch(store, rank=0, size=3):
    return faults.Watch(store, rank, size, "train", silence_s=60)


def test_a_rank_whose_counter_stops_is_quiet_and_one_that_beats_is_not():
    store = dist.HashStore()
    done = threading.Event()

    def beat():  # rank 1's watch thread; rank 2 never beats
        while not done.wait(0.05):
            store.add("beat/1", 1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        quiet = _watch(store).quiet(0.3)
    finally:
        done.set()
        beating.join()
    assert list(quiet) == [2] and quiet[2] >= 0.3


def test_the_rank_that_notices_a_silence_publishes_it_as_that_ranks_failure():
    store = dist.HashStore()
    watch = _watch(store)
    watch.seen[2] = (7, time.monotonic() - 61)
    assert watch._report({2: 61.0})
    rank, kind, message = store.get(faults.ERROR_KEY).decode().split("\t", 2)
    assert (rank, kind) == ("2", "lost")
    assert message.startswith("it stopped answering: no heartbeat for 61 s")
    assert "train.collective_timeout_s = 60" in message
    assert not _watch(store, rank=1)._report({0: 61.0})  # a failure already published stays the one


def test_the_exit_codes_are_the_clis():
    assert (faults.EXIT_CHECK_FAILED, faults.EXIT_RANK_LOST) == (
        exit_codes.EXIT_CHECK_FAILED,
        exit_codes.EXIT_RANK_LOST,
    )


def test_other_errors_are_not_rank_faults():
    assert faults.explain(ValueError("bad input"), None, 5) is None
    assert faults.explain(RuntimeError("a plain runtime error"), None, 5) is None


def _failed_collective_in(function: str, module: str) -> BaseException:
    """A collective's timeout as torch raises it, from `module`:`function` of flashdraft (code compiled under those
    file names, so that its traceback reads as the real one's)."""
    c10d = "/site-packages/torch/distributed/distributed_c10d.py"
    ours = str(faults._PACKAGE / module)
    namespace = {"DistError": dist.DistError}
    exec(
        compile("def gather_object():\n    raise DistError('gloo: timed out after 5000ms')\n", c10d, "exec"), namespace
    )
    exec(compile(f"def {function}():\n    gather_object()\n", ours, "exec"), namespace)
    try:
        namespace[function]()
    except dist.DistError as exc:
        return exc
    raise AssertionError("the collective did not fail")


def test_a_silence_noticed_while_a_failed_collective_is_explained_names_the_collective_not_the_explaining(monkeypatch):
    # The collective's timeout and the silence of the rank it waited for come due together: the watch may report
    # while the main thread is in `explain`, whose frames say nothing of what this rank was doing.
    monkeypatch.setattr(faults, "_step", "step 4")  # what the job is at (a training loop notes it)
    store = dist.HashStore()
    watch = _watch(store, rank=0, size=2)
    failed = _failed_collective_in("write_sharded", "train/checkpoint/save.py")
    reported = []
    noticing = threading.Timer(0.5, lambda: reported.append(watch._report({1: 61.0})))
    noticing.start()
    fault = faults.explain(failed, watch, 60)  # rank 1 never beats: quiet for the whole window
    noticing.join()
    assert reported == [True]
    message = store.get(faults.ERROR_KEY).decode().split("\t", 2)[2]
    assert (
        "rank 0 was waiting in gather_object (from flashdraft/train/checkpoint/save.py:write_sharded, step 4)"
        in message
    )
    assert "rank 1 stopped answering" in str(fault) and "rank 0's gather_object" in str(fault)
