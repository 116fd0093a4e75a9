"""A speculative round on the engine: greedy with a drafter, one step (one CUDA graph replay on a GPU, then one
small copy to the host); otherwise (sampling, prompt lookup, the target's MTP head) the separate steps.

    rnd = GreedyRound(engine, runner)     # captured (on a GPU) before the caches fill, like every step
    rnd.start(); runner.draft()           # a new generation; the first block, after the prefill
    tokens, confidence = rnd.emit(want)   # verify it, accept, commit, draft the next block: one replay, one read
    tokens, confidence = rnd.emit(want, ahead=True)  # the next round enqueued before this one is read
    tokens, confidence = verify_round(engine, runner, drafts, draft_probs, sampling, generator)  # separate steps

The step verifies the anchor (`runner.block_ids[0]`) and every draft, accepts the longest prefix of drafts that
agree with the target's argmax, writes the number to keep on the device, commits it (the hybrid layers' states
rolled back to it: `commit_linear`), hands the bonus token to the drafter as the next anchor and drafts the next
block: what the round of separate steps did with three graph replays and the acceptance's kernels launched one by
one between them. The round's values land in one buffer, copied to the host (pinned memory) behind it. The next
round needs nothing from the host, so where one surely follows it is enqueued before this one is read (`ahead`):
the GPU goes on while the host reads, and two rounds' values are in flight, in two host buffers. Every round
verifies the whole block; near `max_new_tokens`, `emit` keeps the first `want + 1` tokens, which the greedy rule
makes the target's own.
"""

from __future__ import annotations

import collections

import torch

from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.engine.graphs import Step, capture_all
from flashdraft.speculative.engine.mtp_runner import MTPRunner
from flashdraft.speculative.engine.target_runner import TargetEngine
from flashdraft.speculative.sampling import rejection_sample_tensors, sampling_probs


class GreedyRound:
    """Verification, acceptance, commit and the next draft of a greedy round, as one step (module docstring)."""

    def __init__(self, engine: TargetEngine, runner: DrafterRunner):
        if runner.probs is not None:
            raise ValueError("a greedy round needs a runner that drafts greedily (temperature 0)")
        self.engine, self.runner = engine, runner
        n, device = runner.num_drafts, engine.device
        # accepted, bonus, then the drafts the round verified.
        self.values = torch.zeros(n + 2, dtype=torch.long, device=device)
        confident = runner.confidence is not None
        self.confidence = torch.zeros(n, device=device) if confident else None
        self.step = Step(self._round, "round")
        # Two rounds' values (and confidences) on the host, pinned on a GPU, and their copies' events; the slots of
        # the rounds enqueued and not read yet, oldest first.
        cuda = device.type == "cuda"
        self.host = [torch.zeros(n + 2, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.host_confidence = [torch.zeros(n, pin_memory=cuda) for _ in range(2)] if confident else None
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.in_flight: collections.deque[int] = collections.deque()
        self._slot = 0

    def capture(self) -> None:
        """Record the round as a CUDA graph. Its warm-up runs really verify, commit and draft: call it before the
        prefill (as the engine's and the runner's own captures are); it starts them from position 0 and leaves
        them there."""
        self.engine.join()
        with torch.inference_mode():
            self._rewind()
            capture_all([self.step])
            self._rewind()

    def _rewind(self) -> None:
        self.engine.length.zero_()
        self.engine.keep.fill_(1)
        self.runner.context.zero_()
        self.runner.pending.zero_()

    def start(self) -> None:
        """Forget rounds enqueued and never read: a generation that ends at a stop token leaves one, whose work the
        next prefill overwrites."""
        self.in_flight.clear()

    @torch.inference_mode()
    def run(self) -> None:
        """Enqueue the round, then the copy of its values to the host (read them with `read`)."""
        engine = self.engine
        if len(self.in_flight) == len(self.host):
            raise RuntimeError(f"{len(self.in_flight)} rounds in flight: read one before enqueueing another")
        engine._check_room(engine.block_size * (1 + len(self.in_flight)))  # the host's count lags the rounds in flight
        engine.join()
        self.step()
        slot, cuda = self._slot, self.events is not None
        self._slot = 1 - slot
        self.host[slot].copy_(self.values, non_blocking=cuda)
        if self.confidence is not None:
            self.host_confidence[slot].copy_(self.confidence, non_blocking=cuda)
        if cuda:
            self.events[slot].record()
        self.in_flight.append(slot)

    def read(self) -> tuple[int, int, list[int], list[float] | None]:
        """(drafts accepted, the bonus token, the drafts verified, the drafter's confidence in each) of the oldest
        round in flight: its one host synchronisation. Notes the committed tokens on the engine."""
        slot = self.in_flight.popleft()
        if self.events is not None:
            self.events[slot].synchronize()
        values = self.host[slot].tolist()
        confidence = None if self.host_confidence is None else self.host_confidence[slot].tolist()
        self.engine.note_committed(values[0] + 1)
        return values[0], values[1], values[2:], confidence

    def emit(self, want: int, ahead: bool = False) -> tuple[list[int], list[float] | None]:
        """Run the round (unless it is in flight already) and read it: the tokens it emits (at most `want` drafts
        and one more) and the drafter's confidence in each of the first `want` drafts. ahead: first enqueue the
        next round too, for a caller that will surely emit again (past a stop token its work is wasted)."""
        if not self.in_flight:
            self.run()
        if ahead:
            self.run()
        accepted, bonus, verified, confidence = self.read()
        # Past `want` the accepted drafts are the target's argmax too: the first want + 1 tokens are its own.
        new = verified[: want + 1] if accepted > want else verified[:accepted] + [bonus]
        return new, None if confidence is None else confidence[:want]

    def _round(self) -> None:
        engine, runner = self.engine, self.runner
        drafts = runner.drafts
        engine.verify_ids[:1].copy_(runner.block_ids[:1])
        engine.verify_ids[1:].copy_(drafts)
        engine._verify()
        accepted, bonus = greedy_acceptance(drafts, engine.verify_logits)
        engine.keep.copy_(accepted + 1)
        engine._commit()
        self.values[:1].copy_(accepted.view(1))
        self.values[1:2].copy_(bonus.view(1))
        self.values[2:].copy_(drafts)
        if self.confidence is not None:
            self.confidence.copy_(runner.confidence)  # the next draft overwrites the runner's
        runner.pending.copy_(engine.keep)
        runner.block_ids[:1].copy_(bonus.view(1))
        runner.passes(runner._draft)


def greedy_acceptance(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts accepted, the token after them) on the device: the longest prefix of `drafts` (n,) that agrees with
    the argmax of `logits` (n + 1, V) at the anchor and each draft, and the argmax after that prefix."""
    choice = logits.argmax(dim=-1)
    accepted = (drafts == choice[:-1]).to(torch.int64).cumprod(0).sum()
    return accepted, choice.index_select(0, accepted.view(1))[0]


def verify_round(
    engine, runner, drafts, draft_probs, sampling, generator, draft_ahead: bool = False, verify: str = "block"
) -> tuple[list[int], list[float] | None]:
    """Verify `drafts` (after the anchor already in verify_ids[0]), commit the accepted prefix; the emitted tokens,
    and the drafter's predicted acceptance of each draft (`DrafterRunner.confidence`; None without one).

    draft_ahead: also enqueue the runner's next draft (it needs only device values) before the host reads the
    result, so that the GPU drafts while the host reads and enqueues the next verification.
    """
    want = drafts.shape[0]
    engine.verify_ids[1 : 1 + want].copy_(drafts)
    engine.verify()
    logits = engine.verify_logits[: want + 1]
    if sampling[0] <= 0:
        accepted, bonus = greedy_acceptance(drafts, logits)
    else:
        target_probs = sampling_probs(logits, *sampling)
        accepted, bonus = rejection_sample_tensors(drafts, draft_probs, target_probs, generator, verify)
    engine.keep.copy_(accepted + 1)
    engine.commit()
    if isinstance(runner, MTPRunner):
        runner.note_verified(accepted, bonus)
    elif runner is not None:
        runner.pending.copy_(engine.keep)
        runner.block_ids[:1].copy_(bonus.view(1))
    # The one host synchronisation of the round.
    values = torch.cat([accepted.view(1), bonus.view(1), drafts])
    confidence = getattr(runner, "confidence", None)
    confidence = None if confidence is None else confidence[:want]
    host = None
    if draft_ahead:
        if engine.host_values is not None:  # on a GPU: read through pinned memory while the draft runs
            host = engine.host_values[: values.shape[0]]
            host.copy_(values, non_blocking=True)
            if confidence is not None:
                confidence = runner.host_confidence[:want].copy_(confidence, non_blocking=True)
            engine.read_event.record()
        elif confidence is not None:
            confidence = confidence.clone()  # the next draft overwrites the runner's buffer
        runner.draft()
    if host is not None:
        engine.read_event.synchronize()
        values = host.tolist()
    else:
        values = values.tolist()
    count = values[0]
    engine.note_committed(count + 1)
    return values[2 : 2 + count] + [values[1]], None if confidence is None else confidence.tolist()
