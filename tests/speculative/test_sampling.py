"""Sampling is lossless: both verification rules (token by token and block verification) against analytic
probabilities and, for block verification, an exact enumeration of whole generations; speculative decoding end to
end against the target's exact joint distribution of two generated tokens (chi-square, fixed seeds)."""

import bisect
import importlib
import itertools
import math

import pytest
import torch

from flashdraft.speculative import generate
from flashdraft.speculative.sampling import (
    block_acceptance,
    correction_distribution,
    next_token,
    rejection_sample,
    sample,
    sampling_probs,
)
from flashdraft.speculative.verify_length import ConfidenceLength, RoundCost

from . import one_thread, random_drafter, ready, tiny_target  # noqa: F401 (one_thread: autouse fixture)

GENERATE = importlib.import_module("flashdraft.speculative.generate")  # the module (the package exports the function)

P_MIN = 1e-3


def _pearson(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int] | None:
    """Pearson's statistic and degrees of freedom of one multinomial sample; cells expected below 5 are pooled
    into one. None when a count falls where nothing is expected (impossible under the null)."""
    observed, expected = observed.double().flatten(), expected_probs.double().flatten() * observed.sum()
    if (observed[expected <= 0] > 0).any():
        return None
    observed, expected = observed[expected > 0], expected[expected > 0]
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(((observed - expected) ** 2 / expected).sum()), observed.numel() - 1


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expected below 5 are pooled into one. A count where nothing is expected gives 0."""
    result = _pearson(observed, expected_probs)
    if result is None:
        return 0.0
    stat, dof = result
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def conditional_chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """One test of many multinomial rows `[..., V]`, each against its own distribution given its own count:
    the rows' Pearson statistics and degrees of freedom are summed (rows with no count add nothing)."""
    from scipy.stats import chi2

    stat, dof = 0.0, 0
    for row, probs in zip(
        observed.reshape(-1, observed.shape[-1]), expected_probs.reshape(-1, observed.shape[-1]), strict=True
    ):
        if row.sum() == 0:
            continue
        result = _pearson(row, probs)
        if result is None:
            return 0.0
        stat, dof = stat + result[0], dof + result[1]
    return float(chi2.sf(stat, dof)) if dof else 1.0


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


def _run_rejections(draft_probs, target_probs, trials, verify, one_hot_drafts=None, seed=0):
    """Emitted sequences (accepted drafts + next token) of `trials` verification steps."""
    g = torch.Generator().manual_seed(seed)
    outcomes = []
    for _ in range(trials):
        if one_hot_drafts is None:
            drafts = torch.multinomial(draft_probs, 1, generator=g)[:, 0]
            accepted, token = rejection_sample(drafts, draft_probs, target_probs, g, verify)
        else:
            drafts = one_hot_drafts
            accepted, token = rejection_sample(drafts, None, target_probs, g, verify)
        outcomes.append(drafts[:accepted].tolist() + [token])
    return outcomes


def _block_lengths(q, p) -> torch.Tensor:
    """P(exactly j of the drafts accepted) under block verification, summed over every draft block drawn from the
    independent rows of q: accepting j means the j-th stop fires and no later one does."""
    n, vocab = q.shape
    out = torch.zeros(n + 1, dtype=torch.float64)
    for block in itertools.product(range(vocab), repeat=n):
        drafts = torch.tensor(block)
        stop, _ = block_acceptance(drafts, q, p)
        for j in range(n + 1):
            out[j] += q[torch.arange(n), drafts].prod() * (stop[j - 1] if j else 1) * (1 - stop[j:]).prod()
    return out


@pytest.mark.parametrize("verify", ["token", "block"])
def test_rejection_sampling_matches_analytic_probabilities(verify):
    # Two drafts from q, verified against p (rows: position 1, position 2, bonus).
    q = torch.stack([_dist(1, 1, 6, 2, 0.5), _dist(3, 1, 1, 1, 4)])
    p = torch.stack([_dist(4, 2, 1, 2, 1), _dist(1, 5, 1, 2, 1), _dist(2, 2, 1, 1, 4)])
    trials = 12000
    outcomes = _run_rejections(q, p, trials, verify)
    first = torch.bincount(torch.tensor([o[0] for o in outcomes]), minlength=5)
    assert chi_square_pvalue(first, p[0]) > P_MIN
    # Given draft 1 accepted, the second emitted token (draft 2 or its correction) is distributed as p[1] ...
    second = [o[1] for o in outcomes if len(o) >= 2]
    assert chi_square_pvalue(torch.bincount(torch.tensor(second), minlength=5), p[1]) > P_MIN
    # ... and after both, the bonus as p[2].
    bonus = [o[2] for o in outcomes if len(o) == 3]
    assert chi_square_pvalue(torch.bincount(torch.tensor(bonus), minlength=5), p[2]) > P_MIN
    lengths = torch.bincount(torch.tensor([len(o) - 1 for o in outcomes]), minlength=3)
    if verify == "token":  # P(accept one draft) = sum(min(p, q))
        a1, a2 = torch.minimum(p[0], q[0]).sum().item(), torch.minimum(p[1], q[1]).sum().item()
        expected = torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2])
    else:
        expected = _block_lengths(q, p)
    assert chi_square_pvalue(lengths, expected) > P_MIN


@pytest.mark.parametrize("verify", ["token", "block"])
def test_rejection_sampling_of_deterministic_drafts(verify):
    # Prompt lookup: q is one-hot on the draft; accept with p(x), otherwise draw from p without x.
    p = torch.stack([_dist(4, 2, 1, 2, 1), _dist(1, 5, 1, 2, 1)])
    outcomes = _run_rejections(None, p, 8000, verify, one_hot_drafts=torch.tensor([1]))
    first = torch.bincount(torch.tensor([o[0] for o in outcomes]), minlength=5)
    assert chi_square_pvalue(first, p[0]) > P_MIN
    bonus = [o[1] for o in outcomes if len(o) == 2]
    assert chi_square_pvalue(torch.bincount(torch.tensor(bonus), minlength=5), p[1]) > P_MIN


def test_rejection_sampling_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n \\+ 1"):
        rejection_sample(torch.tensor([1, 2]), None, torch.ones(2, 4) / 4)
    with pytest.raises(ValueError, match="verify must be one of"):
        rejection_sample(torch.tensor([1]), None, torch.ones(2, 4) / 4, verify="tree")


# ---- block verification, exactly ------------------------------------------------------------------------------


class _RandomModels:
    """A target and a drafter over a 3-token vocabulary with a random next-token distribution for every prefix
    (float64). parallel: each draft's distribution depends only on its position in the block, as a block-parallel
    drafter's does; otherwise on the whole prefix, as a chained drafter's (or a later pass's) does."""

    def __init__(self, seed: int, parallel: bool):
        self.generator, self.parallel, self.tables = torch.Generator().manual_seed(seed), parallel, {}

    def _row(self, key) -> torch.Tensor:
        if key not in self.tables:  # peaked rows: drafts are often rejected and corrections matter
            self.tables[key] = torch.softmax(3 * torch.randn(3, generator=self.generator, dtype=torch.float64), 0)
        return self.tables[key]

    def p(self, prefix: tuple) -> torch.Tensor:
        return self._row(("p", prefix))

    def q(self, state: tuple, drafted: tuple) -> torch.Tensor:
        return self._row(("q", state, len(drafted)) if self.parallel else ("q", state + drafted))


def _round_outcomes(models, state: tuple, drafts: tuple):
    """[(probability, emitted tokens)] of one block-verified round, from the package's stop probabilities and
    correction distributions; a round accepts j drafts when stop j fires and no later one does."""
    n = len(drafts)
    q = torch.stack([models.q(state, drafts[:i]) for i in range(n)])
    p = torch.stack([models.p(state + drafts[:i]) for i in range(n + 1)])
    stop, weights = block_acceptance(torch.tensor(drafts), q, p)
    outcomes = []
    for j in range(n + 1):
        chance = (stop[j - 1] if j else 1.0) * (1 - stop[j:]).prod()
        correction = correction_distribution(torch.tensor(j), weights, q, p)
        outcomes += [(chance * correction[t], drafts[:j] + (t,)) for t in range(3)]
    return outcomes


def _largest_error(models, drafts_per_round: int, length: int, verified=len) -> float:
    """The largest difference, over every sequence of `length` tokens, between its exact probability under rounds of
    `drafts_per_round` block-verified drafts (of which the first `verified(drafts)` are verified) and the target's."""
    memo = {}

    def generated(state: tuple) -> dict:  # distribution of the first `length` tokens generated after `state`
        if len(state) >= length:
            return {state[:length]: 1.0}
        if state not in memo:
            out = {}
            for drafts in itertools.product(range(3), repeat=drafts_per_round):
                drawn = math.prod(float(models.q(state, drafts[:i])[drafts[i]]) for i in range(drafts_per_round))
                for chance, emitted in _round_outcomes(models, state, drafts[: verified(drafts)]):
                    for sequence, rest in generated(state + emitted).items():
                        out[sequence] = out.get(sequence, 0.0) + drawn * float(chance) * rest
            memo[state] = out
        return memo[state]

    result = generated(())
    return max(
        abs(result.get(s, 0.0) - math.prod(float(models.p(s[:i])[s[i]]) for i in range(length)))
        for s in itertools.product(range(3), repeat=length)
    )


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-drafts", "chained-drafts"])
def test_block_verification_generates_the_target_distribution_exactly(parallel):
    """Every sequence of 4 tokens that rounds of 3 block-verified drafts can produce, with its exact probability,
    equals the target's own probability of it (to rounding). In expectation a round also emits more tokens than
    token-by-token verification of the same drafts, computed independently: sum over k of
    E[prod_{i <= k} min(1, p_i / q_i)]."""
    models, drafts_per_round, length = _RandomModels(seed=7, parallel=parallel), 3, 4
    assert _largest_error(models, drafts_per_round, length) < 1e-12

    block = token = 0.0
    for drafts in itertools.product(range(3), repeat=drafts_per_round):
        drawn = math.prod(float(models.q((), drafts[:i])[drafts[i]]) for i in range(drafts_per_round))
        block += drawn * sum(float(c) * len(e) for c, e in _round_outcomes(models, (), drafts))
        alive = 1.0
        for i in range(drafts_per_round):
            alive *= min(1.0, float(models.p(drafts[:i])[drafts[i]] / models.q((), drafts[:i])[drafts[i]]))
            token += drawn * alive
    token += 1  # the correction or bonus token
    print(f"\ntokens per round: block {block:.4f}, token by token {token:.4f}")
    assert block > token + 1e-3


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-drafts", "chained-drafts"])
def test_verifying_as_many_drafts_as_a_stopping_time_says_keeps_the_distribution_exact(parallel):
    """A round may verify fewer drafts than it drew (`flashdraft.speculative.verify_length`): when the decision to
    verify draft i reads only the drafts before it, every 4-token sequence keeps the target's exact probability;
    a rule that looks at draft i itself is not exact, and this enumeration sees it."""
    models = _RandomModels(seed=7, parallel=parallel)

    def stop_after_a_0(drafts):  # verify draft i unless draft i - 1 is token 0: a stopping time
        return next((i for i in range(1, len(drafts)) if drafts[i - 1] == 0), len(drafts))

    def stop_before_a_0(drafts):  # verify draft i unless it is token 0 itself: it peeks
        return next((i for i in range(1, len(drafts)) if drafts[i] == 0), len(drafts))

    assert _largest_error(models, 3, 4, stop_after_a_0) < 1e-12
    assert _largest_error(models, 3, 4, stop_before_a_0) > 1e-2


# ---- block 16, many rounds -------------------------------------------------------------------------------------

VOCAB6, BLOCK16, ROUNDS = 6, 16, 4000
ALPHA = 1e-3  # false-alarm rate of each chi-square check below (the seeds are fixed: a pass or a fail is repeatable)


def _markov_target_and_drafter(seed: int = 0, mix: float = 0.35):
    """A target whose next-token distribution is a Markov chain P[previous token] (each token forbids its
    successor, which the drafter still proposes), and a drafter whose draft i follows Q[i][previous draft]:
    P mixed with a random chain, a different one per block position, so acceptance is high but not certain."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(VOCAB6, VOCAB6, generator=g, dtype=torch.float64) ** 2
    p[torch.arange(VOCAB6), (torch.arange(VOCAB6) + 1) % VOCAB6] = 0
    p /= p.sum(-1, keepdim=True)
    noise = torch.rand(BLOCK16 - 1, VOCAB6, VOCAB6, generator=g, dtype=torch.float64) ** 2
    q = (1 - mix) * p + mix * noise / noise.sum(-1, keepdim=True)
    return p, q


def _speculate(p, q, sampler, rounds: int = ROUNDS, seed: int = 1):
    """`rounds` consecutive speculative rounds of block 16 (each starts at the last token emitted), drafts drawn
    from q, verified by `sampler` against the target's rows for the anchor and each draft.

    Returns emitted[k, a, b] (the k-th token of a round was b after a) and lengths[a, j] (a round anchored at a
    accepted j drafts)."""
    g = torch.Generator().manual_seed(seed)
    cumulative = q.cumsum(-1).tolist()
    emitted = torch.zeros(BLOCK16, VOCAB6, VOCAB6)
    lengths = torch.zeros(VOCAB6, BLOCK16)
    positions = torch.arange(BLOCK16 - 1)
    last = 0
    for _ in range(rounds):
        uniforms = torch.rand(BLOCK16 - 1, generator=g, dtype=torch.float64).tolist()
        previous = [last]  # the anchor, then each draft
        for i, u in enumerate(uniforms):
            previous.append(min(bisect.bisect_right(cumulative[i][previous[-1]], u), VOCAB6 - 1))
        rows = torch.tensor(previous)
        accepted, token = sampler(rows[1:], q[positions, rows[:-1]], p[rows], g)
        out = previous[1 : 1 + accepted] + [token]
        for k, b in enumerate(out):
            emitted[k, previous[k], b] += 1
        lengths[last, accepted] += 1
        last = out[-1]
    return emitted, lengths


def _exact_acceptance_lengths(p, q) -> torch.Tensor:
    """[a, j]: probability that a round anchored at a accepts exactly j drafts. Draft i is drawn and accepted
    as token c after b with probability min(p[b, c], q[i][b, c]); `reach` carries P(all so far accepted, last = b)."""
    out = torch.zeros(VOCAB6, BLOCK16, dtype=torch.float64)
    for anchor in range(VOCAB6):
        reach = torch.zeros(VOCAB6, dtype=torch.float64)
        reach[anchor] = 1
        mass = [1.0]
        for i in range(BLOCK16 - 1):
            reach = reach @ torch.minimum(p, q[i])
            mass.append(float(reach.sum()))
        mass.append(0.0)
        out[anchor] = torch.tensor([mass[j] - mass[j + 1] for j in range(BLOCK16)])
    return out


def _token_by_token(drafts, draft_probs, target_probs, g):
    return rejection_sample(drafts, draft_probs, target_probs, g, verify="token")


def _block_verification(drafts, draft_probs, target_probs, g):
    return rejection_sample(drafts, draft_probs, target_probs, g, verify="block")


@pytest.mark.parametrize("sampler", [_token_by_token, _block_verification], ids=["token", "block"])
def test_rejection_sampling_at_block_16_over_many_rounds(sampler):
    """4000 rounds of 15 drafts: each emitted token, at every block position and after every previous token, is
    distributed as the target's row (one chi-square over all 16 x 6 rows); token by token, the number of accepted
    drafts per round is also as computed exactly from min(p, q). Each check has a false-alarm rate of α = 1e-3."""
    p, q = _markov_target_and_drafter()
    emitted, lengths = _speculate(p, q, sampler)
    p_emitted = conditional_chi_square_pvalue(emitted, p.expand(BLOCK16, -1, -1))
    p_lengths = conditional_chi_square_pvalue(lengths, _exact_acceptance_lengths(p, q))
    tokens = int(emitted.sum())
    print(f"\nblock 16: {tokens} tokens; p-values: emitted {p_emitted:.3g}, token-by-token acceptance {p_lengths:.3g}")
    assert p_emitted > ALPHA
    if sampler is _token_by_token:
        assert p_lengths > ALPHA
    else:  # block verification accepts at least as much as token by token, here clearly more
        token_tokens = int(_speculate(p, q, _token_by_token)[0].sum())
        assert p_lengths < ALPHA and tokens > 1.02 * token_tokens, (tokens, token_tokens)
    # Every acceptance length occurred (0 .. 15 drafts), so corrections and the bonus token were all exercised.
    assert (lengths.sum(0) > 0).all() and emitted[BLOCK16 - 1].sum() > 100


def _tempered_draft_probs(drafts, draft_probs, target_probs, g):
    """Reports q^0.7 (renormalised: q at another temperature) as the draft distribution; drafts come from q."""
    tempered = draft_probs**0.7
    return rejection_sample(drafts, tempered / tempered.sum(-1, keepdim=True), target_probs, g)


def _bonus_from_the_previous_row(drafts, draft_probs, target_probs, g):
    """Draws the bonus token after a full block from the last draft's row instead of the row after it."""
    return rejection_sample(drafts, draft_probs, torch.cat([target_probs[:-1], target_probs[-2:-1]]), g)


def _draft_probs_dropped(drafts, draft_probs, target_probs, g):
    """Treats sampled drafts as deterministic: still lossless, but accepts less often than min(1, p/q)."""
    return rejection_sample(drafts, None, target_probs, g, verify="token")


def _block_stops_at_the_first_miss(drafts, draft_probs, target_probs, g):
    """Block verification read as token by token: the drafts accepted up to the first stop that does not fire,
    instead of up to the last one that does."""
    n = drafts.shape[0]
    u = torch.rand(n, generator=g, dtype=target_probs.dtype)
    stop, weights = block_acceptance(drafts, draft_probs, target_probs)
    accepted = (u < stop).to(torch.int64).cumprod(0).sum()
    return int(accepted), int(sample(correction_distribution(accepted, weights, draft_probs, target_probs), g))


@pytest.mark.parametrize(
    "sampler, check",
    [
        (_tempered_draft_probs, "emitted"),
        (_bonus_from_the_previous_row, "emitted"),
        (_draft_probs_dropped, "lengths"),
        (_block_stops_at_the_first_miss, "emitted"),
    ],
    ids=["tempered-q", "bonus-row", "q-dropped", "block-first-miss"],
)
def test_block_16_check_detects_a_biased_sampler(sampler, check):
    """The checks above can fail: deliberately wrong verifications are rejected at the same α and seeds."""
    p, q = _markov_target_and_drafter()
    emitted, lengths = _speculate(p, q, sampler)
    if check == "emitted":
        pvalue = conditional_chi_square_pvalue(emitted, p.expand(BLOCK16, -1, -1))
    else:
        pvalue = conditional_chi_square_pvalue(lengths, _exact_acceptance_lengths(p, q))
    print(f"\n{sampler.__name__}: p-value {pvalue:.3g}")
    assert pvalue < ALPHA, f"{sampler.__name__} went undetected (p-value {pvalue:.3g})"


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
    "dflash-hybrid": ("qwen3_5", 4, 1.0, 1.0, 0, (), "block", "dflash"),
    # the same, verified token by token
    "dflash-hybrid-token": ("qwen3_5", 4, 1.0, 1.0, 0, (), "token", "dflash"),
    # plain target, DFlash with top-k/top-p; max_new_tokens 3: x3 is the bonus token after an accepted x2
    "dflash-plain-filtered": ("qwen3", 3, 0.8, 0.9, 6, (), "block", "dflash"),
    # hybrid target, the block drafted in two passes: x2's draft is drawn given x1's
    "dflash-hybrid-refined": ("qwen3_5", 4, 1.0, 1.0, 0, (1,), "block", "dflash"),
    # hybrid target, DSpark: the anchor's slot drafts x2 (a block of 3 drafts 3), each draft chained on the one
    # before it through the Markov head, in both verification rules
    "dspark-hybrid": ("qwen3_5", 4, 1.0, 1.0, 0, (), "block", "dspark"),
    "dspark-hybrid-token": ("qwen3_5", 4, 1.0, 1.0, 0, (), "token", "dspark"),
    # plain target, DSpark in DFlash's block convention, with top-k/top-p
    "dspark-plain-filtered": ("qwen3", 3, 0.8, 0.9, 6, (), "block", "dspark-dflash-slots"),
    # hybrid target, DFlash2: each draft drawn among its position's 3 candidates (of 8 tokens), given the draft
    # before it through the selector
    "dflash2-hybrid": ("qwen3_5", 4, 1.0, 1.0, 0, (), "block", "dflash2"),
}
DRAFTERS = {
    "dflash": {},
    "dspark": {"family": "dspark"},
    "dspark-dflash-slots": {"family": "dspark", "sample_from_anchor": False},
    "dflash2": {"family": "dflash2"},
}


@pytest.mark.distribution
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_equals_target_distribution(case):
    pvalue, accepted_any, trials = _sample_tokens_2_and_3(*CASES[case])
    print(f"\n{case}: p-value {pvalue:.3g}; runs with an accepted draft: {accepted_any}/{trials}")
    assert pvalue > P_MIN
    assert 0.05 * trials < accepted_any < 0.95 * trials  # both acceptance and rejection were exercised


@pytest.mark.distribution
@pytest.mark.parametrize("verify", ["block", "token"])
def test_dspark_verifying_drafts_by_confidence_keeps_the_target_distribution(verify, monkeypatch):
    """DSpark's rounds cut short by its confidence head (`verify_length=confidence`, under a cost that makes the rule
    cut often) sample the target's distribution, in both verification rules."""
    cut = []
    rule = ConfidenceLength.drafts

    def counted(self, confidence, fed_before):
        n = rule(self, confidence, fed_before)
        cut.append(n < len(confidence))
        return n

    monkeypatch.setattr(ConfidenceLength, "drafts", counted)
    steep = RoundCost(draft_s=0.1, verify_fixed_s=0.0, verify_token_s=1.0)
    monkeypatch.setattr(GENERATE, "_round_cost", lambda *args: steep)
    pvalue, accepted_any, trials = _sample_tokens_2_and_3(
        "qwen3_5", 4, 1.0, 1.0, 0, (), verify, "dspark", verify_length="confidence"
    )
    assert pvalue > P_MIN
    assert 0.1 * len(cut) < sum(cut) < 0.9 * len(cut)  # rounds cut short and rounds verified in full
    assert 0.05 * trials < accepted_any < 0.95 * trials


@pytest.mark.distribution
def test_a_dspark_proposal_read_without_its_markov_bias_is_detected(monkeypatch):
    """The check above can fail: verifying DSpark's chained drafts against the backbone's own distributions (what
    its drafts were not drawn from) gives the wrong output distribution, and the test sees it."""
    from flashdraft.speculative.proposer import DFlashProposer

    walk = DFlashProposer._walk

    def walk_read_without_bias(self, slots, first):
        drafts, _ = walk(self, slots, first)
        backbone = sampling_probs(self.drafter.compute_logits(slots, self.lm_head), *self.sampling)
        return drafts, [row[None] for row in backbone]

    monkeypatch.setattr(DFlashProposer, "_walk", walk_read_without_bias)
    # The bias is gross (p ~1e-32 at 500 trials, seeded): fewer trials than the exactness tests need.
    pvalue, _, _ = _sample_tokens_2_and_3(*CASES["dspark-hybrid-token"], trials=500)
    assert pvalue < P_MIN, f"a wrong proposal distribution went undetected (p-value {pvalue:.3g})"


@pytest.mark.distribution
def test_a_dflash2_proposal_read_over_the_whole_vocabulary_is_detected(monkeypatch):
    """The selector's proposal is supported on its candidates only: verifying its drafts against the same scores
    spread over the whole vocabulary (the backbone's logits off the candidates) gives the wrong output distribution."""
    from flashdraft.speculative.proposer import DFlashProposer

    walk = DFlashProposer._walk

    def walk_read_off_the_candidates(self, slots, first):
        drafts, probs = walk(self, slots, first)
        backbone = self.drafter.compute_logits(slots, self.lm_head)
        rows = []
        for row, q in zip(backbone, probs, strict=True):
            logits = torch.where(q[0] > 0, torch.log(q[0]), row)  # the candidates' scores kept, the rest unmasked
            rows.append(sampling_probs(logits, *self.sampling)[None])
        return drafts, rows

    monkeypatch.setattr(DFlashProposer, "_walk", walk_read_off_the_candidates)
    # The cheaper target; tokens off the candidates come out at once (p = 0 at 500 trials, seeded).
    pvalue, _, _ = _sample_tokens_2_and_3("qwen3", 4, 1.0, 1.0, 0, (), "token", "dflash2", trials=500)
    assert pvalue < P_MIN, f"a wrong proposal distribution went undetected (p-value {pvalue:.3g})"


def _sample_tokens_2_and_3(
    family,
    max_new,
    temperature,
    top_p,
    top_k,
    refine,
    verify,
    drafter="dflash",
    device="cpu",
    engine=False,
    verify_length="full",
    trials=1500,
):
    """(chi-square p-value of the sampled (x2, x3) against the target's exact joint, runs with an accepted draft,
    trials) of speculative sampling with a random drafter; `engine`: through flashdraft's engine on `device`."""
    # float32 and transformers' own torch delta rule: sampling exactness does not need float64.
    target = tiny_target(family, num_layers=4, vocab_size=VOCAB8, seed=3, dtype=torch.float32).to(device)
    with torch.no_grad():  # peaked distributions, so that drafts are often rejected and corrections matter
        target.get_output_embeddings().weight.mul_(30)
    drafter = random_drafter(target, block_size=3, seed=4, **DRAFTERS[drafter]).to(device)
    g = torch.Generator(device=device).manual_seed(5)
    counts = torch.zeros(VOCAB8, VOCAB8)
    accepted_any = 0
    with ready(target):
        expected = _exact_joint_of_tokens_2_and_3(target, temperature, top_p, top_k).cpu()
        for _ in range(trials):
            r = generate(
                target,
                drafter,
                PROMPT.to(device),
                max_new,
                temperature,
                top_p,
                top_k,
                block_size=3,
                generator=g,
                refine=refine,
                verify=verify,
                engine=engine,
                verify_length=verify_length,
            )
            counts[r.tokens[1], r.tokens[2]] += 1
            accepted_any += any(a > 1 for a in r.acceptance_lengths)
    return chi_square_pvalue(counts, expected), accepted_any, trials
