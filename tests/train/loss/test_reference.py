"""The plain reference loss against the cross-entropy worked out by hand on a tiny example (so that the fused loss
is compared with something itself checked)."""

import math

import pytest
import torch

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.reference import reference_loss

X = IGNORE_INDEX


def by_hand(hidden, weight, labels, weights):
    """Σ w·(logsumexp(logits) - logit[label]) / Σ w, one row at a time in Python floats."""
    loss_sum = weight_sum = 0.0
    for row, label, w in zip(hidden.tolist(), labels.tolist(), weights.tolist(), strict=True):
        if label == X:
            continue
        logits = [sum(h * v for h, v in zip(row, head_row, strict=True)) for head_row in weight.tolist()]
        lse = math.log(sum(math.exp(z) for z in logits))
        loss_sum += w * (lse - logits[label])
        weight_sum += w
    return loss_sum, weight_sum


def example():
    # One sequence, two blocks of 3; k = 0 unlabelled, and the second block's last position ignored.
    hidden = torch.tensor([[[0.5, -1.0], [1.0, 2.0], [-0.3, 0.7], [0.0, 0.0], [2.0, -1.0], [0.1, 0.2]]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    labels = torch.tensor([[X, 2, 0, X, 0, X]])
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.0, 1.0, 0.0]])
    return hidden.double(), weight.double(), labels, weights.double()


def test_reference_loss_is_the_weighted_cross_entropy():
    hidden, weight, labels, weights = example()
    loss_sum, weight_sum = by_hand(hidden[0], weight, labels[0], weights[0])
    loss, stats = reference_loss(hidden, weight, labels, weights, block_size=3)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(loss_sum / weight_sum, rel=1e-12)
    assert stats.weight_sum.item() == pytest.approx(2.5) and stats.loss_sum.item() == pytest.approx(loss_sum)
    # argmax of the logits: row 1 (1, 2, 3) → 2 = label; row 2 (-0.3, 0.7, 0.4) → 1 != 0; row 4 (2, -1, 1) → 0.
    assert stats.correct.tolist() == [0, 2, 0] and stats.valid.tolist() == [0, 2, 1]
    assert stats.accepted.item() == 2 and stats.blocks.item() == 2
    total, _ = reference_loss(hidden, weight, labels, weights, block_size=3, denominator=10.0)
    assert total.item() == pytest.approx(loss_sum / 10, rel=1e-12)


def test_reference_loss_with_nothing_labelled_is_zero():
    hidden, weight, labels, weights = example()
    hidden.requires_grad_()
    loss, stats = reference_loss(hidden, weight, torch.full_like(labels, X), weights * 0, block_size=3)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert loss.item() == 0 and not grad.any() and stats.blocks.item() == 0
