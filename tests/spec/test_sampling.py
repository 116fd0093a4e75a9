"""Sampling is lossless: rejection sampling against analytic probabilities, and speculative decoding end to end
against the target's exact joint distribution of two generated tokens (chi-square, fixed seeds)."""

import pytest
import torch

from flashdraft.spec import generate
from flashdraft.spec.sampling import next_token, rejection_sample, sampling_probs

from . import one_thread, random_drafter, ready, tiny_target  # noqa: F401 (one_thread: autouse fixture)

P_MIN = 1e-3


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expected below 5 are pooled into one. A count where nothing is expected gives 0."""
    observed, expected = observed.double().flatten(), expected_probs.double().flatten() * observed.sum()
    if (observed[expected <= 0] > 0).any():
        return 0.0
    observed, expected = observed[expected > 0], expected[expected > 0]
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def _dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


def test_chi_square_helper_detects_a_wrong_distribution():
    g = torch.Generator().manual_seed(0)
    p = _dist(5, 3, 1, 1)
    counts = torch.bincount(torch.multinomial(p, 4000, replacement=True, generator=g), minlength=4)
    assert chi_square_pvalue(counts, p) > P_MIN
    assert chi_square_pvalue(counts, _dist(4, 4, 1, 1)) < P_MIN


def test_sampling_probs_filters():
    logits = torch.log(_dist(4, 3, 2, 1))
    assert torch.allclose(sampling_probs(logits, 1.0), _dist(4, 3, 2, 1))
    assert torch.allclose(sampling_probs(logits, 1.0, top_k=2), _dist(4, 3, 0, 0))
    # top_p keeps the smallest prefix reaching the mass: 0.4 < 0.5 so the second token stays too.
    assert torch.allclose(sampling_probs(logits, 1.0, top_p=0.5), _dist(4, 3, 0, 0))
    assert torch.allclose(sampling_probs(logits, 1.0, top_p=0.35), _dist(1, 0, 0, 0))
    hot = sampling_probs(logits, 0.5)
    assert torch.allclose(hot, _dist(16, 9, 4, 1))
    assert int(next_token(logits, 0.0)) == 0
    with pytest.raises(ValueError, match="top_p"):
        next_token(logits, 1.0, top_p=0.0)


def _run_rejections(draft_probs, target_probs, trials, one_hot_drafts=None, seed=0):
    """Emitted sequences (accepted drafts + next token) of `trials` rejection steps."""
    g = torch.Generator().manual_seed(seed)
    outcomes = []
    for _ in range(trials):
        if one_hot_drafts is None:
            drafts = torch.multinomial(draft_probs, 1, generator=g)[:, 0]
            accepted, token = rejection_sample(drafts, draft_probs, target_probs, g)
        else:
            drafts = one_hot_drafts
            accepted, token = rejection_sample(drafts, None, target_probs, g)
        outcomes.append(drafts[:accepted].tolist() + [token])
    return outcomes


def test_rejection_sampling_matches_analytic_probabilities():
    # Two drafts from q, verified against p (rows: position 1, position 2, bonus).
    q = torch.stack([_dist(1, 1, 6, 2, 0.5), _dist(3, 1, 1, 1, 4)])
    p = torch.stack([_dist(4, 2, 1, 2, 1), _dist(1, 5, 1, 2, 1), _dist(2, 2, 1, 1, 4)])
    trials = 12000
    outcomes = _run_rejections(q, p, trials)
    first = torch.bincount(torch.tensor([o[0] for o in outcomes]), minlength=5)
    assert chi_square_pvalue(first, p[0]) > P_MIN
    # Given draft 1 accepted, the second emitted token (draft 2 or its correction) is distributed as p[1] ...
    second = [o[1] for o in outcomes if len(o) >= 2]
    assert chi_square_pvalue(torch.bincount(torch.tensor(second), minlength=5), p[1]) > P_MIN
    # ... and after both, the bonus as p[2].
    bonus = [o[2] for o in outcomes if len(o) == 3]
    assert chi_square_pvalue(torch.bincount(torch.tensor(bonus), minlength=5), p[2]) > P_MIN
    # Acceptance counts: P(accept one draft) = sum(min(p, q)).
    a1, a2 = torch.minimum(p[0], q[0]).sum().item(), torch.minimum(p[1], q[1]).sum().item()
    lengths = torch.bincount(torch.tensor([len(o) - 1 for o in outcomes]), minlength=3)
    assert chi_square_pvalue(lengths, torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2])) > P_MIN


def test_rejection_sampling_of_deterministic_drafts():
    # Prompt lookup: q is one-hot on the draft; accept with p(x), otherwise draw from p without x.
    p = torch.stack([_dist(4, 2, 1, 2, 1), _dist(1, 5, 1, 2, 1)])
    outcomes = _run_rejections(None, p, 8000, one_hot_drafts=torch.tensor([1]))
    first = torch.bincount(torch.tensor([o[0] for o in outcomes]), minlength=5)
    assert chi_square_pvalue(first, p[0]) > P_MIN
    bonus = [o[1] for o in outcomes if len(o) == 2]
    assert chi_square_pvalue(torch.bincount(torch.tensor(bonus), minlength=5), p[1]) > P_MIN


def test_rejection_sampling_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n \\+ 1"):
        rejection_sample(torch.tensor([1, 2]), None, torch.ones(2, 4) / 4)


# ---- end to end ------------------------------------------------------------------------------------------------

VOCAB8 = 8
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 1, 4]])


@torch.inference_mode()
def _exact_joint_of_tokens_2_and_3(target, temperature, top_p, top_k) -> torch.Tensor:
    """P(x2, x3) of the target's own sampling, x1 summed out, by enumerating every x1, x2."""
    v = VOCAB8
    x1, x2 = torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij")
    ids = torch.cat([PROMPT.expand(v * v, -1), x1.reshape(-1, 1), x2.reshape(-1, 1)], dim=1)
    ids = ids.to(next(target.parameters()).device)
    probs = sampling_probs(target(ids).logits[:, -3:], temperature, top_p, top_k).view(v, v, 3, v)
    p1 = probs[0, 0, 0]  # (x1)
    p2 = probs[:, 0, 1]  # (x1, x2)
    p3 = probs[:, :, 2]  # (x1, x2, x3)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


CASES = {
    # hybrid target, DFlash; max_new_tokens 4 puts x2 and x3 in one verified block (accept/accept,
    # accept/correct, correct then a second speculative round)
    "dflash-hybrid": ("qwen3_5", 4, 1.0, 1.0, 0),
    # plain target, DFlash with top-k/top-p; max_new_tokens 3: x3 is the bonus token after an accepted x2
    "dflash-plain-filtered": ("qwen3", 3, 0.8, 0.9, 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_equals_target_distribution(case):
    family, max_new, temperature, top_p, top_k = CASES[case]
    # float32 and transformers' own torch delta rule: sampling exactness does not need float64.
    target = tiny_target(family, num_layers=4, vocab_size=VOCAB8, seed=3, dtype=torch.float32)
    with torch.no_grad():  # peaked distributions, so that drafts are often rejected and corrections matter
        target.get_output_embeddings().weight.mul_(30)
    drafter = random_drafter(target, block_size=3, seed=4)
    trials = 1500
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(VOCAB8, VOCAB8)
    accepted_any = 0
    with ready(target):
        expected = _exact_joint_of_tokens_2_and_3(target, temperature, top_p, top_k)
        for _ in range(trials):
            r = generate(target, drafter, PROMPT, max_new, temperature, top_p, top_k, block_size=3, generator=g)
            counts[r.tokens[1], r.tokens[2]] += 1
            accepted_any += any(a > 1 for a in r.acceptance_lengths)
    pvalue = chi_square_pvalue(counts, expected)
    print(f"\n{case}: p-value {pvalue:.3g}; runs with an accepted draft: {accepted_any}/{trials}")
    assert pvalue > P_MIN
    assert 0.05 * trials < accepted_any < 0.95 * trials  # both acceptance and rejection were exercised
