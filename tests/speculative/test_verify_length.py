"""How many drafts a round verifies from a confidence head: the rule against hand-worked rounds, its decisions a
stopping time of the confidences, the cost table, and decoding with it (greedy: the target's output; sampling:
tests/speculative/test_sampling.py)."""

import importlib
import random

import pytest
import torch

from flashdraft.speculative.generate import generate, use_engine
from flashdraft.speculative.verify_length import ConfidenceLength, RoundCost, validate_verify_length

from . import one_thread, random_drafter, ready, reference_greedy, tiny_target  # noqa: F401 (one_thread: autouse)

# The module, not the function the package exports under the same name.
generate_module = importlib.import_module("flashdraft.speculative.generate")

# A round on a CPU: drafting 1 s, a forward 1 s plus 1 s per fed token.
CPU_LIKE = RoundCost(draft_s=1.0, verify_fixed_s=1.0, verify_token_s=1.0)
# On a GPU at batch 1 the width is nearly free.
GPU_LIKE = RoundCost(draft_s=1.0, verify_fixed_s=1.0, verify_token_s=0.0)
# Every fed token a second, drafting almost free: the rule cuts most rounds.
STEEP = RoundCost(draft_s=0.1, verify_fixed_s=0.0, verify_token_s=1.0)


def test_round_cost_is_the_drafting_and_a_line_in_the_width():
    assert CPU_LIKE.round_s(1) == 3.0 and CPU_LIKE.round_s(8) == 10.0 and GPU_LIKE.round_s(17) == 2.0


def test_the_rule_against_hand_worked_rounds():
    rule = ConfidenceLength(CPU_LIKE)
    # fed_before 1 (the anchor): T(n) = 1 + 1 + (1 + n) = 3 + n.
    # c = 0.9, 0.9, 0.1: E = 1.9 / 4 = 0.475; 2.71 / 5 = 0.542 (longer pays); 2.791 / 6 = 0.465 (it does not).
    assert rule.drafts([0.9, 0.9, 0.1, 0.9], fed_before=1) == 2
    # Every draft certain: each adds a token for a token's cost, 1 / 1 beats the rate so far.
    assert rule.drafts([1.0] * 6, fed_before=1) == 6
    # Nothing expected: the first draft only (a round verifies at least one).
    assert rule.drafts([0.0, 0.9, 0.9], fed_before=1) == 1
    # Deferred tokens make the forward wider, so a longer block pays more easily: 2.71 / 9 > 1.9 / 8, and
    # 2.791 / 10 < 2.71 / 9.
    assert ConfidenceLength(CPU_LIKE).drafts([0.9, 0.9, 0.1], fed_before=5) == 2
    # Where width is free, any chance of acceptance is worth verifying.
    assert ConfidenceLength(GPU_LIKE).drafts([0.5, 0.01, 0.3, 0.001], fed_before=1) == 4
    assert ConfidenceLength(CPU_LIKE).drafts([], fed_before=1) == 0


def test_each_decision_reads_only_the_confidences_up_to_it():
    """The rule stops at n: whatever the confidences after position n + 1 are, it stops at n again; and it reads
    c_{n+1} (the one that made it stop), so the number verified is a stopping time of the drafts (c_j is computed
    from the draft before j)."""
    rng = random.Random(0)
    rule = ConfidenceLength(CPU_LIKE)
    for _ in range(300):
        fed_before = rng.randint(1, 4)
        confidence = [rng.random() ** 0.3 for _ in range(7)]
        n = rule.drafts(confidence, fed_before)
        for _ in range(5):
            tail = [rng.random() for _ in range(7 - (n + 1))]
            assert rule.drafts(confidence[: n + 1] + tail, fed_before) == n


@torch.inference_mode()
def test_the_forwards_cost_is_the_least_squares_line_never_falling():
    from flashdraft.speculative.verify_length import _line

    assert _line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0]) == pytest.approx((1.0, 2.0))
    # Noise around a flat cost: the fit's slope, here negative, is read as 0 and the level as the mean.
    assert _line([1, 2, 3], [2.0, 1.0, 1.5]) == pytest.approx((1.5, 0.0))


@torch.inference_mode()
def test_measure_times_the_drafting_and_each_width(monkeypatch):
    target = tiny_target("qwen3", dtype=torch.float32)
    widths, calls = [], []
    forward = target.forward

    def counted(*args, input_ids, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(target, "forward", counted)
    RoundCost.measure(target, lambda: calls.append(1), widths=range(1, 6), repeats=2)
    assert widths == [*range(1, 6)] * 3  # a warm-up sweep and two timed, interleaved
    assert len(calls) == 3  # the drafting too


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="verify_length must be one of full, confidence, got 'some'"):
        validate_verify_length("some")
    target = tiny_target("qwen3", dtype=torch.float32)
    dflash = random_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="needs a drafter with a confidence head"):
        generate(target, dflash, torch.tensor([[1, 2, 3]]), 4, verify_length="confidence")
    assert use_engine(target, None, verify_length="confidence") is False


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_greedy_output_is_the_targets_with_fewer_drafts_verified(family, monkeypatch):
    """A steep cost makes the rule cut most rounds short; the output stays the target's own greedy decoding, and
    fewer drafts are offered than the blocks hold."""
    monkeypatch.setattr(generate_module, "_round_cost", lambda *args: STEEP)
    target = tiny_target(family, seed=3)
    drafter = random_drafter(target, block_size=5, seed=4, family="dspark")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with ready(target):
        expected = reference_greedy(target, prompt, 24)
        cut = generate(target, drafter, prompt, 24, verify_length="confidence")
        full = generate(target, drafter, prompt, 24)
    assert cut.tokens == expected and full.tokens == expected
    offered = sum(cut.position_offered)
    assert offered < (cut.num_rounds - 1) * drafter.num_drafts, (offered, cut.num_rounds)
    # Each round reports the confidences of the drafts it verified, and only those.
    assert sum(len(c) for c in cut.confidences) == offered
    assert all(a - 1 <= len(c) for a, c in zip(cut.acceptance_lengths, cut.confidences, strict=True))


def test_eval_reports_the_drafts_verified_and_the_targets_output(monkeypatch):
    """`evaluate(..., verify_length="confidence")` decodes in the plain loop, keeps greedy output (0 mismatches
    against autoregressive decoding), and says how many drafts a round verified, in the report and its print."""
    from io import StringIO

    from rich.console import Console

    from flashdraft.speculative.evaluate import evaluate
    from flashdraft.speculative.prompts import Prompt
    from flashdraft.speculative.report import print_report

    monkeypatch.setattr(generate_module, "_round_cost", lambda *args: STEEP)
    target = tiny_target("qwen3", seed=3)
    drafter = random_drafter(target, block_size=5, seed=4, family="dspark")
    g = torch.Generator().manual_seed(1)
    prompts = [Prompt(torch.randint(0, 200, (1, n), generator=g), "random", i) for i, n in enumerate((5, 9))]
    with ready(target):
        report = evaluate(target, drafter, prompts, max_new_tokens=16, progress=False, verify_length="confidence")
    assert report["verify_length"] == "confidence" and report["greedy_mismatches"] == 0
    assert report["backend"] == "plain"
    verified = report["methods"]["dflash"]["drafts_verified_per_round"]
    assert 0 < verified < drafter.num_drafts
    out = StringIO()
    print_report(report, Console(file=out, width=160))
    assert f"drafts verified per round: {verified:.2f} of {drafter.num_drafts}" in out.getvalue()
    assert "drafts verified by confidence" in out.getvalue()
