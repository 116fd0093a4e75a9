"""The chunked DFlash2 loss against its full-logit reference in float64: the loss, every statistic and the gradient of
every input (hidden states, both codebooks, the hidden projection), with labels inside and outside the candidates."""

import pytest
import torch

from flashdraft.drafter.selector import CandidateSelector
from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.dflash2 import DFlash2Weights, dflash2_loss
from flashdraft.train.loss.objective import Objective
from flashdraft.train.loss.reference import reference_dflash2_loss


def random_inputs(seed=0, bs=5, blocks=3, vocab=23, width=6, rank=3, top_k=4):
    g = torch.Generator().manual_seed(seed)
    q = blocks * bs
    hidden = torch.randn(2, q, width, generator=g, dtype=torch.float64)
    teacher = torch.randn(2, q, width, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64)
    selector = CandidateSelector(vocab, width, rank, top_k).double()
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    labels = torch.randint(0, vocab, (2, q), generator=g)
    # Some labels at the backbone's argmax (inside the candidates), the rest random (often outside them).
    argmax = (hidden @ weight.t()).argmax(-1)
    labels = torch.where(torch.rand(2, q, generator=g) < 0.5, argmax, labels)
    prev = torch.randint(0, vocab, (2, q), generator=g)
    labels[:, ::bs] = IGNORE_INDEX
    labels[1, -2:] = IGNORE_INDEX
    weights = torch.rand(2, q, generator=g, dtype=torch.float64) * (labels != IGNORE_INDEX)
    return hidden.requires_grad_(), weight, teacher, labels, weights, prev, selector


CASES = [
    pytest.param(dict(), id="drop"),
    pytest.param(dict(loss_weights=DFlash2Weights(absent="inject")), id="inject"),
    pytest.param(dict(loss_weights=DFlash2Weights(base=0.3, selector=2.0)), id="other-weights"),
    pytest.param(dict(loss_weights=DFlash2Weights(base=0.0, selector=1.0, absent="inject")), id="selector-only"),
    pytest.param(dict(teacher=True), id="target-labels"),
    pytest.param(dict(objective=Objective(weighting="dpace", dpace_alpha=0.3)), id="dpace"),
    pytest.param(dict(denominator=7.5), id="step-denominator"),
]


@pytest.mark.parametrize("shape", [(5, 3, 23, 6, 3, 4), (3, 4, 9, 2, 1, 9)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_chunked_loss_equals_the_reference(shape, case, chunk_size):
    bs, blocks, vocab, width, rank, top_k = shape
    results = []
    for fn, extra in ((dflash2_loss, dict(chunk_size=chunk_size, compile_chunks=False)), (reference_dflash2_loss, {})):
        hidden, weight, teacher, labels, weights, prev, selector = random_inputs(
            bs=bs, blocks=blocks, vocab=vocab, width=width, rank=rank, top_k=top_k
        )
        loss, stats = fn(
            hidden,
            weight,
            labels,
            weights,
            prev,
            selector,
            block_size=bs,
            teacher_hidden=teacher if case.get("teacher") else None,
            **{k: v for k, v in case.items() if k != "teacher"},
            **extra,
        )
        loss.backward()
        results.append((loss, stats, [hidden.grad, *(p.grad for p in selector.parameters())]))
    (loss, stats, grads), (ref_loss, ref_stats, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for name in ("loss_sum", "weight_sum", "correct", "valid", "accepted", "blocks"):
        torch.testing.assert_close(getattr(stats, name).double(), getattr(ref_stats, name).double(), rtol=1e-10, atol=0)
    assert stats.valid[1:].sum() > 0 and stats.correct.sum() > 0  # the statistics count something
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert grads[2].abs().sum() > 0  # the successor codebook learns


def test_a_label_outside_the_candidates_adds_nothing_when_dropped_and_is_learned_when_injected():
    hidden, weight, _, labels, weights, prev, selector = random_inputs(vocab=40, top_k=2)
    top = (hidden @ weight.t()).topk(2).indices
    absent = (labels != IGNORE_INDEX) & ~(top == labels[..., None]).any(-1)
    assert absent.any() and ((labels != IGNORE_INDEX) & ~absent).any()
    only_absent = torch.where(absent, weights, 0.0)
    selector_only = dict(block_size=5, denominator=1.0)
    dropped, _ = dflash2_loss(
        hidden, weight, labels, only_absent, prev, selector, loss_weights=DFlash2Weights(base=0.0), **selector_only
    )
    assert dropped.item() == 0
    injected, _ = dflash2_loss(
        hidden,
        weight,
        labels,
        only_absent,
        prev,
        selector,
        loss_weights=DFlash2Weights(base=0.0, absent="inject"),
        **selector_only,
    )
    assert injected.item() > 0
