"""What a step measures besides the loss: τ from per-position accuracy, and counts that add up across steps."""

import torch

from flashdraft.train.loss import LossStats, expected_accepted, simulated_tau
from flashdraft.train.loss.stats import block_stats


def test_tau_definitions():
    assert expected_accepted(torch.tensor([0.5, 0.5])).item() == 0.75
    assert simulated_tau(torch.tensor([0.5, 0.5])).item() == 1.75
    assert simulated_tau(torch.ones(15)).item() == 16.0  # bs 16, all accepted: 15 drafted + the bonus token
    assert simulated_tau(torch.zeros(15)).item() == 1.0


def stats(correct, valid, accepted, blocks):
    return LossStats(
        loss_sum=torch.tensor(1.0),
        weight_sum=torch.tensor(2.0),
        correct=torch.tensor(correct),
        valid=torch.tensor(valid),
        accepted=torch.tensor(accepted),
        blocks=torch.tensor(blocks),
    )


def test_stats_add_up_and_give_accuracy_and_tau():
    total = stats([0, 3, 1], [0, 4, 4], 3, 4) + stats([0, 1, 1], [0, 4, 0], 1, 4)
    assert total.correct.tolist() == [0, 4, 2] and total.valid.tolist() == [0, 8, 4]
    assert total.loss_sum.item() == 2.0 and total.weight_sum.item() == 4.0
    assert total.accuracy().tolist() == [0.5, 0.5]
    assert total.tau().item() == 1.75  # 1 + 0.5 + 0.5 * 0.5
    assert total.block_tau().item() == 1.5  # 1 + 4 accepted / 8 blocks
    assert stats([0, 0], [0, 0], 0, 0).accuracy().tolist() == [0.0]  # nothing labelled: 0, not NaN


def test_block_stats_count_the_blocks_drafted_from_mask_alone():
    """Block 0: hits at 1, 2, miss at 3. Block 1 revealed its first label (position 1 unlabelled): its hits are
    conditioned on a true token, so it is not counted. Block 2: a miss at 1."""
    labelled = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    hits = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    s = block_stats(hits, labelled, torch.tensor(3.0), torch.tensor(2.0), 4)
    assert s.valid.tolist() == [0, 2, 2, 1] and s.correct.tolist() == [0, 1, 2, 0]
    assert s.accepted.item() == 2 and s.blocks.item() == 2
    assert s.loss_sum.item() == 3.0 and s.weight_sum.item() == 2.0
