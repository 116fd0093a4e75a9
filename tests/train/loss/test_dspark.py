"""The chunked DSpark loss against its full-logit reference in float64: the loss, every statistic and the gradient
of every input (hidden states, Markov features, W2, confidence logits), on odd shapes and chunk sizes."""

import pytest
import torch

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.dspark import DSparkWeights, dspark_loss
from flashdraft.train.loss.objective import Objective
from flashdraft.train.loss.reference import reference_dspark_loss


def random_inputs(seed=0, bs=5, blocks=3, vocab=97, width=12, rank=4, offset=1):
    g = torch.Generator().manual_seed(seed)
    q = blocks * bs
    hidden = torch.randn(2, q, width, generator=g, dtype=torch.float64)
    teacher = torch.randn(2, q, width, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64)
    markov = torch.randn(2, q, rank, generator=g, dtype=torch.float64)
    w2 = 0.5 * torch.randn(vocab, rank, generator=g, dtype=torch.float64)
    confidence = torch.randn(2, q, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, q), generator=g)
    # Some labels where the drafter's argmax is, so that hits and accepted runs are not trivially 0.
    argmax = (hidden @ weight.t() + markov @ w2.t()).argmax(-1)
    labels = torch.where(torch.rand(2, q, generator=g) < 0.6, argmax, labels)
    if offset == 0:
        labels[:, ::bs] = IGNORE_INDEX
    labels[1, -2:] = IGNORE_INDEX
    weights = torch.rand(2, q, generator=g, dtype=torch.float64) * (labels != IGNORE_INDEX)
    leaves = [t.requires_grad_() for t in (hidden, markov, w2, confidence)]
    return leaves, weight, teacher, labels, weights


CASES = [
    pytest.param(dict(), id="markov+confidence"),
    pytest.param(dict(markov=False), id="no-markov"),
    pytest.param(dict(confidence=False), id="no-confidence"),
    pytest.param(dict(objective=Objective(weighting="dpace", dpace_alpha=0.3)), id="dpace"),
    pytest.param(dict(loss_weights=DSparkWeights(ce=0.7, distance=0.2, confidence=0.4)), id="other-weights"),
    pytest.param(dict(loss_weights=DSparkWeights(ce=0.0, distance=1.0, confidence=0.0)), id="distance-only"),
    pytest.param(dict(offset=0), id="dflash-convention"),
]


@pytest.mark.parametrize("shape", [(5, 3, 97, 12, 4), (3, 7, 31, 5, 1), (4, 1, 2, 1, 3)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_size", [7, 1024])
def test_chunked_loss_equals_the_reference(shape, case, chunk_size):
    bs, blocks, vocab, width, rank = shape
    offset = case.get("offset", 1)
    objective = case.get("objective", Objective())
    loss_weights = case.get("loss_weights", DSparkWeights())
    results = []
    for fn, extra in ((dspark_loss, dict(chunk_size=chunk_size)), (reference_dspark_loss, {})):
        (hidden, markov, w2, confidence), weight, teacher, labels, weights = random_inputs(
            bs=bs, blocks=blocks, vocab=vocab, width=width, rank=rank, offset=offset
        )
        use_markov = case.get("markov", True)
        loss, stats = fn(
            hidden,
            weight,
            teacher,
            labels,
            weights,
            block_size=bs,
            markov=markov if use_markov else None,
            markov_w2=w2 if use_markov else None,
            confidence_logits=confidence if case.get("confidence", True) else None,
            loss_weights=loss_weights,
            objective=objective,
            offset=offset,
            **extra,
        )
        loss.backward()
        results.append((loss, stats, [t.grad for t in (hidden, markov, w2, confidence)]))
    (loss, stats, grads), (ref_loss, ref_stats, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for name in ("loss_sum", "weight_sum", "correct", "valid", "accepted", "blocks"):
        torch.testing.assert_close(getattr(stats, name).double(), getattr(ref_stats, name).double(), rtol=1e-10, atol=0)
    assert stats.valid[1:].sum() > 0 and stats.correct.sum() > 0  # the statistics count something
    for got, want in zip(grads, ref_grads, strict=True):
        if got is None or want is None:  # an input that one side leaves out of the graph: no gradient on the other
            assert not (got if want is None else want).abs().sum() if (got, want) != (None, None) else True
        else:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_drafter_equal_to_the_target_has_no_distance_and_full_acceptance():
    """q = p: the distance term vanishes and the confidence target is 1 (BCE of a logit against 1 is
    log(1 + e^-c)). (The distance's gradient at q = p is a subgradient that rounding picks: not checked.)"""
    (hidden, _, _, confidence), weight, _, labels, weights = random_inputs(seed=3)
    loss, _ = dspark_loss(
        hidden,
        weight,
        hidden.detach().clone(),
        labels,
        weights,
        block_size=5,
        confidence_logits=confidence,
        loss_weights=DSparkWeights(ce=0.0, distance=1.0, confidence=1.0),
    )
    loss.backward()
    labelled = labels != IGNORE_INDEX
    expected = (weights * torch.nn.functional.softplus(-confidence.detach()))[labelled].sum() / weights.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(confidence.grad, -weights * torch.sigmoid(-confidence.detach()) / weights.sum())


def test_weights_are_checked():
    with pytest.raises(ValueError, match="confidence = -1"):
        DSparkWeights(confidence=-1)
    with pytest.raises(ValueError, match="cross-entropy or a distance"):
        DSparkWeights(ce=0, distance=0)
    (hidden, markov, _, _), weight, teacher, labels, weights = random_inputs()
    with pytest.raises(ValueError, match="both markov"):
        dspark_loss(hidden, weight, teacher, labels, weights, block_size=5, markov=markov)
