"""A speculative round on the engine: with a drafter, one step (one CUDA graph replay on a GPU, then one small copy
to the host); otherwise (prompt lookup, the target's MTP head) the separate steps.

    rnd = OneStepRound(engine, runner)    # captured (on a GPU) before the caches fill, like every step
    rnd.start(); runner.draft()           # a new generation; the first block, after the prefill
    tokens, confidence = rnd.emit(want)   # verify it, accept, commit, draft the next block: one replay, one read
    tokens, confidence = rnd.emit(want, ahead=True)  # the next round enqueued before this one is read
    tokens = verify_round(engine, mtp_runner, drafts, draft_probs, sampling, generator)  # separate steps

The step verifies the anchor (`runner.block_ids[0]`) and every draft, accepts a prefix of the drafts, writes the
number to keep on the device, commits it (the hybrid layers' states rolled back to it: `commit_linear`), hands the
token after the accepted drafts to the drafter as the next anchor and drafts the next block. Greedy, the drafts that
agree with the target's argmax are accepted and the argmax follows them. Sampling (the runner's settings), the drafts
were drawn inside the draft step with their q kept (`DrafterRunner.probs`); the round verifies them by rejection
sampling (`sampling.verify_drafts`, block or token by token) with uniforms drawn before the step, draws the
correction (or bonus) token with Gumbel noise drawn before it, and the next block's draws use the runner's noise,
also drawn before it: the step itself holds no random state. The round's values land in one buffer, copied to the
host (pinned memory) behind it. The next round needs nothing from the host, so where one surely follows it is
enqueued before this one is read (`ahead`): the GPU goes on while the host reads, and two rounds' values are in
flight, in two host buffers. Every round verifies the whole block; near `max_new_tokens`, `emit` keeps the first
`want + 1` tokens: the target's own prefix of what the round emitted (greedy: the argmax; sampling: the stream of
tokens the rounds emit is the target's, so any prefix of it is).
"""

from __future__ import annotations

import collections

import torch

from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.engine.graphs import Step, capture_all
from flashdraft.speculative.engine.target_runner import TargetEngine
from flashdraft.speculative.sampling import (
    draw_gumbel_,
    gumbel_draw,
    rejection_sample_tensors,
    sampling_probs,
    validate_verify,
    verify_drafts,
)


class OneStepRound:
    """Verification, acceptance, commit and the next draft of a drafter's round, as one step (module docstring);
    sampled as the runner samples, its drafts verified by `verify` (block or token)."""

    def __init__(self, engine: TargetEngine, runner: DrafterRunner, verify: str = "block"):
        self.engine, self.runner, self.verify = engine, runner, validate_verify(verify)
        n, device = runner.num_drafts, engine.device
        # Sampling: the uniforms of the acceptance test and the Gumbel noise of the token after the accepted drafts,
        # drawn before each round (`run`).
        self.sampling = runner.sampling if runner.probs is not None else None
        self.uniforms = torch.zeros(n, dtype=runner.probs.dtype, device=device) if self.sampling else None
        self.noise = torch.zeros(engine.lm_head.out_features, device=device) if self.sampling else None
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
        if self.sampling is not None:  # enqueued after the round before it, which read the last draws
            generator = self.runner.generator
            self.uniforms.uniform_(generator=generator)
            draw_gumbel_(self.noise, generator)
            self.runner.draw_noise()
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
        # Past `want` drafts the round's tokens are cut: a prefix of what the rounds emit is the target's own.
        new = verified[: want + 1] if accepted > want else verified[:accepted] + [bonus]
        return new, None if confidence is None else confidence[:want]

    def _round(self) -> None:
        engine, runner = self.engine, self.runner
        drafts = runner.drafts
        engine.verify_ids[:1].copy_(runner.block_ids[:1])
        engine.verify_ids[1:].copy_(drafts)
        engine._verify()
        if self.sampling is None:
            accepted, bonus = greedy_acceptance(drafts, engine.verify_logits)
        else:
            target_probs = sampling_probs(engine.verify_logits, *self.sampling)
            accepted, after = verify_drafts(drafts, runner.probs, target_probs, self.uniforms, self.verify)
            bonus = gumbel_draw(after, self.noise)
        engine.keep.copy_(accepted + 1)
        engine._commit()
        self.values[:1].copy_(accepted.view(1))
        self.values[1:2].copy_(bonus.view(1))
        self.values[2:].copy_(drafts)
        if self.confidence is not None:
            self.confidence.copy_(runner.confidence)  # the next draft overwrites the runner's
        runner.note_verified(accepted, bonus)
        runner.passes(runner._draft)


def greedy_acceptance(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts accepted, the token after them) on the device: the longest prefix of `drafts` (n,) that agrees with
    the argmax of `logits` (n + 1, V) at the anchor and each draft, and the argmax after that prefix."""
    choice = logits.argmax(dim=-1)
    accepted = (drafts == choice[:-1]).to(torch.int64).cumprod(0).sum()
    return accepted, choice.index_select(0, accepted.view(1))[0]


def verify_round(
    engine, runner, drafts, draft_probs, sampling, generator, draft_ahead: bool = False, verify: str = "block"
) -> list[int]:
    """A round of separate steps, for prompt lookup (`runner` None) and the target's MTP head (an `MTPRunner`; a
    `DrafterRunner` too, which generation runs as one step): verify `drafts` (after the anchor already in
    verify_ids[0]), accept (argmax agreement, or rejection sampling against `draft_probs`, None for a deterministic
    proposer), commit the accepted prefix and tell the runner (`note_verified`); the emitted tokens.

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
    if runner is not None:
        runner.note_verified(accepted, bonus)
    # The one host synchronisation of the round.
    values = torch.cat([accepted.view(1), bonus.view(1), drafts])
    if draft_ahead and engine.host_values is not None:  # on a GPU: read through pinned memory while the draft runs
        values = engine.host_values[: values.shape[0]].copy_(values, non_blocking=True)
        engine.read_event.record()
        runner.draft()
        engine.read_event.synchronize()
    elif draft_ahead:
        runner.draft()
    count, bonus, *verified = values.tolist()
    engine.note_committed(count + 1)
    return verified[:count] + [bonus]
