"""A float64 tiny target, a 2-layer drafter and one packed batch with padding: shared by the tests of the blocks,
the masks and the loss that run the recipe on a real model (mask leaks, feature/position off-by-one, train/serve
mismatch)."""

import torch

from flashdraft.drafter import DFlashDraftModel
from flashdraft.target import FrozenTarget
from flashdraft.target.tiny import random_tiny_model
from flashdraft.train.blocks import build_blocks
from flashdraft.train.masks import dense_block_mask

M = 5  # mask token id of the tiny drafters
BS = 4
FAMILIES = ["qwen3", "qwen3_5"]


def build(family: str):
    """(target, drafter, ids, batch, features): target features of layers 1, 3, 5; the second sequence is padded."""
    target = FrozenTarget.from_model(
        random_tiny_model(family, num_layers=8, dtype=torch.float64), [1, 3, 5], strict=False
    )
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(
        target.config, num_layers=2, block_size=BS, target_layer_ids=target.target_layer_ids, mask_token_id=M
    )
    drafter = drafter.double().eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(6, 256, (2, 23), generator=g)
    loss_mask = torch.ones(2, 23, dtype=torch.long)
    loss_mask[:, :5] = 0
    loss_mask[1, 19:] = 0  # right padding
    attention_mask = torch.ones(2, 23, dtype=torch.long)
    attention_mask[1, 19:] = 0
    batch = build_blocks(ids, loss_mask, [torch.tensor([5, 9, 14, 19]), torch.tensor([6, 12])], BS, M)
    features = target.capture(ids, attention_mask)
    return target, drafter, ids, batch, features


def train_forward(drafter, batch, features, noise, **mask_rule):
    """The drafter as a training step runs it: every block at once under the dense block mask."""
    return drafter(
        position_ids=batch.position_ids,
        attention_mask=dense_block_mask(batch, **mask_rule),
        noise_embedding=noise,
        target_hidden=features,
    )
