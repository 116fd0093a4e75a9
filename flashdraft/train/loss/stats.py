"""What a training step measures besides the loss: per-position accuracy, accepted runs and the simulated τ.

τ: `simulated_tau` = 1 + Σ_k Π_{j<=k} acc_j counts the bonus token, like the acceptance length measured at
inference; `expected_accepted` = Σ_k Π_{j<=k} acc_j counts drafted tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LossStats:
    """Counts, summable across steps and ranks (all tensors, on the loss's device: no host sync)."""

    loss_sum: torch.Tensor
    """Σ w·ℓ over labelled positions (float32 scalar)."""
    weight_sum: torch.Tensor
    """The loss's normaliser over the same positions (`Objective.normaliser`): Σ w for the exp weighting, the
    labelled blocks for dpace; loss_sum / weight_sum is the logged loss."""
    correct: torch.Tensor
    """(drafts + 1,) argmax == label per draft j, the token j after the anchor (j = 0 is never labelled: 0)."""
    valid: torch.Tensor
    """(drafts + 1,) labelled positions per j."""
    accepted: torch.Tensor
    """Σ over blocks of the leading run of correct labelled positions (what greedy verification would accept)."""
    blocks: torch.Tensor
    """Number of blocks with at least one labelled position."""

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def accuracy(self) -> torch.Tensor:
        """(drafts,) accuracy of drafts j = 1 … (0 where nothing was labelled)."""
        return (self.correct[1:].double() / self.valid[1:].clamp(min=1)).float()

    def tau(self) -> torch.Tensor:
        """`simulated_tau` of the per-position accuracies (assumes positions fail independently)."""
        return simulated_tau(self.accuracy())

    def block_tau(self) -> torch.Tensor:
        """1 + mean accepted run per block: τ measured per block, no independence assumption. Blocks cut short by
        the end of a response can accept fewer, so this reads slightly low on short responses."""
        return 1 + self.accepted.double() / self.blocks.clamp(min=1)


def expected_accepted(acc_per_position: torch.Tensor) -> torch.Tensor:
    """Σ_k Π_{j<=k} acc_j: expected drafted tokens accepted per block, acc for k = 1..bs-1."""
    return torch.cumprod(acc_per_position.double(), dim=-1).sum(-1)


def simulated_tau(acc_per_position: torch.Tensor) -> torch.Tensor:
    """1 + Σ_k Π_{j<=k} acc_j: tokens per draft-verify cycle including the target's bonus token — the same
    quantity as the acceptance length τ measured at inference (so τ = 1 means nothing drafted is accepted)."""
    return 1 + expected_accepted(acc_per_position)


def block_stats(
    hits: torch.Tensor,
    labelled: torch.Tensor,
    loss_sum: torch.Tensor,
    weight_sum: torch.Tensor,
    block_size: int,
    offset: int = 0,
) -> LossStats:
    """`LossStats` of one call from (B, Q) argmax hits and labelled positions (both bool, unlabelled hits ignored).

    The counts are per draft: index j counts the draft of the token j after the anchor (`DraftBatch.offset`: the
    slot it comes from is j - offset), index 0 is never labelled. They cover the blocks drafted from MASK alone
    (the first draft labelled: every block unless `recipe.reveal` showed some of its labels), which is what
    single-pass drafting sees; the loss covers every block."""
    batch = labelled.shape[0]
    hits = hits.view(batch, -1, block_size)
    shaped = labelled.view(batch, -1, block_size)
    if offset:  # drafts by distance from the anchor: the anchor's own position (distance 0) first, never labelled
        hits, shaped = (torch.nn.functional.pad(t, (offset, 0)) for t in (hits, shaped))
    shaped = shaped & shaped[..., 1:2]
    # A block's accepted run: labelled-and-correct positions from k = 1 up to the first miss.
    run = torch.cumprod((hits & shaped)[..., 1:].long(), dim=-1).sum(-1)
    return LossStats(
        loss_sum=loss_sum.detach().float(),
        weight_sum=weight_sum.detach(),
        correct=(hits & shaped).sum(dim=(0, 1)),
        valid=shaped.sum(dim=(0, 1)),
        accepted=run.sum(),
        blocks=shaped[..., 1:].any(-1).sum(),
    )


__all__ = ["LossStats", "block_stats", "expected_accepted", "simulated_tau"]
