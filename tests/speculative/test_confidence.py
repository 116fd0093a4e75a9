"""A DSpark drafter's confidence head in decoding: each round records c_k = sigmoid(confidence logit) of every
verified draft given the token before it, in the plain loop and (equal to it) over the engine; the predictions
change nothing that is verified or emitted; calibration counts a position only over the rounds that reached it."""

import copy
import importlib
import math

import pytest
import torch

from flashdraft.speculative import generate
from flashdraft.speculative.engine import session
from flashdraft.speculative.engine.rounds import OneStepRound
from flashdraft.speculative.prompt_stats import Calibration
from flashdraft.speculative.result import GenerationResult

from . import one_thread, random_drafter, ready, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from .engine import CONFIGS

# The module: the package exports the function `generate` under the same name.
plain_loop = importlib.import_module("flashdraft.speculative.generate")


def shipped_as_dspark(refinable: bool = False):
    """The shipped trained drafter (float64) with DSpark's heads on top: a Markov head that adds nothing (so that
    its drafts are the shipped drafter's, and accepted) and a confidence head of random, spread out weights.
    refinable: no Markov head at all (markov_rank 0), which the plain loop and the engine may draft in passes."""
    from flashdraft import bundled
    from flashdraft.drafter import DFlashDraftModel

    shipped = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float64)
    config = copy.deepcopy(shipped.config)
    config.architectures = ["DSparkDraftModel"]
    rank = 0 if refinable else 8
    fields = {"markov_rank": rank, "sample_from_anchor": False, "confidence_head_with_markov": not refinable}
    config.dflash_config = {**config.dflash_config, **fields}
    torch.manual_seed(5)
    drafter = DFlashDraftModel(config).to(torch.float64).eval()
    missing, unexpected = drafter.load_state_dict(shipped.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("markov_head.", "confidence_head.")) for k in missing), missing
    with torch.no_grad():
        drafter.confidence_head.proj.weight.normal_(0, 0.02)
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w2.weight.zero_()
            drafter.markov_head.markov_w1.weight.mul_(50)  # the previous token moves the confidence
    return drafter


@pytest.fixture(scope="module")
def shipped():
    """(shipped target in float64, its tokenizer's prompts of the held-out file, cut to 40 tokens)."""
    import json

    from transformers import AutoModelForCausalLM

    from flashdraft import bundled

    target = AutoModelForCausalLM.from_pretrained(bundled.target_dir(), dtype=torch.float64).eval()
    tokenizer = bundled.load_tokenizer()
    lines = bundled.eval_prompts().read_text().splitlines()[:2]
    prompts = [tokenizer(json.loads(line)["prompt"], return_tensors="pt").input_ids[:, -40:] for line in lines]
    return target, prompts


def _recording(monkeypatch):
    """Records each plain-loop proposal: (tokens so far, drafts, the proposer's confidence)."""
    records, propose = [], plain_loop.DFlashProposer.propose

    def spy(self, tokens, num_drafts):
        drafts, probs = propose(self, tokens, num_drafts)
        records.append((tokens.clone(), drafts.clone(), None if self.confidence is None else self.confidence.clone()))
        return drafts, probs

    monkeypatch.setattr(plain_loop.DFlashProposer, "propose", spy)
    return records


@torch.inference_mode()
def _expected_confidence(target, drafter, tokens, drafts, block_size, fixed=()):
    """sigmoid(confidence_logits) of `drafts` after `tokens`, from uncached forwards (target, then drafter over the
    whole context and the block), pass by pass as the loop drafts them (`fixed`: the refine schedule)."""
    from flashdraft.drafter import select_context_features

    hidden_states = target(input_ids=tokens[None, :-1], output_hidden_states=True).hidden_states
    context = select_context_features(hidden_states, drafter.target_layer_ids)
    block = torch.full((1, block_size), drafter.mask_token_id, dtype=torch.long, device=tokens.device)
    block[0, 0] = tokens[-1]
    positions = torch.arange(tokens.shape[0] - 1 + block_size, device=tokens.device)[None]
    embed = target.get_input_embeddings()
    start, out, lo = 1 - drafter.draft_offset, [], 0
    for hi in (*[k for k in fixed if k < len(drafts)], len(drafts)):
        hidden = drafter(position_ids=positions, noise_embedding=embed(block), target_hidden=context)
        prev = torch.cat([block[0, lo : lo + 1], drafts[lo : hi - 1]])
        out.append(torch.sigmoid(drafter.confidence_logits(hidden[0, start + lo : start + hi], prev)))
        if hi < len(drafts):  # another pass follows, over the block with these drafts fixed
            block[0, 1 + lo : 1 + hi] = drafts[lo:hi]
        lo = hi
    return torch.cat(out)


@pytest.mark.parametrize("refine", [(), (2, 5)])
def test_recorded_confidence_is_the_heads_over_the_drafts_in_both_loops(shipped, monkeypatch, refine):
    """Round by round, the plain loop's recorded c_k are the head's over an uncached forward of the round's
    drafts (the anchor, then each draft, before the next); the engine records the same; greedy output is the
    target's and the same as without a confidence head."""
    target, prompts = shipped
    drafter = shipped_as_dspark(refinable=bool(refine))
    records = _recording(monkeypatch)
    with ready(target):
        for i, prompt in enumerate(prompts):
            records.clear()
            plain = generate(target, drafter, prompt, 32, engine=False, refine=refine)
            with_drafts = [r for r in records if r[1].numel()]
            assert len(plain.confidences) == plain.num_rounds and len(with_drafts) >= plain.num_rounds - 1
            for round_index, (tokens, drafts, confidence) in enumerate(with_drafts):
                assert plain.confidences[round_index] == confidence.tolist()
                expected = _expected_confidence(target, drafter, tokens, drafts, drafter.block_size, refine)
                torch.testing.assert_close(confidence, expected, atol=1e-6, rtol=0)
            values = [c for round_values in plain.confidences for c in round_values]
            assert 1e-3 < min(values) and max(values) < 1 - 1e-3 and max(values) - min(values) > 0.2  # informative
            engine = generate(target, drafter, prompt, 32, engine=True, refine=refine)
            assert engine.backend == "engine" and engine.tokens == plain.tokens
            assert engine.acceptance_lengths == plain.acceptance_lengths
            assert engine.drafts_accepted == plain.drafts_accepted
            assert len(engine.confidences) == len(plain.confidences)
            for mine, theirs in zip(engine.confidences, plain.confidences, strict=True):
                assert mine == pytest.approx(theirs, abs=1e-6), f"prompt {i}"
            with torch.inference_mode():  # greedy: each token is the target's argmax after the ones before it
                logits = target(torch.cat([prompt[0], torch.tensor(plain.tokens)])[None]).logits[0]
            assert plain.tokens == logits[prompt.shape[1] - 1 : -1].argmax(-1).tolist(), f"prompt {i}"
            # Without the head: the same drafts verified, the same tokens, nothing predicted.
            head, drafter.confidence_head = drafter.confidence_head, None
            try:
                session.drop_session(target)  # the engine's runner of this drafter had a confidence buffer
                for on in (False, True):
                    bare = generate(target, drafter, prompt, 32, engine=on, refine=refine)
                    assert bare.tokens == plain.tokens and bare.acceptance_lengths == plain.acceptance_lengths
                    assert bare.confidences == []
            finally:
                drafter.confidence_head = head
                session.drop_session(target)
    assert sum(plain.drafts_accepted) > 0  # the shipped drafter's drafts are accepted: positions beyond 1 reached


def test_calibration_counts_a_position_only_over_the_rounds_that_reached_it(shipped):
    target, prompts = shipped
    drafter = shipped_as_dspark()
    with ready(target):
        results = [generate(target, drafter, prompt, 32, engine=False) for prompt in prompts]
    calibration = Calibration()
    for result in results:
        calibration.add(result)
    table = calibration.table()
    rounds = [(c, a) for r in results for c, a in zip(r.confidences, r.drafts_accepted, strict=True)]
    assert len(table) == drafter.num_drafts
    for row in table:
        k = row["position"] - 1
        offered = [(c, a) for c, a in rounds if len(c) > k]
        reached = [(c, a) for c, a in offered if a >= k]
        assert row["rounds"] == len(reached) and row["survival_rounds"] == len(offered)
        if reached:
            assert row["predicted"] == pytest.approx(sum(c[k] for c, _ in reached) / len(reached))
            assert row["observed"] == pytest.approx(sum(a > k for _, a in reached) / len(reached))
        else:
            assert math.isnan(row["predicted"]) and math.isnan(row["observed"])
        assert row["predicted_survival"] == pytest.approx(sum(math.prod(c[: k + 1]) for c, _ in offered) / len(offered))
        assert row["observed_survival"] == pytest.approx(sum(a > k for _, a in offered) / len(offered))
    # Rounds whose first draft was rejected do not reach position 2: fewer rounds, a rate conditioned on reaching it.
    assert 0 < table[1]["rounds"] < table[0]["rounds"]
    unconditional = sum(r.position_accepted[1] for r in results) / sum(r.position_offered[1] for r in results)
    assert table[1]["observed"] > unconditional


def test_calibration_of_scripted_rounds():
    """Three rounds of three drafts, accepting 3, 0 and 1: position 1 is reached by all, 2 by the first and the
    third, 3 by the first only."""
    result = GenerationResult(tokens=[0] * 8, acceptance_lengths=[4, 1, 2], drafts_accepted=[3, 0, 1])
    result.confidences = [[0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.6, 0.6, 0.6]]
    calibration = Calibration()
    calibration.add(result)
    calibration.add(GenerationResult(tokens=[0], acceptance_lengths=[1], drafts_accepted=[0], confidences=[[]]))
    rows = {row["position"]: row for row in calibration.table()}
    assert [rows[k]["rounds"] for k in (1, 2, 3)] == [3, 2, 1]
    assert rows[1]["predicted"] == pytest.approx((0.9 + 0.5 + 0.6) / 3) and rows[1]["observed"] == pytest.approx(2 / 3)
    assert rows[2]["predicted"] == pytest.approx((0.8 + 0.6) / 2) and rows[2]["observed"] == pytest.approx(1 / 2)
    assert rows[3]["predicted"] == pytest.approx(0.7) and rows[3]["observed"] == 1.0
    assert rows[2]["predicted_survival"] == pytest.approx((0.72 + 0.2 + 0.36) / 3)
    assert rows[2]["observed_survival"] == pytest.approx(1 / 3) and rows[3]["survival_rounds"] == 3


def test_sampled_dspark_records_a_confidence_per_verified_draft():
    """When sampling, each loop records one prediction per draft it verified (fewer in the last rounds), each a
    probability, in every round."""
    target = tiny_target("qwen3", seed=11)
    drafter = random_drafter(target, block_size=4, seed=14, family="dspark")
    prompt = torch.randint(0, 255, (1, 9), generator=torch.Generator().manual_seed(1))
    with ready(target):
        for on in (False, True):
            generator = torch.Generator().manual_seed(0)
            result = generate(target, drafter, prompt, 12, temperature=1.0, generator=generator, engine=on)
            assert len(result.confidences) == result.num_rounds == len(result.drafts_accepted)
            for i, confidence in enumerate(result.confidences):
                offered = min(drafter.num_drafts, 12 - 2 - sum(result.acceptance_lengths[:i]))
                assert len(confidence) == offered and all(0 < c < 1 for c in confidence), (on, i)
                assert 0 <= result.drafts_accepted[i] <= offered
    session.drop_session(target)


@pytest.mark.parametrize("config", CONFIGS)
def test_engine_records_the_heads_confidence_of_the_drafts_it_verifies(config, monkeypatch):
    """Over the engine (on a GPU with its graphs, the next block drafted before the host reads the round, the
    predictions read through pinned memory): each round's predictions are the head's over the drafts that round
    verified, recomputed by uncached forwards."""
    device, dtype, graphs = config
    target = tiny_target("qwen3", seed=11, dtype=dtype).to(device)
    drafter = random_drafter(target, block_size=4, seed=14, family="dspark").to(device)
    with torch.no_grad():
        drafter.confidence_head.proj.weight.mul_(20)  # predictions spread over (0, 1), not all ~0.5
    verified, read = [], OneStepRound.read

    def spy(greedy):
        values = read(greedy)
        verified.append((values[2], values[3]))  # the drafts this round verified, the head's confidence in each
        return values

    monkeypatch.setattr(OneStepRound, "read", spy)
    prompt = torch.randint(0, 255, (1, 11), generator=torch.Generator().manual_seed(2)).to(device)
    with ready(target):
        result = session.engine_decode(target, prompt, 24, drafter=drafter, block_size=4, graphs=graphs)
    assert result.backend == ("engine+graphs" if graphs else "engine")
    # What generation reports per round: the confidence in the drafts it asked for (all of them, but near the end).
    reported = result.confidences[: len(verified)]
    assert [c[: len(r)] for (_, c), r in zip(verified, reported, strict=True)] == reported
    assert len(verified) >= result.num_rounds - 1
    tokens = torch.cat([prompt[0], torch.tensor(result.tokens, device=device)])
    emitted = 1
    for (drafts, confidence), length in zip(verified, result.acceptance_lengths, strict=False):
        before = tokens[: prompt.shape[1] + emitted]
        expected = _expected_confidence(target, drafter, before, torch.tensor(drafts, device=device), 4)
        assert confidence == pytest.approx(expected.tolist(), abs=1e-6 if dtype == torch.float64 else 1e-4)
        emitted += length
    values = [c for round_values in result.confidences for c in round_values]
    assert max(values) - min(values) > 0.2
    session.drop_session(target)
