"""The training data loader: its order, its blocks, static shapes, and the state a resumed run reads on from."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashdraft.config import load_config
from flashdraft.distributed.ranks import World
from flashdraft.train import dataloader
from flashdraft.train.dataloader import DataLoader, collate, pad_positions

CPU = torch.device("cpu")
DRAFTER = SimpleNamespace(
    block_size=8, mask_token_id=999, draft_offset=0
)  # a DFlash drafter: the anchor slot drafts nothing


class _Data:
    """`count` sequences of ragged lengths (60-99 tokens), the first 10 of each a prompt (no loss), seeded."""

    def __init__(self, count: int) -> None:
        rng = np.random.default_rng(0)
        self.rows = [rng.integers(0, 900, int(n)) for n in rng.integers(60, 100, count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        mask = np.ones(len(self.rows[i]), dtype=np.uint8)
        mask[:10] = 0
        return self.rows[i], mask

    def epoch_order(self, epoch: int, seed: int) -> list[int]:
        return np.random.default_rng([seed, epoch]).permutation(len(self.rows)).tolist()


def _loader(*extra, count=12):
    cfg = load_config(None, ["train.batch_size=2", "train.grad_accum=2", "recipe.num_anchors=5", *extra])
    return DataLoader.from_config(cfg, _Data(count), DRAFTER, CPU)


def _same(a, b) -> bool:
    """Two steps' micro-batches hold the same tensors."""
    return len(a) == len(b) and all(
        x.indices == y.indices
        and torch.equal(x.input_ids, y.input_ids)
        and torch.equal(x.blocks.block_ids, y.blocks.block_ids)
        and torch.equal(x.blocks.labels, y.blocks.labels)
        and torch.equal(x.blocks.position_ids, y.blocks.position_ids)
        for x, y in zip(a, b, strict=True)
    )


def test_each_step_reads_its_share_of_an_epoch_in_order():
    loader = _loader()
    assert loader.steps_per_epoch == 3 and loader.per_step == 4
    epoch = [[i for micro in next(loader) for i in micro.indices] for _ in range(3)]
    assert sum(epoch, []) == _Data(12).epoch_order(0, 0)  # every sample once, in the epoch's order
    assert all(len(micro.indices) == 2 for micro in loader.batch(0))  # train.batch_size per micro-batch
    assert [i for micro in next(loader) for i in micro.indices] == _Data(12).epoch_order(1, 0)[:4]
    assert loader.step == 4


def test_a_micro_batch_is_collated_and_its_tokens_counted():
    loader = _loader()
    (micro, _) = loader.batch(0)
    lengths = [len(_Data(12).rows[i]) for i in micro.indices]
    assert micro.input_ids.shape == (2, max(lengths)) and micro.tokens == sum(lengths)
    assert micro.attention_mask.sum(1).tolist() == lengths
    assert micro.blocks.anchors.shape == (2, 5) and micro.width is None  # eager: no static shapes on the CPU


def test_a_restored_loader_reads_what_the_uninterrupted_one_reads():
    """The state saved in a checkpoint, loaded into a new loader (as a resumed run builds it), goes on with the same
    micro-batches, anchors and blocks, across an epoch's end."""
    uninterrupted, first = _loader(), _loader()
    for _ in range(2):
        next(uninterrupted), next(first)
    state = first.state_dict()
    assert state == {"step": 2, "seed": 0, "sequences_per_step": 4, "samples": 12}
    resumed = _loader()
    resumed.load_state_dict(state)
    for _ in range(3):
        assert _same(next(resumed), next(uninterrupted))
    assert _same(resumed.batch(1), _loader().batch(1))  # a step's batch is a function of the step alone


def test_anchors_differ_between_epochs():
    loader = _loader()
    a = loader.batch(0)[0]
    sample = a.indices[0]
    again = next(m for step in range(3, 6) for m in loader.batch(step) if sample in m.indices)  # epoch 1
    row_a, row_b = a.indices.index(sample), again.indices.index(sample)
    assert not torch.equal(a.blocks.anchors[row_a], again.blocks.anchors[row_b])


def test_restoring_another_runs_order_warns(caplog):
    state = _loader().state_dict() | {"sequences_per_step": 8, "step": 5}
    loader = _loader()
    with caplog.at_level(logging.WARNING, logger="flashdraft.train.dataloader"):
        loader.load_state_dict(state)
    assert loader.step == 5
    assert "sequences_per_step 8 then, 4 now" in caplog.text


def test_revealing_blocks_keeps_the_anchors():
    """recipe.reveal draws after the anchors: the same anchors with and without it, some blocks revealed, and the
    same draw again for the same (seed, epoch, sample)."""

    def blocks(*extra):
        return _loader("recipe.num_anchors=16", *extra).micro_batch([3, 4], epoch=1).blocks

    plain, shown = blocks(), blocks("recipe.reveal=0.5")
    assert torch.equal(plain.anchors, shown.anchors)
    revealed = (shown.block_ids.view(2, 16, 8) != 999).sum(-1) - 1  # the anchor's token is always shown
    assert 0 < int((revealed > 0).sum()) < 32 and int((plain.block_ids.view(2, 16, 8) != 999).sum()) == 32
    assert torch.equal(blocks("recipe.reveal=0.5").block_ids, shown.block_ids)


def test_static_shapes_pad_every_micro_batch_to_one_shape():
    loader = _loader("train.static_shapes=true", "data.max_length=120")
    for micro in loader.batch(0) + loader.batch(1):
        assert micro.width == 120 and micro.blocks.position_ids.shape == (2, 120 + 5 * 8)
        features = torch.ones(2, micro.input_ids.shape[1], 3)
        padded = micro.pad(features)
        assert padded.shape == (2, 120, 3) and padded[:, micro.input_ids.shape[1] :].eq(0).all()
    with pytest.raises(ValueError, match="longer than data.max_length = 50"):
        pad_positions(torch.ones(1, 60), 50)


def test_each_rank_reads_its_part_of_the_global_step(monkeypatch):
    """Rank r of 2 takes the r-th half of a step's micro-batches: the global step is one process's."""
    one = _loader().batch(0)
    for rank in (0, 1):
        monkeypatch.setattr(dataloader, "world", lambda rank=rank: World(rank, 2))
        monkeypatch.setattr("flashdraft.distributed.data_parallel.world", lambda rank=rank: World(rank, 2))
        cfg = load_config(None, ["train.batch_size=2", "train.grad_accum=1", "recipe.num_anchors=5"])
        mine = DataLoader.from_config(cfg, _Data(12), DRAFTER, CPU).batch(0)
        assert _same(mine, one[rank : rank + 1])


def test_collate_pads_on_the_right():
    ids, mask, attn = collate([(np.array([5, 6, 7]), np.array([0, 1, 1])), (np.array([8]), np.array([1]))])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[False, True, True], [True, False, False]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_too_few_samples_for_one_step_is_an_error():
    with pytest.raises(ValueError, match="3 samples, fewer than one step needs"):
        _loader(count=3)
