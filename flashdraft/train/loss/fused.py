"""The DFlash loss: weighted token losses of the drafter's hidden states through the target's frozen LM head.

The loss is Σ w·ℓ / N over the labelled positions (k >= 1 whose token is a response token): ℓ the token loss and
w the position weight of the `Objective` (train/loss/objective.py; by default cross-entropy and
w_k = exp(-(k - 1) / γ) from `DraftBatch.weights`, N = Σ w); `denominator=` lets a caller normalise over a whole
optimizer step instead. The logits are never all in memory: rows go through the head in chunks, and each row's
input gradient is made in the same pass (`LinearCrossEntropyFunction`); the weights, which D-PACE computes from
the pass's own confidences, scale those gradients afterwards. `train/loss/reference.py` computes the same thing
from full logits; the tests compare the two.
"""

from __future__ import annotations

import torch

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.chunks import chunk_logits, compiled
from flashdraft.train.loss.objective import PAPER, Objective, dpace_weights
from flashdraft.train.loss.stats import LossStats, block_stats


def check_loss_inputs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    block_size: int,
    teacher_hidden: torch.Tensor | None = None,
) -> None:
    """Shapes `dflash_loss` (and its reference) accept; a ValueError naming the mismatch otherwise."""
    if teacher_hidden is not None and teacher_hidden.shape != hidden.shape:
        raise ValueError(
            f"teacher_hidden must be shaped like hidden {tuple(hidden.shape)}, got {tuple(teacher_hidden.shape)}"
        )
    if hidden.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(
            f"expected hidden (B, Q, D) with labels and weights (B, Q); got {tuple(hidden.shape)}, "
            f"{tuple(labels.shape)}, {tuple(weights.shape)}"
        )
    if hidden.shape[-1] != lm_head_weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != LM head input size {lm_head_weight.shape[-1]}")
    queries = labels.shape[1]
    if queries % block_size:
        raise ValueError(f"Q = {queries} query positions is not a multiple of block_size {block_size}")


def _chunk_ce(logits: torch.Tensor, target: torch.Tensor, eta: float | None, grad_dtype: torch.dtype | None):
    """One chunk against the label tokens: per-row token loss ℓ, the drafter's probability q of the label, argmax
    hits and (when `grad_dtype` is given) dℓ/dlogits.

    ℓ = CE, or with `eta` the one-hot LK^λ loss λ·CE + (1 − λ)·(1 − q), λ = exp(−η·q) held constant (objective.py),
    whose gradient is CE's scaled by λ + (1 − λ)·q. Written out of place so that one compiled kernel pair (a row
    reduction, then one pointwise pass writing the gradient straight in `grad_dtype`) can replace the ~10 passes
    over the (c, V) fp32 logits that eager runs.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    ce = lse - logits.gather(1, target)  # (c, 1)
    q = torch.exp(-ce)
    scale = None
    if eta is None:
        loss = ce
    else:
        lam = torch.exp(-eta * q)
        loss = lam * ce + (1 - lam) * (1 - q)
        scale = lam + (1 - lam) * q
    correct = logits.argmax(dim=-1) == target[:, 0]
    if grad_dtype is None:
        return loss[:, 0], q[:, 0], correct, None
    probs = (logits - lse).exp()
    onehot = torch.arange(logits.shape[1], device=logits.device) == target
    dlogits = torch.where(onehot, probs - 1.0, probs)
    if scale is not None:
        dlogits = dlogits * scale
    return loss[:, 0], q[:, 0], correct, dlogits.to(grad_dtype)


def _chunk_soft(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor,
    eta: float | None,
    grad_dtype: torch.dtype | None,
):
    """One chunk against the target's own next-token distribution p (`recipe.labels: target`): per-row ℓ, the
    acceptance rate α = Σ min(p, q), argmax hits against the label tokens and dℓ/dlogits.

    ℓ = KL(p ‖ q) (gradient q − p), or with `eta` the LK^λ loss λ·KL + (1 − λ)·(1 − α), λ = exp(−η·α) held constant;
    1 − α is the total variation, whose gradient is −(m·q − q·Σ m·q) with m = [q < p]. With a one-hot p both are
    `_chunk_ce`'s losses (KL = CE, α = q).
    """
    log_q = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    log_p = teacher_logits - torch.logsumexp(teacher_logits, dim=-1, keepdim=True)
    q, p = log_q.exp(), log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1, keepdim=True)
    alpha = torch.minimum(p, q).sum(-1, keepdim=True)
    correct = logits.argmax(dim=-1) == target[:, 0]
    if eta is None:
        loss = kl
    else:
        lam = torch.exp(-eta * alpha)
        loss = lam * kl + (1 - lam) * (1 - alpha)
    if grad_dtype is None:
        return loss[:, 0], alpha[:, 0], correct, None
    dlogits = q - p
    if eta is not None:
        below = torch.where(q < p, q, 0.0)
        dlogits = lam * dlogits - (1 - lam) * (below - q * below.sum(-1, keepdim=True))
    return loss[:, 0], alpha[:, 0], correct, dlogits.to(grad_dtype)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-row token losses ℓ_i of h_i W^T against y_i, in row chunks; each row's gradient dℓ_i/dh_i is made in the
    same pass and stored, so backward only scales it by the incoming per-row gradient (the position weights).

    Returns (ℓ, confidence, argmax hits), each (N,); only ℓ is differentiable. The confidence is the drafter's
    probability of the label, or with `teacher` the acceptance rate Σ min(p, q). Only one (chunk, V) block of logits
    (two with `teacher`) exists at a time. The head W is frozen: no gradient for it. `compile_chunks`: compile the
    per-chunk softmax math (fused); by default on CUDA only.
    `eta`: None for cross-entropy / KL, else the LK loss's η. `teacher`: (N, D) the target's final hidden states
    before each label, whose logits through the same head give the distribution p the rows are trained against
    (`_chunk_soft`); None trains against the label tokens.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, eta, teacher=None, compile_chunks=None):
        # Autocast would re-cast the chunk matmuls; the dtypes here are chosen explicitly.
        with torch.autocast(hidden.device.type, enabled=False):
            compute_dtype = torch.promote_types(weight.dtype, torch.float32)
            need_grad = ctx.needs_input_grad[0]
            chunk_fn = _chunk_ce if teacher is None else _chunk_soft
            if compile_chunks is None:
                compile_chunks = hidden.is_cuda
            if compile_chunks:
                chunk_fn = compiled(chunk_fn)
            rows = hidden.shape[0]
            token_loss = torch.empty(rows, dtype=compute_dtype, device=hidden.device)
            confidence = torch.empty(rows, dtype=compute_dtype, device=hidden.device)
            correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
            grad = torch.empty_like(hidden) if need_grad else None
            for start in range(0, rows, chunk_size):
                end = min(start + chunk_size, rows)
                logits = chunk_logits(hidden[start:end], weight, compute_dtype)
                inputs = (logits,)
                if teacher is not None:
                    inputs += (chunk_logits(teacher[start:end], weight, compute_dtype),)
                token_loss[start:end], confidence[start:end], correct[start:end], dlogits = chunk_fn(
                    *inputs, labels[start:end, None], eta, weight.dtype if need_grad else None
                )
                if need_grad:
                    grad[start:end] = torch.mm(dlogits, weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(confidence, correct)
        return token_loss, confidence, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_confidence, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype)[:, None], None, None, None, None, None, None


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
    chunk_size: int = 1024,
    denominator: torch.Tensor | float | None = None,
    objective: Objective = PAPER,
    teacher_hidden: torch.Tensor | None = None,
    compile_chunks: bool | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Weighted token losses of drafter hidden states through the frozen LM head, never all logits at once.

    Args:
        hidden: (B, Q) x D drafter output, Q = A * block_size.
        lm_head_weight: (V, D) the target's LM head (a plain linear head: no softcapping or multiplier).
        labels: (B, Q) token ids, IGNORE_INDEX (-100) where unlabelled; those rows are skipped entirely.
        weights: (B, Q) loss weights of labelled rows (`DraftBatch.weights`; unused by the dpace weighting).
        chunk_size: rows per chunk; a chunk holds chunk_size x V logits in fp32 (1024 x 248320 ≈ 1 GB).
        denominator: default `objective.normaliser` of this call; pass a total over a whole optimizer step (all
            micro-batches and ranks) to weight every token of the step alike.
        objective: the token loss and the position weighting (train/loss/objective.py).
        teacher_hidden: (B, Q, D) the target's final hidden state at the position before each label
            (`recipe.labels: target`): the rows learn the target's whole next-token distribution there (KL, or LK
            against it) instead of the label token; the hits and accepted runs still count the label tokens.
        compile_chunks: torch.compile the per-chunk softmax math (default: on CUDA). A short run passes False:
            compiling costs seconds on a fresh machine that its steps never win back.

    Returns:
        loss = Σ w·ℓ / denominator (0 when nothing is labelled), and `LossStats` (detached counts).
    """
    check_loss_inputs(hidden, lm_head_weight, labels, weights, block_size, teacher_hidden)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    labelled = labels != IGNORE_INDEX
    rows = labelled.view(-1).nonzero().squeeze(1)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    # Σ w in at least the weights' precision.
    sum_dtype = torch.promote_types(torch.promote_types(weights.dtype, lm_head_weight.dtype), torch.float32)
    teacher = None if teacher_hidden is None else teacher_hidden.reshape(-1, teacher_hidden.shape[-1])[rows]
    token_loss, confidence, correct = LinearCrossEntropyFunction.apply(
        flat_hidden[rows],
        lm_head_weight,
        labels.reshape(-1)[rows],
        chunk_size,
        objective.eta,
        teacher,
        compile_chunks,
    )
    if objective.weighting == "dpace":
        by_position = torch.zeros(labels.numel(), dtype=sum_dtype, device=labels.device)
        by_position[rows] = confidence.to(sum_dtype)
        position_weights = dpace_weights(by_position.view(labels.shape), labelled, block_size, objective.dpace_alpha)
    else:
        position_weights = weights
    # The loss in the head's compute precision (fp32, or fp64 for an fp64 head), like the token losses.
    row_weights = position_weights.reshape(-1)[rows].to(token_loss.dtype)
    loss_sum = (row_weights * token_loss).sum()
    normaliser = objective.normaliser(labels, weights.to(sum_dtype), block_size)
    if denominator is None:
        denominator = normaliser
    denominator = torch.as_tensor(denominator, dtype=loss_sum.dtype, device=loss_sum.device)
    loss = loss_sum / torch.where(denominator > 0, denominator, torch.ones_like(denominator))

    with torch.no_grad():
        hits = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        hits[rows] = correct
        stats = block_stats(hits.view(labels.shape), labelled, loss_sum, normaliser, block_size)
    return loss, stats


__all__ = ["LinearCrossEntropyFunction", "check_loss_inputs", "dflash_loss"]
