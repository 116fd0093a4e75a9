"""The DFlash loss written plainly: every logit at once and torch's cross-entropy (what `dflash_loss` must equal).

It holds all B·Q·V logits and their gradient, so it serves tests and checks of a new head, dtype or device, not
training. Same arguments and return contract as `dflash_loss`: (loss, `LossStats`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.fused import check_loss_inputs
from flashdraft.train.loss.stats import LossStats, block_stats


def reference_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Σ w·CE / denominator over the labelled positions from full logits `hidden @ lm_head_weight.T`.

    Computed in the inputs' common dtype, at least float32 (pass float64 tensors for a float64 reference); the
    denominator defaults to Σ w, and the loss is 0 when it is 0 (nothing labelled).
    """
    check_loss_inputs(hidden, lm_head_weight, labels, weights, block_size)
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, lm_head_weight.dtype), torch.float32)
    dtype = torch.promote_types(dtype, weights.dtype)
    labelled = labels != IGNORE_INDEX
    logits = hidden.to(dtype) @ lm_head_weight.to(dtype).t()  # (B, Q, V)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    w = torch.where(labelled, weights.to(dtype), 0.0).flatten()
    loss_sum, weight_sum = (w * ce).sum(), w.sum()
    denominator = weight_sum if denominator is None else torch.as_tensor(denominator, dtype=dtype)
    loss = loss_sum / denominator if denominator > 0 else loss_sum * 0
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & labelled
        stats = block_stats(hits, labelled, loss_sum, weight_sum, block_size)
    return loss, stats


__all__ = ["reference_loss"]
