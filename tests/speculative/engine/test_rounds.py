"""A drafter's round as one step (flashdraft/speculative/engine/rounds.py), greedy and sampled: what a GPU captures
reads nothing on the host, and one round does what the separate steps did: the same acceptance, commit and next
block. (That sampled rounds emit the target's distribution: tests/speculative/engine/test_session.py.)"""

import itertools

import pytest
import torch

from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.engine.rounds import OneStepRound
from flashdraft.speculative.engine.target_runner import TargetEngine
from flashdraft.speculative.sampling import gumbel_draw, sampling_probs, verify_drafts

from .. import one_thread, random_drafter, ready, reference_greedy, tiny_target  # noqa: F401 (one_thread: autouse)
from . import HostReads
from .test_drafter_runner import CHAINED

KINDS = ["dflash", *CHAINED]


PROMPT = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))


class Scripted(DrafterRunner):
    """The real draft step (its caches written as always), its drafts then replaced by the target's greedy
    continuation with a seeded share wrong: a random drafter's drafts are never accepted, these are, in part."""

    def __init__(self, *args, script, **kwargs):
        super().__init__(*args, **kwargs)
        self.script, self.rng = script, torch.Generator().manual_seed(9)

    def _draft(self):
        super()._draft()
        anchor = int(self.context)
        tokens = torch.tensor(self.script[anchor + 1 : anchor + 1 + self.num_drafts])
        wrong = torch.rand(tokens.shape[0], generator=self.rng) < 0.25
        self.drafts[: tokens.shape[0]].copy_(torch.where(wrong, (tokens + 1) % 256, tokens))


def _round(kind: str, refine=(), scripted: bool = False, sampling=(0.0, 1.0, 0), verify="block"):
    """A prefilled engine and runner over a random drafter of `kind` (`scripted`: its drafts partly right), its
    first block drafted, and its round."""
    target = tiny_target("qwen3_5", seed=5, dtype=torch.float64)
    bs = 5
    family, fields = CHAINED.get(kind, ("dflash", {}))
    drafter = random_drafter(target, block_size=bs, seed=6, family=family, **fields).double()
    width = bs + drafter.draft_offset
    layers = list(drafter.target_layer_ids)
    engine = TargetEngine(target, max_len=64, block_size=width, feature_layers=layers)
    generator = torch.Generator().manual_seed(8)
    if scripted:
        with ready(target):
            script = PROMPT.tolist() + reference_greedy(target, PROMPT, 40)
        runner = Scripted(drafter, engine, script=script)
    else:
        runner = DrafterRunner(drafter, engine, sampling, generator)
    runner.refine = tuple(refine)
    prompt = PROMPT
    last = int(engine.prefill(prompt).argmax())
    runner.prefill(engine.prompt_features)
    runner.block_ids[0] = last
    runner.draft()
    return engine, runner, OneStepRound(engine, runner, verify)


# Flat enough that a random drafter's drafts are accepted in part (a DFlash2 drafter's, drawn among 3 candidates of
# 256 tokens, almost never: its rounds test rejections).
SAMPLED = (2.0, 1.0, 0)


@pytest.mark.parametrize("verify", ["greedy", "block", "token"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_the_round_reads_nothing_on_the_host(kind, verify):
    """The round's body (verification, acceptance by argmax or by rejection sampling, the commit that rolls the
    hybrid layers back, the next draft, a chained head's walk included) reads no device value on the host: its eager
    run under `HostReads` finds none. (Under inference mode CPU tensors read their values without dispatch, so it
    runs under no_grad here.)"""
    greedy = verify == "greedy"
    engine, runner, rnd = _round(
        kind, sampling=(0.0, 1.0, 0) if greedy else SAMPLED, verify="block" if greedy else verify
    )
    with HostReads() as reads:
        rnd.step.fn()
    assert reads.found == []


@pytest.mark.parametrize("ahead", [False, True], ids=["one-by-one", "ahead"])
@pytest.mark.parametrize("refine", [(), (1, 3)])
@pytest.mark.parametrize("kind", KINDS)
def test_one_round_is_what_the_separate_steps_did(kind, refine, ahead):
    """Two engines in the same state: one runs the round, the other verifies, accepts and commits with its own
    steps and drafts the next block. Same accepted count and bonus, same caches and lengths, same next block.
    ahead: each round enqueued before the one before it is read (two in flight), as generation runs them; the
    values read are each round's own, and the state after the last read is the same."""
    if refine and kind != "dflash":
        pytest.skip("drafting in passes is DFlash's")
    engine, runner, rnd = _round(kind, refine, scripted=True)
    twin_engine, twin_runner, _ = _round(kind, refine, scripted=True)
    assert torch.equal(runner.drafts, twin_runner.drafts)
    seen = set()
    for i in range(6):  # rounds in a row: each starts where the last one's commit and draft left it
        drafts = twin_runner.drafts.clone()
        twin_engine.verify_ids[:1].copy_(twin_runner.block_ids[:1])
        twin_engine.verify_ids[1:].copy_(drafts)
        twin_engine.verify()
        choice = twin_engine.verify_logits.argmax(-1)
        accepted = int((drafts == choice[:-1]).long().cumprod(0).sum())
        twin_engine.keep.fill_(accepted + 1)
        twin_engine.commit()
        twin_engine.note_committed(accepted + 1)
        twin_runner.pending.fill_(accepted + 1)
        twin_runner.block_ids[0] = choice[accepted]
        twin_runner.draft()

        if not ahead or not rnd.in_flight:
            rnd.run()
        if ahead and i < 5:
            rnd.run()
        got, bonus, verified, _ = rnd.read()
        assert (got, bonus, verified) == (accepted, int(choice[accepted]), drafts.tolist())
        seen.add(accepted)
        if ahead and i < 5:
            continue  # the engine is a round further on
        assert engine.num_tokens == twin_engine.num_tokens and int(engine.length) == int(twin_engine.length)
        assert torch.equal(runner.drafts, twin_runner.drafts) and torch.equal(runner.block_ids, twin_runner.block_ids)
        if engine.linear is not None:
            assert torch.equal(engine.linear.recurrent, twin_engine.linear.recurrent)
            assert torch.equal(engine.linear.conv, twin_engine.linear.conv)
    assert len(seen) > 1 and max(seen) > 0  # rounds that roll some drafts back and keep others


@pytest.mark.parametrize("verify", ["block", "token"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_sampled_round_is_what_the_separate_steps_did(kind, verify):
    """Sampling: the twin verifies the drafts against the q they were drawn from with the round's own draws (its
    uniforms, the Gumbel noise of the token after the accepted drafts, the runner's noise of the next block, left in
    their buffers), commits, and drafts the next block. Same accepted count and token, caches, next block and q."""
    engine, runner, rnd = _round(kind, sampling=SAMPLED, verify=verify)
    twin_engine, twin_runner, _ = _round(kind, sampling=SAMPLED, verify=verify)
    assert torch.equal(runner.drafts, twin_runner.drafts) and torch.equal(runner.probs, twin_runner.probs)
    seen = set()
    for _ in range(6):
        drafts, q = twin_runner.drafts.clone(), twin_runner.probs.clone()
        rnd.run()
        got, token, verified, _ = rnd.read()

        twin_engine.verify_ids[:1].copy_(twin_runner.block_ids[:1])
        twin_engine.verify_ids[1:].copy_(drafts)
        twin_engine.verify()
        target_probs = sampling_probs(twin_engine.verify_logits, *SAMPLED)
        accepted, after = verify_drafts(drafts, q, target_probs, rnd.uniforms, verify)
        accepted, expected = int(accepted), int(gumbel_draw(after, rnd.noise))
        assert (got, token, verified) == (accepted, expected, drafts.tolist())
        assert after[expected] > 0  # the token is one the distribution after the accepted drafts can give
        twin_engine.keep.fill_(accepted + 1)
        twin_engine.commit()
        twin_engine.note_committed(accepted + 1)
        twin_runner.pending.fill_(accepted + 1)
        twin_runner.block_ids[0] = expected
        twin_runner.noise.copy_(runner.noise)
        twin_runner.passes(twin_runner.step)
        seen.add(accepted)

        assert engine.num_tokens == twin_engine.num_tokens and int(engine.length) == int(twin_engine.length)
        assert torch.equal(runner.drafts, twin_runner.drafts) and torch.equal(runner.probs, twin_runner.probs)
        assert torch.equal(runner.block_ids, twin_runner.block_ids)
        assert torch.equal(engine.linear.recurrent, twin_engine.linear.recurrent)
    assert kind == "dflash2" or len(seen) > 1  # rounds that kept different numbers of drafts


def test_rounds_draw_afresh_and_a_generator_repeats_them():
    """Each sampled round draws new uniforms, new noise for its token and new noise for the next block's drafts from
    the runner's generator (a round that reused the last ones would tie its draws to the round before); the same
    seed gives the same rounds."""

    def rounds(seed):
        engine, runner, rnd = _round("dflash", sampling=SAMPLED)
        runner.generator.manual_seed(seed)
        out, draws = [], []
        for _ in range(4):
            rnd.run()
            out.append(rnd.read()[:3])
            draws.append([rnd.uniforms.clone(), rnd.noise.clone(), runner.noise.clone()])
        return out, draws

    first, draws = rounds(11)
    for before, after in itertools.pairwise(draws):
        assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert rounds(11)[0] == first
