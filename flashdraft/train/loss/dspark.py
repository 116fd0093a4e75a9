"""DSpark's loss: the drafter's Markov-corrected distributions against the label and the target's distributions,
plus its confidence head against the acceptance rate it reaches (DSpark, arXiv 2607.05147, §3.3; DeepSpec's
`loss.py`).

Per labelled position, with q = softmax(U + W2·m) the drafter's distribution (U the backbone's logits through the
frozen LM head, W2·m the Markov head's bias from the true previous token) and p the target's own next-token
distribution there (its final hidden state through the same head):

    ℓ = α_ce · CE(q, label) + α_dist · ‖q − p‖₁ + α_conf · BCE(c, 1 − ½‖q − p‖₁)

c is the confidence head's probability and 1 − ½‖q − p‖₁ = Σ min(p, q) is the probability that a draft from q is
accepted against p: its target, detached. The loss is Σ w·ℓ / Σ w with the position weights of the recipe
(exponential decay, or D-PACE from the acceptance rates). The reference's weights are α_ce 0.1, α_dist 0.9,
α_conf 1.0; its distance is the L1 norm (twice the total variation), at temperature 1.

Only one (chunk, V) block of logits exists at a time, twice (q and p): each chunk's gradients with respect to the
backbone's hidden states, the Markov features and W2 are made in the same pass and scaled by the rows' weights,
which are known before it (for D-PACE a first, gradient-free pass over the chunks computes the acceptance rates
they come from). `reference.reference_dspark_loss` computes the same from full logits; the tests compare the
two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.chunks import chunk_logits, compiled
from flashdraft.train.loss.objective import PAPER, Objective, dpace_weights
from flashdraft.train.loss.stats import LossStats, block_stats


@dataclass(frozen=True)
class DSparkWeights:
    """α of each term (the reference's defaults)."""

    ce: float = 0.1
    distance: float = 0.9
    confidence: float = 1.0

    def __post_init__(self):
        for name in ("ce", "distance", "confidence"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"the DSpark loss weight {name} = {getattr(self, name)}: must be >= 0")
        if self.ce == 0 and self.distance == 0:
            raise ValueError("the DSpark loss needs a cross-entropy or a distance weight above 0")


DSPARK = DSparkWeights()  # the reference's weights


def _chunk_dspark(logits, teacher_logits, target, scale, ce_weight: float, distance_weight: float, grad_dtype):
    """One chunk: per-row α_ce·CE + α_dist·‖q − p‖₁, the acceptance rate Σ min(p, q), argmax hits and, when
    `grad_dtype` is given, d(scale · ℓ)/dlogits. The gradient of ‖q − p‖₁ is s⊙q − q·(s·q) with s = sign(q − p)."""
    log_q = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    q = log_q.exp()
    p = torch.softmax(teacher_logits, dim=-1)
    ce = -log_q.gather(1, target)[:, 0]
    difference = q - p
    distance = difference.abs().sum(-1)
    acceptance = (1 - 0.5 * distance).clamp(0, 1)
    correct = logits.argmax(dim=-1) == target[:, 0]
    loss = ce_weight * ce + distance_weight * distance
    if grad_dtype is None:
        return loss, acceptance, correct, None
    signed = torch.sign(difference) * q
    onehot = torch.arange(logits.shape[1], device=logits.device) == target
    dlogits = ce_weight * torch.where(onehot, q - 1.0, q)
    dlogits = dlogits + distance_weight * (signed - q * signed.sum(-1, keepdim=True))
    return loss, acceptance, correct, (dlogits * scale[:, None]).to(grad_dtype)


class DSparkLossFunction(torch.autograd.Function):
    """Σ_i scale_i · ℓ_i over rows in chunks (module docstring), differentiable in the hidden states, the Markov
    features and W2; also returns the per-row ℓ, acceptance rates and argmax hits (not differentiable).

    hidden (N, D), weight (V, D) the frozen LM head, markov (N, r) and markov_w2 (V, r) or both None (no Markov
    head), teacher (N, D) the target's final hidden states, labels (N,), scale (N,) each row's weight over the
    loss's denominator.
    """

    @staticmethod
    def forward(ctx, hidden, markov, markov_w2, weight, teacher, labels, scale, weights, chunk_size, compile_chunks):
        with torch.autocast(hidden.device.type, enabled=False):
            compute = torch.promote_types(weight.dtype, torch.float32)
            need = ctx.needs_input_grad
            chunk_fn = compiled(_chunk_dspark) if compile_chunks else _chunk_dspark
            rows = hidden.shape[0]
            token_loss = torch.empty(rows, dtype=compute, device=hidden.device)
            acceptance = torch.empty(rows, dtype=compute, device=hidden.device)
            correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need[0] else None
            grad_markov = torch.empty_like(markov) if markov is not None and need[1] else None
            grad_w2 = torch.zeros_like(markov_w2, dtype=compute) if markov_w2 is not None and need[2] else None
            grad_dtype = compute if any(need[:3]) else None
            w2 = None if markov_w2 is None else markov_w2.to(compute)
            for start in range(0, rows, chunk_size):
                end = min(start + chunk_size, rows)
                logits = chunk_logits(hidden[start:end], weight, compute)
                if markov is not None:
                    m = markov[start:end].to(compute)
                    logits = logits + m @ w2.t()
                token_loss[start:end], acceptance[start:end], correct[start:end], dlogits = chunk_fn(
                    logits,
                    chunk_logits(teacher[start:end], weight, compute),
                    labels[start:end, None],
                    scale[start:end].to(compute),
                    weights.ce,
                    weights.distance,
                    grad_dtype,
                )
                if grad_hidden is not None:
                    grad_hidden[start:end] = torch.mm(dlogits.to(weight.dtype), weight).to(hidden.dtype)
                if grad_markov is not None:
                    grad_markov[start:end] = (dlogits @ w2).to(markov.dtype)
                if grad_w2 is not None:
                    grad_w2 += dlogits.t() @ m
            loss_sum = (scale.to(compute) * token_loss).sum()
        ctx.save_for_backward(grad_hidden, grad_markov, grad_w2)
        ctx.w2_dtype = None if markov_w2 is None else markov_w2.dtype
        ctx.mark_non_differentiable(token_loss, acceptance, correct)
        return loss_sum, token_loss, acceptance, correct

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_hidden, grad_markov, grad_w2 = ctx.saved_tensors
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in (grad_hidden, grad_markov, grad_w2)]
        if scaled[2] is not None:
            scaled[2] = scaled[2].to(ctx.w2_dtype)
        return (scaled[0], scaled[1], scaled[2], *[None] * 7)


def dspark_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
    markov: torch.Tensor | None = None,
    markov_w2: torch.Tensor | None = None,
    confidence_logits: torch.Tensor | None = None,
    loss_weights: DSparkWeights = DSPARK,
    objective: Objective = PAPER,
    offset: int = 1,
    denominator: torch.Tensor | float | None = None,
    chunk_size: int = 1024,
    compile_chunks: bool | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The DSpark loss (module docstring) of a batch of packed blocks, never all logits at once.

    Args:
        hidden: (B, Q, D) the backbone's final-normed hidden states, Q = A * block_size.
        lm_head_weight: (V, D) the target's frozen LM head.
        teacher_hidden: (B, Q, D) the target's final hidden state before each label (`blocks.before_labels`).
        labels, weights: (B, Q) as `DraftBatch` makes them; weights are the exp weighting's (unused by dpace).
        markov: (B, Q, r) the Markov head's teacher-forced features (`MarkovHead.block_features`), with
            markov_w2 (V, r) its output weight; None for a drafter without one.
        confidence_logits: (B, Q) the confidence head's logits, or None (no confidence term).
        loss_weights: α of the three terms. objective: the position weighting (exp or dpace).
        offset: the batch's `DraftBatch.offset` (for the per-draft statistics).
        denominator: default Σ w (exp) or the labelled blocks (dpace) of this call; pass a whole step's total.
        compile_chunks: torch.compile the per-chunk math (default: on CUDA).

    Returns:
        (loss, `LossStats`); the stats' hits are the Markov-corrected argmax against the labels.
    """
    if (markov is None) != (markov_w2 is None):
        raise ValueError("give both markov features and markov_w2, or neither")
    if teacher_hidden.shape != hidden.shape or hidden.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(
            f"expected hidden and teacher_hidden (B, Q, D) with labels and weights (B, Q); got "
            f"{tuple(hidden.shape)}, {tuple(teacher_hidden.shape)}, {tuple(labels.shape)}, {tuple(weights.shape)}"
        )
    if labels.shape[1] % block_size:
        raise ValueError(f"Q = {labels.shape[1]} query positions is not a multiple of block_size {block_size}")
    compile_chunks = hidden.is_cuda if compile_chunks is None else compile_chunks
    labelled = labels != IGNORE_INDEX
    rows = labelled.view(-1).nonzero().squeeze(1)
    pick = lambda t: t.reshape(-1, *t.shape[2:])[rows]  # noqa: E731
    args = (
        pick(hidden),
        None if markov is None else pick(markov),
        markov_w2,
        lm_head_weight,
        pick(teacher_hidden).detach(),
        pick(labels),
    )
    sum_dtype = torch.promote_types(torch.promote_types(weights.dtype, lm_head_weight.dtype), torch.float32)
    if objective.weighting == "dpace":
        with torch.no_grad():  # the acceptance rates the weights come from, a pass of their own
            acceptance = _forward_only(args, loss_weights, chunk_size, compile_chunks)
        by_position = torch.zeros(labels.numel(), dtype=sum_dtype, device=labels.device)
        by_position[rows] = acceptance.to(sum_dtype)
        position_weights = dpace_weights(by_position.view(labels.shape), labelled, block_size, objective.dpace_alpha)
    else:
        position_weights = weights.to(sum_dtype)
    normaliser = objective.normaliser(labels, weights.to(sum_dtype), block_size)
    denominator = normaliser if denominator is None else torch.as_tensor(denominator, device=labels.device)
    denominator = denominator.to(sum_dtype)
    denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    row_weights = position_weights.reshape(-1)[rows]
    scale = row_weights / denominator
    loss, token_loss, acceptance, correct = DSparkLossFunction.apply(
        *args, scale, loss_weights, chunk_size, compile_chunks
    )
    token_loss = token_loss.detach()
    if confidence_logits is not None and loss_weights.confidence > 0:
        dtype = torch.promote_types(confidence_logits.dtype, acceptance.dtype)
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.reshape(-1)[rows].to(dtype), acceptance.to(dtype), reduction="none"
        )
        loss = loss + loss_weights.confidence * (scale.to(bce.dtype) * bce).sum().to(loss.dtype)
        token_loss = token_loss + loss_weights.confidence * bce.detach().to(token_loss.dtype)
    with torch.no_grad():
        loss_sum = (row_weights.to(token_loss.dtype) * token_loss).sum()
        hits = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        hits[rows] = correct
        stats = block_stats(hits.view(labels.shape), labelled, loss_sum, normaliser, block_size, offset)
    return loss, stats


def _forward_only(args, loss_weights: DSparkWeights, chunk_size: int, compile_chunks: bool) -> torch.Tensor:
    """The rows' acceptance rates, without gradients (D-PACE's confidences)."""
    scale = torch.zeros(args[0].shape[0], device=args[0].device)
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    return DSparkLossFunction.apply(*detached, scale, loss_weights, chunk_size, compile_chunks)[2]


__all__ = ["DSPARK", "DSparkLossFunction", "DSparkWeights", "dspark_loss"]
