"""Anchors and packed blocks: the anchor rule, seeded draws, labels and weights lined up with positions, and the
target features lined up with the same positions."""

import math

import pytest
import torch

from flashdraft.train.blocks import (
    IGNORE_INDEX,
    PAD_ANCHOR,
    anchor_candidates,
    anchor_generator,
    before_labels,
    build_blocks,
    gamma_for,
    sample_anchors,
    sample_reveals,
)
from tests.train import tiny_recipe
from tests.train.tiny_recipe import BS, M

# ---- anchors -----------------------------------------------------------------------------------------------------


def test_gamma_for():
    assert (gamma_for(16), gamma_for(10), gamma_for(8)) == (7.0, 5.0, 4.0)
    assert gamma_for(12) == pytest.approx(5 + 2 / 3) and gamma_for(32) == pytest.approx(7 + 16 / 3)
    assert (gamma_for(4), gamma_for(2)) == (2.0, 1.0)


def test_sample_anchors_rule():
    # Anchor p: response token, next token a response token too, p >= 1, p + bs - 1 <= T - 1 (T = 12 → p <= 8).
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    assert sample_anchors(mask, 10, BS).tolist() == [2, 3, 6, 7, 8]
    few = sample_anchors(mask, 3, BS, anchor_generator(0, 0, 0))
    assert len(few) == 3 and set(few.tolist()) <= {2, 3, 6, 7, 8} and few.tolist() == sorted(set(few.tolist()))
    assert sample_anchors(mask, 0, BS).numel() == 0
    assert sample_anchors(torch.zeros(12), 4, BS).numel() == 0
    assert sample_anchors(torch.ones(3), 4, BS).numel() == 0  # no room for a block
    assert sample_anchors(torch.ones(5), 4, BS).tolist() == [1]
    assert sample_anchors(mask, 4, BS).dtype == torch.long


def test_stratified_anchors_one_per_run():
    mask = torch.tensor([0] * 5 + [1] * 95 + [0] * 30 + [1] * 70)  # candidates 5..98 and 130..184 (T = 200, bs 16)
    candidates = [p for p in range(1, 200 - BS + 1) if mask[p] and mask[p + 1]]
    runs = 8
    seen = set()
    for index in range(50):
        got = sample_anchors(mask, runs, BS, anchor_generator(0, 0, index), how="stratified").tolist()
        assert got == sorted(got) and len(set(got)) == runs
        for a, position in enumerate(got):  # exactly one in each run of equal length (±1) of the candidates
            run = candidates[a * len(candidates) // runs : (a + 1) * len(candidates) // runs]
            assert position in run
        seen.update(got)
    assert len(seen) > len(candidates) // 2, "the draws within each run are not random"
    assert sample_anchors(mask, 1000, BS, how="stratified").tolist() == candidates  # too few: all of them
    with pytest.raises(ValueError, match="anchor sampling 'even'"):
        sample_anchors(mask, 4, BS, how="even")


def test_anchor_generator_per_epoch_and_sample():
    mask = torch.ones(600)
    draw = lambda seed, epoch, index: sample_anchors(mask, 16, 16, anchor_generator(seed, epoch, index)).tolist()
    assert draw(0, 1, 7) == draw(0, 1, 7)
    assert draw(0, 1, 7) != draw(0, 2, 7)
    assert draw(0, 1, 7) != draw(0, 1, 8)
    assert draw(0, 1, 7) != draw(1, 1, 7)


# ---- blocks: labels and weights line up with positions -------------------------------------------------------


def test_build_blocks_hand_made():
    ids = torch.tensor([list(range(10, 20)), list(range(20, 30))])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    anchors = [torch.tensor([3, 6]), torch.tensor([7])]
    batch = build_blocks(ids, loss_mask, anchors, BS, M, gamma=2.0)
    x, e1, e2 = IGNORE_INDEX, math.exp(-1 / 2), math.exp(-2 / 2)

    assert batch.anchors.tolist() == [[3, 6], [7, PAD_ANCHOR]]
    assert batch.block_valid.tolist() == [[True, True], [True, False]]
    assert batch.block_ids.tolist() == [[13, M, M, M, 16, M, M, M], [27, M, M, M, M, M, M, M]]
    assert batch.position_ids[:, :10].tolist() == [list(range(10))] * 2
    assert batch.position_ids[:, 10:].tolist() == [[3, 4, 5, 6, 6, 7, 8, 9], [7, 8, 9, 10, 0, 1, 2, 3]]
    # Row 0, block 1: 18 and 19 are not response tokens. Row 1: position 10 is past the end; then padding.
    assert batch.labels.tolist() == [[x, 14, 15, 16, x, 17, x, x], [x, 28, 29, x, x, x, x, x]]
    torch.testing.assert_close(
        batch.weights,
        torch.tensor([[0, 1, e1, e2, 0, 1, 0, 0], [0, 1, e1, 0, 0, 0, 0, 0]], dtype=torch.float32),
    )
    assert batch.ctx_len == 10
    # Default γ follows the block size; no anchors at all still gives one (padding) block.
    assert build_blocks(ids, loss_mask, [torch.tensor([3]), torch.tensor([3])], 16, M).weights[0, 2].item() == (
        pytest.approx(math.exp(-1 / 7))
    )
    empty = build_blocks(ids, loss_mask, [torch.empty(0, dtype=torch.long)] * 2, BS, M)
    assert empty.anchors.tolist() == [[PAD_ANCHOR]] * 2 and (empty.labels == x).all()
    with pytest.raises(ValueError, match="anchors must lie in"):
        build_blocks(ids, loss_mask, [torch.tensor([10]), torch.tensor([1])], BS, M)


def test_build_blocks_reveals_a_prefix():
    """A block that reveals r shows its first r labels in place of MASK, learns only the positions after them, and
    weighs those as a block starting there; labels past the response are never shown."""
    ids = torch.tensor([list(range(10, 20)), list(range(20, 30))])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    anchors = [torch.tensor([3, 6]), torch.tensor([7])]
    batch = build_blocks(ids, loss_mask, anchors, BS, M, gamma=2.0, reveals=[torch.tensor([2, 3]), torch.tensor([1])])
    x, e1 = IGNORE_INDEX, math.exp(-1 / 2)

    # Row 0, block 1 reveals 3 but only 17 is a response token: 18 and 19 stay hidden (and unlabelled).
    assert batch.block_ids.tolist() == [[13, 14, 15, M, 16, 17, M, M], [27, 28, M, M, M, M, M, M]]
    assert batch.labels.tolist() == [[x, x, x, 16, x, x, x, x], [x, x, 29, x, x, x, x, x]]
    torch.testing.assert_close(
        batch.weights, torch.tensor([[0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    )
    # Revealing 0 is the plain block, weights included.
    plain = build_blocks(ids, loss_mask, anchors, BS, M, gamma=2.0)
    zero = [torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long)]
    zero = build_blocks(ids, loss_mask, anchors, BS, M, gamma=2.0, reveals=zero)
    for name in ("block_ids", "labels", "weights", "position_ids"):
        assert torch.equal(getattr(zero, name), getattr(plain, name)), name
    # With one more block on the first row: weights count from the first hidden position.
    wide = build_blocks(
        ids[:1], torch.ones(1, 10, dtype=torch.long), [torch.tensor([1])], 8, M, 2.0, None, [torch.tensor([2])]
    )
    assert wide.labels.tolist() == [[x, x, x, 14, 15, 16, 17, 18]]
    torch.testing.assert_close(wide.weights[0, 3:5], torch.tensor([1.0, e1]))
    with pytest.raises(ValueError, match="one count per anchor"):
        build_blocks(ids, loss_mask, anchors, BS, M, reveals=[torch.tensor([1]), torch.tensor([1])])


def test_build_blocks_whose_anchor_slot_drafts():
    """Offset 1 (DSpark's convention): slot k learns the token at p + k + 1, the anchor's slot included, weighted
    exp(-k / γ); the token before each label is the slot's own input; the default γ counts the drafts."""
    ids = torch.tensor([list(range(10, 20)), list(range(20, 30))])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    anchors = [torch.tensor([3, 5]), torch.tensor([6])]
    batch = build_blocks(ids, loss_mask, anchors, BS, M, gamma=2.0, offset=1)
    x, e1, e2, e3 = IGNORE_INDEX, math.exp(-1 / 2), math.exp(-2 / 2), math.exp(-3 / 2)

    assert batch.block_ids.tolist() == [[13, M, M, M, 15, M, M, M], [26, M, M, M, M, M, M, M]]
    # Row 0: block 0 learns 14..17, block 1 learns 16 and 17 (18, 19 are not response). Row 1: 10 is past the end.
    assert batch.labels.tolist() == [[14, 15, 16, 17, 16, 17, x, x], [27, 28, 29, x, x, x, x, x]]
    torch.testing.assert_close(
        batch.weights,
        torch.tensor([[1, e1, e2, e3, 1, e1, 0, 0], [1, e1, e2, 0, 0, 0, 0, 0]], dtype=torch.float32),
    )
    assert batch.label_positions[0, :4].tolist() == [4, 5, 6, 7]
    before = before_labels(ids, batch)
    assert before[0, :4].tolist() == [13, 14, 15, 16] and before[1, :3].tolist() == [26, 27, 28]
    # Anchors leave room for the last label: with offset 1 the last anchor of a 10-token response is 10 - bs - 1.
    assert anchor_candidates(torch.ones(10), BS, offset=1).tolist() == [1, 2, 3, 4, 5]
    assert anchor_candidates(torch.ones(10), BS).tolist() == [1, 2, 3, 4, 5, 6]
    # The decay of 16 drafts: DFlash's for a block of 17.
    default = build_blocks(ids, loss_mask, [torch.tensor([3]), torch.tensor([3])], 16, M, offset=1)
    assert default.weights[0, 1].item() == pytest.approx(math.exp(-1 / gamma_for(17)))
    # Revealing r shows p + 1 … p + r in slots 1 … r: those tokens are no slot's label any more.
    shown = build_blocks(
        ids, loss_mask, anchors, BS, M, gamma=2.0, reveals=[torch.tensor([2, 0]), torch.tensor([0])], offset=1
    )
    assert shown.block_ids[0, :4].tolist() == [13, 14, 15, M]
    assert shown.labels[0, :4].tolist() == [x, x, 16, 17]
    torch.testing.assert_close(shown.weights[0, :4], torch.tensor([0, 0, 1, e1]))


def test_sample_reveals():
    g = torch.Generator().manual_seed(0)
    assert sample_reveals(50, 16, 0.0, g).tolist() == [0] * 50
    assert sample_reveals(50, 2, 0.5, g).tolist() == [0] * 50  # nothing to reveal: one drafted position
    drawn = sample_reveals(4000, 16, 0.3, g)
    shown = drawn[drawn > 0]
    assert 0.3 * 4000 - 150 < shown.numel() < 0.3 * 4000 + 150  # ~5 standard deviations
    assert set(shown.tolist()) == set(range(1, 15))  # 1 … bs − 2: one position always stays hidden
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        sample_reveals(4, 16, 1.0, g)


# ---- the context side: feature i belongs to token i ----------------------------------------------------------


@pytest.fixture(scope="module", params=tiny_recipe.FAMILIES)
def setup(request):
    return tiny_recipe.build(request.param)


def test_features_come_from_the_same_position(setup):
    target, _, ids, _, features = setup
    i = 11
    prefix = target.capture(ids[:1, : i + 1])
    torch.testing.assert_close(prefix[0, i], features[0, i], rtol=1e-6, atol=1e-6)
    # Same batch shape and kernels as the reference below, so "unchanged" can be exact.
    single = target.capture(ids[:1])
    nxt = ids[:1].clone()
    nxt[0, i + 1] = (nxt[0, i + 1] + 1) % 256
    assert torch.equal(target.capture(nxt)[0, : i + 1], single[0, : i + 1])  # causal: i + 1 never leaks back
    cur = ids[:1].clone()
    cur[0, i] = (cur[0, i] + 1) % 256
    assert not torch.isclose(target.capture(cur)[0, i], single[0, i]).all()  # token i itself is in feature i
