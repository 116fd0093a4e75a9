"""The objectives' pieces against their definitions worked out by hand: D-PACE weights on blocks with known
confidences (uniform, decaying, with a gap), the LK token loss in Python floats through the reference, the
normalisers, and the values `Objective` refuses."""

import math

import pytest
import torch

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss import Objective
from flashdraft.train.loss.objective import dpace_weights
from flashdraft.train.loss.reference import reference_loss

X = IGNORE_INDEX


def dpace_by_hand(q: list[float], labelled: list[bool], alpha: float) -> list[float]:
    """w_j = Σ_{m >= j} Π_{i <= m} q̃_i over labelled i and m, one block, Python floats."""
    smooth = [(1 - alpha) * c + alpha if keep else 1.0 for c, keep in zip(q, labelled, strict=True)]
    out = []
    for j in range(len(q)):
        if not labelled[j]:
            out.append(0.0)
            continue
        out.append(sum(math.prod(smooth[: m + 1]) for m in range(j, len(q)) if labelled[m]))
    return out


@pytest.mark.parametrize(
    "q, labelled, alpha, expected",
    [
        # Certain drafts: each position weighs the labelled positions from it on (3, 2, 1).
        ([0.0, 1.0, 1.0, 1.0], [False, True, True, True], 0.5, [0.0, 3.0, 2.0, 1.0]),
        # Hopeless drafts, α = 0.5: q̃ = 0.5 everywhere, w = (0.5 + 0.25 + 0.125, 0.25 + 0.125, 0.125).
        ([0.0, 0.0, 0.0, 0.0], [False, True, True, True], 0.5, [0.0, 0.875, 0.375, 0.125]),
        # α = 1 ignores the confidences.
        ([0.0, 0.2, 0.9, 0.4], [False, True, True, True], 1.0, [0.0, 3.0, 2.0, 1.0]),
    ],
)
def test_dpace_weights_known_blocks(q, labelled, alpha, expected):
    got = dpace_weights(torch.tensor([q], dtype=torch.float64), torch.tensor([labelled]), 4, alpha)
    assert got[0].tolist() == pytest.approx(expected, rel=1e-12, abs=0)


def test_dpace_weights_random_blocks_with_gaps_match_the_definition():
    g = torch.Generator().manual_seed(3)
    bs, blocks = 6, 5
    q = torch.rand(2, blocks * bs, generator=g, dtype=torch.float64)
    labelled = torch.rand(2, blocks * bs, generator=g) < 0.7
    labelled[:, ::bs] = False
    got = dpace_weights(q, labelled, bs, 0.35)
    for b in range(2):
        for a in range(blocks):
            cut = slice(a * bs, (a + 1) * bs)
            want = dpace_by_hand(q[b, cut].tolist(), labelled[b, cut].tolist(), 0.35)
            assert got[b, cut].tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert not got.requires_grad


def test_lk_token_loss_and_dpace_in_the_reference_by_hand():
    # One block of 3: k = 0 unlabelled; two labelled rows with hand-made logits.
    hidden = torch.tensor([[[0.0, 0.0], [1.0, 2.0], [-0.3, 0.7]]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([[X, 2, 0]])
    weights = torch.tensor([[0.0, 1.0, 0.5]], dtype=torch.float64)
    rows = [([1.0, 2.0, 3.0], 2), ([-0.3, 0.7, 0.4], 0)]
    q = [math.exp(z[y]) / sum(math.exp(v) for v in z) for z, y in rows]
    ce = [-math.log(p) for p in q]
    eta = 2.0
    lam = [math.exp(-eta * p) for p in q]
    lk = [la * c + (1 - la) * (1 - p) for la, c, p in zip(lam, ce, q, strict=True)]

    loss, stats = reference_loss(hidden, weight, labels, weights, block_size=3, objective=Objective("lk", eta))
    assert loss.item() == pytest.approx((1.0 * lk[0] + 0.5 * lk[1]) / 1.5, rel=1e-12)

    w = dpace_by_hand([0.0, *q], [False, True, True], 0.5)[1:]
    loss, stats = reference_loss(hidden, weight, labels, weights, block_size=3, objective=Objective(weighting="dpace"))
    # One labelled block: the D-PACE loss is Σ w·CE, divided by 1 block.
    assert stats.weight_sum.item() == 1.0
    assert loss.item() == pytest.approx(w[0] * ce[0] + w[1] * ce[1], rel=1e-12)


def test_lk_gradient_scales_cross_entropy_gradient():
    # For a one-hot target, d LK / d logits = (λ + (1 − λ) q) · (softmax − onehot), λ held constant.
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    hidden = logits.detach()[None].clone().requires_grad_()
    head = torch.eye(4, dtype=torch.float64)
    labels, weights = torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.float64)
    loss, _ = reference_loss(hidden, head, labels, weights, block_size=1, objective=Objective("lk", 3.0))
    (grad,) = torch.autograd.grad(loss, hidden)
    p = logits.detach().softmax(-1)[0]
    q = float(p[1])
    lam = math.exp(-3.0 * q)
    expected = (lam + (1 - lam) * q) * (p - torch.nn.functional.one_hot(torch.tensor(1), 4))
    torch.testing.assert_close(grad[0, 0], expected, rtol=1e-12, atol=1e-15)


def test_normalisers():
    labels = torch.tensor([[X, 5, X, X, X, X, X, 1, 2]])  # block 3: three blocks, the middle one unlabelled
    weights = torch.tensor([[0.0, 0.25, 9.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5]])
    assert Objective().normaliser(labels, weights, 3).item() == pytest.approx(1.75)  # Σ w over labelled only
    assert Objective(weighting="dpace").normaliser(labels, weights, 3).item() == 2.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss="kl"), "loss = 'kl'"),
        (dict(weighting="linear"), "weighting = 'linear'"),
        (dict(lk_eta=-1.0), "lk_eta"),
        (dict(dpace_alpha=0.0), "dpace_alpha"),
        (dict(dpace_alpha=1.5), "dpace_alpha"),
    ],
)
def test_objective_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Objective(**kwargs)
