"""The training data in the order a run reads it: a stateful data loader (as torchtitan's), the one object that owns
the data order, the collation, the anchors and blocks of every sequence, the padding to static shapes, and its place.

    batches = DataLoader.from_config(cfg, data, drafter, device)
    for step in range(start, total_steps):
        batch = next(batches)              # this rank's micro-batches of the next step: list[MicroBatch]
        ...
    state = batches.state_dict()           # saved in every checkpoint (trainer_state.json, "data")
    batches.load_state_dict(state)         # a resumed run reads on from where the checkpoint's run was
    batches.batch(step)                    # the micro-batches of any step, leaving the place as it is

Each step's samples are a fixed function of (seed, step, rank, world size) and each sample's anchors of (seed,
epoch, sample), so a resumed run reads exactly what an uninterrupted one would have, and 1 process with
grad_accum=2 reads the micro-batches that 2 processes with grad_accum=1 read (flashdraft.distributed.data_parallel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from flashdraft.config import RecipeConfig, RunConfig
from flashdraft.distributed.data_parallel import rank_share
from flashdraft.distributed.ranks import world
from flashdraft.train.blocks import DraftBatch, anchor_generator, build_blocks, sample_anchors, sample_reveals
from flashdraft.train.compile import static_shapes

logger = logging.getLogger(__name__)


class Samples(Protocol):
    """What the loader reads of its data (`TokenizedDataset`; benchmarks pass synthetic sequences)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...  # (token ids, loss mask)

    def epoch_order(self, epoch: int, seed: int) -> list[int]: ...


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: the sequences the target reads and the blocks the drafter drafts."""

    input_ids: torch.Tensor
    """(B, T) right-padded token ids, T the longest sequence's length (the target runs on the real width)."""
    attention_mask: torch.Tensor
    """(B, T) 1 for a token, 0 for padding."""
    blocks: DraftBatch
    """The anchors' blocks, labels and weights (train/blocks.py); padded to static shapes where asked."""
    indices: list[int]
    """The samples' indices in the data (an offline feature store reads their features by them)."""
    tokens: int
    """Sequence tokens, padding not counted."""
    width: int | None = None
    """Static shapes: the positions the drafter sees (data.max_length); None: the micro-batch's own."""

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (B, T, ...) of this micro-batch's sequences (their features) at the drafter's width: right-padded
        with zeros to static shapes; as it is without them."""
        return t if self.width is None else pad_positions(t, self.width)


def sequences_per_step(cfg: RunConfig) -> int:
    """Sequences of one global step: every rank takes train.batch_size x train.grad_accum of them."""
    return cfg.train.batch_size * cfg.train.grad_accum * world().size


def steps_per_epoch(cfg: RunConfig, samples: int) -> int:
    """Whole global steps in one pass over `samples` sequences; a ValueError when not even one fits."""
    per_step = sequences_per_step(cfg)
    if samples < per_step:
        raise ValueError(
            f"data: {samples} samples, fewer than one step needs (train.batch_size x train.grad_accum "
            f"x {world().size} processes = {per_step})"
        )
    return samples // per_step


class DataLoader:
    """This rank's micro-batches of each step, in order, from `data` (see the module docstring). `width`: static
    shapes, every micro-batch's blocks built over `width` positions with `recipe.num_anchors` blocks (None: as
    long as its longest sequence, as many blocks as its most anchors)."""

    def __init__(
        self,
        data: Samples,
        cfg: RunConfig,
        block_size: int,
        mask_token_id: int,
        device: torch.device,
        width: int | None = None,
        offset: int = 0,
    ) -> None:
        self.data, self.device, self.width = data, device, width
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.offset = offset  # what each block slot drafts (`DraftBatch.offset`: the drafter's family says)
        self.recipe: RecipeConfig = cfg.recipe
        self.batch_size, self.seed = cfg.train.batch_size, cfg.train.seed
        self.per_step = sequences_per_step(cfg)
        self.steps_per_epoch = steps_per_epoch(cfg, len(data))
        self.step = 0  # the next step `next` returns
        self._order: tuple[int, list[int]] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, data: Samples, drafter, device: torch.device) -> DataLoader:
        """The loader of a run of `cfg` training `drafter` on `device`: static shapes (data.max_length positions)
        where `train.static_shapes` resolves to them."""
        static = static_shapes(cfg.train.static_shapes, cfg.train.compile, device)
        width = cfg.data.max_length if static else None
        return cls(data, cfg, drafter.block_size, drafter.mask_token_id, device, width, drafter.draft_offset)

    # ---- the place -------------------------------------------------------------------------------------------

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> list[MicroBatch]:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        """Where the loader is, and what its order depends on: plain JSON values."""
        return {"step": self.step, "seed": self.seed, "sequences_per_step": self.per_step, "samples": len(self.data)}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state` (a `state_dict`). Another seed, global batch or data than the state's reads another
        order from here on than the saved run would have: allowed (a resumed run may change them), with a warning."""
        changed = [
            f"{key} {state[key]} then, {value} now"
            for key, value in self.state_dict().items()
            if key != "step" and key in state and state[key] != value
        ]
        if changed:
            logger.warning(
                "resumed data order: %s; the steps from here on read other batches than the saved run would have",
                "; ".join(changed),
            )
        self.step = int(state["step"])

    # ---- one step --------------------------------------------------------------------------------------------

    def batch(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of global step `step`: a fixed function of (seed, step, rank, world size)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        chunk = self._epoch_order(epoch)[offset * self.per_step : (offset + 1) * self.per_step]
        b = self.batch_size
        share = rank_share([chunk[i : i + b] for i in range(0, len(chunk), b)])
        return [self.micro_batch(indices, epoch) for indices in share]

    def micro_batch(self, indices: list[int], epoch: int) -> MicroBatch:
        """The samples `indices`, collated, with blocks at anchors drawn from (seed, epoch, sample)."""
        ids, mask, attn = collate([self.data[i] for i in indices])
        anchors, reveals = [], []
        for row, index in enumerate(indices):
            generator = anchor_generator(self.seed, epoch, index)
            anchors.append(
                sample_anchors(
                    mask[row],
                    self.recipe.num_anchors,
                    self.block_size,
                    generator,
                    self.recipe.anchor_sampling,
                    self.offset,
                )
            )
            # Drawn after the anchors, so that the anchors do not depend on recipe.reveal.
            reveals.append(sample_reveals(anchors[-1].numel(), self.block_size, self.recipe.reveal, generator))
        tokens = int(attn.sum())  # counted here, on the CPU: no host sync in the step
        ids, mask, attn = ids.to(self.device), mask.to(self.device), attn.to(self.device)
        blocks = self.blocks(ids, mask, anchors, reveals)
        return MicroBatch(ids, attn, blocks, list(indices), tokens, self.width)

    def blocks(self, ids: torch.Tensor, mask: torch.Tensor, anchors: list, reveals: list) -> DraftBatch:
        """The blocks of `anchors` (per sequence) in the collated `ids` / `mask`, padded to static shapes where
        the loader has a width."""
        num_blocks = None
        if self.width is not None:
            ids, mask = pad_positions(ids, self.width), pad_positions(mask, self.width)
            num_blocks = self.recipe.num_anchors
        return build_blocks(
            ids, mask, anchors, self.block_size, self.mask_token_id, self.recipe.gamma, num_blocks, reveals, self.offset
        )

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.data.epoch_order(epoch, self.seed))
        return self._order[1]


def collate(samples: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids, loss mask) pairs → right-padded (input_ids, loss_mask, attention_mask), each (B, T_max), on the
    CPU."""
    width = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    attn = torch.zeros(len(samples), width, dtype=torch.long)
    for row, (x, m) in enumerate(samples):
        n = len(x)
        ids[row, :n] = torch.tensor(x, dtype=torch.long)  # copies out of the read-only memory map
        mask[row, :n] = torch.tensor(m, dtype=torch.bool)
        attn[row, :n] = 1
    return ids, mask, attn


def pad_positions(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T, ...) right-padded with zeros to (B, width, ...): a static shape for the compiled drafter."""
    if t.shape[1] > width:
        raise ValueError(
            f"a micro-batch of {t.shape[1]} positions is longer than data.max_length = {width}: prepare "
            "the data with this max_length, or set train.static_shapes=false"
        )
    if t.shape[1] == width:
        return t  # no copy: at 131072 tokens the features alone are gigabytes
    pad = [0, 0] * (t.ndim - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad)
