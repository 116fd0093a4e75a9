"""What the DFlash loss optimises per labelled position (`recipe.loss`) and how positions are weighted
(`recipe.loss_weighting`), as one `Objective` that `dflash_loss` and its reference share.

Token losses (q = the drafter's probability of the label, CE = −log q):
- ce: CE.
- lk: the LK^λ loss of Samarin et al. ("LK Losses: Direct Acceptance Rate Optimization for Speculative
  Decoding", arXiv 2602.23881) against the label as a one-hot target: λ·KL + (1 − λ)·TV with KL = CE, TV = 1 − q
  and λ = exp(−η·q) per token, λ held constant in the gradient. It leans on CE while the drafter is unsure and
  shifts toward the acceptance rate q as it improves. The paper's full-vocabulary form compares the target's whole
  distribution; the truncated training target never computes it, so flashdraft's labels (the target's own tokens)
  stand in for it. (The paper's other loss, −log α, equals CE against a one-hot target.)

With `recipe.labels: target` the label is the target's whole next-token distribution p (fused.py `_chunk_soft`):
ce is KL(p ‖ q), lk uses α = Σ min(p, q) where it used q, and D-PACE's confidence is α.

Position weights (block position k = 1 … bs − 1):
- exp: w_k = exp(−(k − 1)/γ) (the DFlash paper's; `DraftBatch.weights`); the loss is Σ w·ℓ / Σ w.
- dpace: D-PACE (arXiv 2605.18810): with q̃_i = (1 − α)·q_i + α, w_j = Σ_{m ≥ j} Π_{i ≤ m} q̃_i over the labelled
  positions of the block, computed from the current drafter's own q and held constant in the gradient. A position
  weighs what its acceptance is worth to the expected accepted length, so the weight moves to whichever positions
  limit acceptance now. The loss is Σ w·ℓ / (labelled blocks): dividing by Σ w would cancel the credit mass the
  weights carry (a block whose drafts are all likely accepted should weigh more than one whose first draft fails).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.train.blocks import IGNORE_INDEX

LOSSES = ("ce", "lk")
WEIGHTINGS = ("exp", "dpace")


@dataclass(frozen=True)
class Objective:
    """The per-position loss and weighting; the defaults are the DFlash paper's (CE, exponential decay)."""

    loss: str = "ce"
    lk_eta: float = 3.0
    weighting: str = "exp"
    dpace_alpha: float = 0.5

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss = {self.loss!r}: must be one of {', '.join(LOSSES)}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting = {self.weighting!r}: must be one of {', '.join(WEIGHTINGS)}")
        if not self.lk_eta >= 0:
            raise ValueError(f"lk_eta = {self.lk_eta}: must be >= 0")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha = {self.dpace_alpha}: must be in (0, 1]")

    @classmethod
    def from_recipe(cls, recipe) -> Objective:
        """From the config's `recipe` section."""
        return cls(recipe.loss, recipe.lk_eta, recipe.loss_weighting, recipe.dpace_alpha)

    @property
    def eta(self) -> float | None:
        """η of the LK loss, None for CE (what the fused pass takes)."""
        return self.lk_eta if self.loss == "lk" else None

    def normaliser(self, labels: torch.Tensor, weights: torch.Tensor, block_size: int) -> torch.Tensor:
        """This batch's share of the loss's denominator: Σ w (exp) or the blocks with a label (dpace).

        Known before the forward for both, so a step sums it over every micro-batch and rank up front.
        """
        if self.weighting == "exp":
            return torch.where(labels != IGNORE_INDEX, weights, 0).sum()
        return labelled_blocks(labels, block_size).sum().to(weights.dtype)


PAPER = Objective()  # the DFlash paper's: cross-entropy, exponential decay


def labelled_blocks(labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, A) True for blocks with at least one labelled position."""
    return (labels != IGNORE_INDEX).view(labels.shape[0], -1, block_size).any(-1)


def dpace_weights(confidence: torch.Tensor, labelled: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE weights (module docstring) of (B, Q) confidences q at the (B, Q) `labelled` positions; 0 elsewhere.

    An unlabelled position is neither a factor of the products nor a term of the sums. No gradient flows.
    """
    with torch.no_grad():
        shape = (confidence.shape[0], -1, block_size)
        keep = labelled.view(shape)
        smooth = torch.where(keep, (1 - alpha) * confidence.view(shape) + alpha, 1.0)
        reach = torch.where(keep, torch.cumprod(smooth, dim=-1), 0.0)  # Π_{i<=m} q̃_i at labelled m
        suffix = reach.flip(-1).cumsum(-1).flip(-1)  # Σ_{m>=j}
        return torch.where(keep, suffix, 0.0).view(confidence.shape)


__all__ = ["LOSSES", "PAPER", "WEIGHTINGS", "Objective", "dpace_weights", "labelled_blocks"]
