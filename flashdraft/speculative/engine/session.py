"""Decoding over the engine: DFlash, the target's MTP layer, prompt lookup and autoregressive, with the statistics
of the plain loop.

    from flashdraft.speculative.engine.session import engine_decode
    result = engine_decode(target, input_ids, 256, drafter=drafter)          # DFlash
    result = engine_decode(target, input_ids, 256)                           # autoregressive
    result = engine_decode(target, input_ids, 256, lookup=PromptLookupProposer(), block_size=16)
    result = engine_decode(target, input_ids, 256, mtp=load_mtp(target, path), num_drafts=3)   # the target's MTP

One round: the drafter's step (pending context features, then the block) -> the target's verification of the
block -> acceptance on the device (argmax agreement, or rejection sampling) -> commit of the accepted prefix
and the next anchor, all enqueued without waiting; then one read of the accepted length and tokens, the only
host synchronisation of the round (a clock read there times the round: `GenerationResult.round_times`). A round
with a drafter, greedy or sampled, is all of that as one step, one CUDA graph on a GPU (`rounds.py`). Every
round verifies a full block (static shapes); near `max_new_tokens` only the first `want` drafts count, which can
cut acceptance only in the round that ends the generation.

Engines are kept per target (`session`) and rebuilt only when a longer context, another block size or other
feature layers are needed, so that the CUDA graphs are captured once for many generations.
"""

from __future__ import annotations

import time
import warnings

import torch

from flashdraft import fastpath
from flashdraft.speculative.engine import rounds
from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.engine.mtp_runner import MTPRunner
from flashdraft.speculative.engine.rounds import OneStepRound
from flashdraft.speculative.engine.target_runner import TargetEngine, unsupported_reason
from flashdraft.speculative.result import GenerationResult
from flashdraft.speculative.sampling import (
    next_token,
    validate_request,
    validate_verify,
)

# Context lengths are rounded up to this many tokens, so that nearby prompt lengths reuse one engine.
LENGTH_QUANTUM = 512


class Session:
    """A target's engine (and drafter runners), with or without CUDA graphs."""

    def __init__(self, engine: TargetEngine, graphs: bool):
        self.engine, self.graphs = engine, graphs
        self.runners: dict[tuple, DrafterRunner] = {}
        self.mtp_runners: dict[tuple, MTPRunner] = {}
        self.rounds: dict[tuple, OneStepRound] = {}
        # Why a capture failed (the steps then run eagerly: slower, same results); None if none did.
        self.capture_error: str | None = None
        if graphs:
            self._capture(engine)

    def _capture(self, owner) -> None:
        try:
            owner.capture()
        except Exception as exc:  # a kernel that cannot be captured must not cost the user the generation
            self.capture_error = f"{type(exc).__name__}: {exc}"
            for step in getattr(owner, "steps", {"draft": getattr(owner, "step", None)}).values():
                step.reset()
            warnings.warn(
                f"flashdraft engine: CUDA graph capture failed, running eagerly ({self.capture_error})", stacklevel=3
            )

    def close(self) -> None:
        """Release the CUDA graphs now (steps and engines reference each other: left to the cyclic garbage
        collector, they would be freed at an unknown moment)."""
        if self.engine.commit_stream is not None:
            self.engine.commit_stream.synchronize()  # no graph is freed while a commit may still run
        steps = [*self.engine.steps.values(), *self.engine.prefill_steps.values()]
        steps += [s for r in self.runners.values() for s in r.prefill_steps.values()]
        for step in [*steps, *(r.step for r in self._all_runners())]:
            step.reset()
        self.runners.clear()
        self.mtp_runners.clear()
        self.rounds.clear()

    def _all_runners(self) -> list:
        return [*self.runners.values(), *self.mtp_runners.values(), *self.rounds.values()]

    @property
    def captured(self) -> bool:
        return self.engine.captured and all(r.step.graph is not None for r in self._all_runners())

    def runner(self, drafter: torch.nn.Module, sampling=(0.0, 1.0, 0), generator=None) -> DrafterRunner:
        """The runner of `drafter` with these sampling settings (it draws its drafts inside its graph, which bakes
        them in)."""
        sampling = tuple(sampling) if sampling[0] > 0 else (0.0, 1.0, 0)  # greedy ignores top-p and top-k
        key = (id(drafter), sampling)
        runner = self.runners.get(key)
        if runner is None or runner.drafter is not drafter:
            runner = DrafterRunner(drafter, self.engine, sampling, generator)
            if self.graphs and self.capture_error is None:
                self._capture(runner)
            self.runners[key] = runner
        runner.generator = generator
        return runner

    def one_step_round(self, runner: DrafterRunner, verify: str = "block") -> OneStepRound:
        """The one-step round of `runner` with its current `refine` and this verification rule (its graph bakes
        both in)."""
        key = (id(runner), runner.refine, verify)
        found = self.rounds.get(key)
        if found is None or found.runner is not runner:
            found = OneStepRound(self.engine, runner, verify)
            if self.graphs and self.capture_error is None:
                self._capture(found)
            self.rounds[key] = found
        return found

    def mtp_runner(self, head: torch.nn.Module, num_drafts: int, sampling, generator) -> MTPRunner:
        """The MTP runner for `head` with these settings (its graph bakes in the number of drafts and sampling)."""
        key = (id(head), num_drafts, tuple(sampling))
        runner = self.mtp_runners.get(key)
        if runner is None or runner.head is not head:
            runner = MTPRunner(head, self.engine, num_drafts, sampling, generator)
            if self.graphs and self.capture_error is None:
                self._capture(runner)
            self.mtp_runners[key] = runner
        runner.generator = generator
        return runner


# The session lives on its target (an attribute, so that both are freed together).
_ATTRIBUTE = "_flashdraft_engine_session"


def current_session(target: torch.nn.Module) -> Session | None:
    return target.__dict__.get(_ATTRIBUTE)


def drop_session(target: torch.nn.Module) -> None:
    """Free the target's engine (caches, graphs)."""
    dropped = target.__dict__.pop(_ATTRIBUTE, None)
    if dropped is not None:
        dropped.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def session(
    target: torch.nn.Module, max_len: int, block_size: int | None, feature_layers: list[int] | None, graphs: bool
) -> Session:
    """The session of `target` if it fits, else a new one (the old one is dropped first, to free memory).

    block_size None: any (autoregressive decoding uses only the one-token step); a new session then gets 16.
    """
    current = current_session(target)
    layers = sorted(feature_layers or [])
    if current is not None:
        engine = current.engine
        fits = (
            engine.max_len >= max_len
            and block_size in (None, engine.block_size)
            and current.graphs == graphs
            and (not layers or engine.feature_layers == layers)
        )
        if fits:
            return current
        layers = layers or engine.feature_layers
        max_len = max(max_len, engine.max_len)
        block_size = block_size or engine.block_size
        del current, engine
        drop_session(target)
    block_size = block_size or 16
    max_len = -(-max_len // LENGTH_QUANTUM) * LENGTH_QUANTUM
    created = Session(TargetEngine(target, max_len, block_size, layers), graphs)
    target.__dict__[_ATTRIBUTE] = created
    return created


def prepare(
    target: torch.nn.Module,
    max_len: int,
    block_size: int,
    drafter: torch.nn.Module | None = None,
    graphs=None,
    prompt_lengths: tuple[int, ...] = (),
    sampling: tuple[float, float, int] = (0.0, 1.0, 0),
) -> Session:
    """Build (and capture) the session that decoding up to `max_len` tokens will use, ahead of timed runs, with
    the prefill graphs of prompts of `prompt_lengths` tokens (the drafter's, for its runner of these `sampling`
    settings)."""
    graphs = next(target.parameters()).device.type == "cuda" if graphs is None else graphs
    layers = list(drafter.target_layer_ids) if drafter is not None else None
    sess = session(target, max_len, verify_width(block_size, drafter), layers, graphs)
    runner = sess.runner(drafter, sampling) if drafter is not None else None
    if sess.engine.captured:
        sess.engine.capture_prefill(prompt_lengths)
        if runner is not None:
            runner.capture_prefill(prompt_lengths)
    return sess


def verify_width(block_size: int, drafter: torch.nn.Module | None) -> int:
    """Tokens a verification holds for a drafter block of `block_size`: the anchor and every draft (a DSpark
    drafter's anchor slot drafts too: one more)."""
    return block_size + (getattr(drafter, "draft_offset", 0) if drafter is not None else 0)


def engine_available(target: torch.nn.Module) -> str | None:
    """None if the engine can decode `target`, else why not."""
    return unsupported_reason(target)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def engine_decode(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    drafter: torch.nn.Module | None = None,
    lookup=None,
    mtp: torch.nn.Module | None = None,
    num_drafts: int | None = None,
    block_size: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    graphs: bool | None = None,
    refine: tuple[int, ...] = (),
    verify: str = "block",
) -> GenerationResult:
    """Decode `input_ids` (batch 1) with a DFlash `drafter`, a prompt-`lookup` proposer, the target's `mtp` head
    (`flashdraft.target.mtp.MTPHead`: `num_drafts` chained drafts per round, default 3, verified in blocks of
    `block_size`), or none of them (one token per step). graphs: CUDA graphs (default: on a CUDA target). refine:
    the drafter drafts each block in passes (`DrafterRunner.draft`), greedily only. verify: how sampled drafts are
    verified (`flashdraft.speculative.sampling`)."""
    validate_request(input_ids, max_new_tokens, temperature, top_p, top_k)
    validate_verify(verify)
    if refine and (drafter is None or temperature > 0 or getattr(drafter, "chains", False)):
        raise ValueError("the engine drafts in passes (refine) only with a DFlash drafter at temperature 0")
    if sum(x is not None for x in (drafter, lookup, mtp)) > 1:
        raise ValueError("give one of a drafter, a lookup proposer and an MTP head")
    # The engine runs its own device-aware kernels; the target's own forward (which callers may run next) gets them.
    fastpath.ensure(target)
    device = next(target.parameters()).device
    graphs = device.type == "cuda" if graphs is None else graphs
    prompt = input_ids.reshape(-1)
    result = GenerationResult(tokens=[], num_prompt_tokens=prompt.shape[0], backend="engine")
    if max_new_tokens == 0:
        return result
    speculative = drafter is not None or lookup is not None or mtp is not None
    width = verify_width(block_size, drafter)
    if mtp is not None:
        num_drafts = 3 if num_drafts is None else num_drafts
        if not 1 <= num_drafts < block_size:
            raise ValueError(f"num_drafts must be in [1, {block_size - 1}] (block_size - 1), got {num_drafts}")
    else:
        num_drafts = width - 1 if speculative else 0
    result.position_accepted, result.position_offered = [0] * num_drafts, [0] * num_drafts
    layers = list(drafter.target_layer_ids) if drafter is not None else None
    sess = session(target, prompt.shape[0] + max_new_tokens, width if speculative else None, layers, graphs)
    engine = sess.engine
    sampling = (temperature, top_p, top_k)
    runner = sess.runner(drafter, sampling, generator) if drafter is not None else None
    if runner is not None:
        runner.refine = tuple(refine)
    if mtp is not None:
        runner = sess.mtp_runner(mtp, num_drafts, sampling, generator)
    # A drafter's rounds run as one step (rounds.py), captured here, before the prefill fills the caches.
    one_step = sess.one_step_round(runner, verify) if isinstance(runner, DrafterRunner) else None
    result.backend = "engine+graphs" if sess.captured else "engine"
    stops = set(stop_token_ids or ())

    start = _now(device)
    logits = engine.prefill(prompt.to(device))
    result.num_target_forwards = 1
    last = int(next_token(logits, *sampling, generator))
    result.tokens.append(last)
    if mtp is not None:
        runner.prefill(prompt, last)
    elif runner is not None:
        runner.prefill()
        runner.block_ids[0] = last
    history = prompt.tolist() + [last] if lookup is not None else None
    tick = _now(device)
    result.time_to_first_token = tick - start
    result.stopped = last in stops
    predicts = isinstance(runner, DrafterRunner) and runner.confidence is not None

    drafted = False  # the runner already drafted this round's block (enqueued by the previous round)
    while len(result.tokens) < max_new_tokens and not result.stopped:
        want = min(num_drafts, max_new_tokens - len(result.tokens) - 1)
        result.num_target_forwards += 1
        confidence = []
        offered = 0
        if want > 0 and one_step is not None:
            if not drafted:
                one_step.start()
                runner.draft()
            # The next round enqueued before this one is read where one surely follows (this one emits at most
            # num_drafts + 1 tokens, and the next wants at least one draft), unless a stop token ends it.
            ahead = len(result.tokens) + num_drafts + 2 < max_new_tokens
            new, confidence = one_step.emit(want, ahead)
            drafted, offered = True, want
        elif want > 0 and mtp is not None:
            if not drafted:
                runner.draft()
            drafts, draft_probs = runner.drafts[:want], None if runner.probs is None else runner.probs[:want]
            engine.verify_ids[:1].copy_(runner.block_ids[:1])
            # Draft the next chain before reading this round's result when a next round surely follows.
            drafted = len(result.tokens) + want + 2 < max_new_tokens
            new = rounds.verify_round(engine, runner, drafts, draft_probs, sampling, generator, drafted, verify)
            offered = want
        else:
            proposed = None
            if want > 0 and lookup is not None:
                proposed, _ = lookup.propose(torch.tensor(history), want)
            if proposed is None:
                new = [_decode_step(engine, last, sampling, generator)]
            else:
                engine.verify_ids[0] = last
                new = rounds.verify_round(engine, None, proposed.to(device), None, sampling, generator, False, verify)
                offered = proposed.shape[0]
        for i in range(offered):
            result.position_offered[i] += 1
            result.position_accepted[i] += i < len(new) - 1
        result.drafts_accepted.append(len(new) - 1)
        if predicts:
            result.confidences.append(confidence or [])
        for j, token in enumerate(new):
            if token in stops:
                new, result.stopped = new[: j + 1], True
                break
        result.tokens.extend(new)
        result.acceptance_lengths.append(len(new))
        last = new[-1]
        if history is not None:
            history.extend(new)
        # The round's tokens were read on the host (its synchronisation): the clock needs no other.
        now = time.perf_counter()
        result.round_times.append(now - tick)
        tick = now
    result.total_time = _now(device) - start
    return result


def _decode_step(engine: TargetEngine, token: int, sampling, generator) -> int:
    engine.decode_ids.fill_(token)
    engine.decode()
    return int(next_token(engine.decode_logits[0], *sampling, generator))
