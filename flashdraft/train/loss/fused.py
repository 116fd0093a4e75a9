"""The DFlash loss: weighted cross-entropy of the drafter's hidden states through the target's frozen LM head.

The loss is Σ w·CE / Σ w over the labelled positions (k >= 1 whose token is a response token), with
w_k = exp(-(k - 1) / γ) (`DraftBatch.weights`); `denominator=` lets a caller normalise over a whole optimizer step
instead. The logits are never all in memory: rows go through the head in chunks, and each chunk's input gradient
is made in the same pass (`LinearCrossEntropyFunction`). `train/loss/reference.py` computes the same thing from
full logits; the tests compare the two.
"""

from __future__ import annotations

import functools

import torch

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.stats import LossStats, block_stats


def check_loss_inputs(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, block_size: int
) -> None:
    """Shapes `dflash_loss` (and its reference) accept; a ValueError naming the mismatch otherwise."""
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


@functools.cache
def _has_fp32_out_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(..., out_dtype=float32)` exists for `dtype` on this device (CUDA bf16/fp16 today)."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """(c, D) x (V, D) → (c, V) logits in `compute_dtype`, the matmul in the head's dtype."""
    hidden = hidden.to(weight.dtype)
    if weight.dtype != compute_dtype and _has_fp32_out_mm(weight.device.type, weight.dtype):
        # fp32 accumulate *and* fp32 output: no rounding of the logits to bf16 before the softmax.
        return torch.mm(hidden, weight.t(), out_dtype=compute_dtype)
    return torch.mm(hidden, weight.t()).to(compute_dtype)


def _chunk_ce(logits: torch.Tensor, target: torch.Tensor, w: torch.Tensor, grad_dtype: torch.dtype | None):
    """One chunk: Σ w·CE, argmax hits, and (when `grad_dtype` is given) d(w·CE)/dlogits = w·(softmax - onehot).

    Written out of place so that one compiled kernel pair (a row reduction, then one pointwise pass writing the
    gradient straight in `grad_dtype`) can replace the ~10 passes over the (c, V) fp32 logits that eager runs.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = (w * (lse - logits.gather(1, target))).sum()
    correct = logits.argmax(dim=-1) == target[:, 0]
    if grad_dtype is None:
        return loss, correct, None
    probs = (logits - lse).exp()
    onehot = torch.arange(logits.shape[1], device=logits.device) == target
    return loss, correct, (torch.where(onehot, probs - 1.0, probs) * w).to(grad_dtype)


@functools.cache
def _compiled_chunk_ce():
    # dynamic: the last chunk has fewer rows; one graph serves every chunk size.
    return torch.compile(_chunk_ce, dynamic=True)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Σ_i w_i · CE(h_i W^T, y_i) over rows, in row chunks; the input gradient is made in the same pass.

    Only one (chunk, V) block of logits exists at a time; backward just scales the stored (N, D) gradient.
    The head W is frozen: no gradient for it. On CUDA the per-chunk softmax math is compiled (fused); elsewhere it
    runs eagerly.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size):
        # Autocast would re-cast the chunk matmuls; the dtypes here are chosen explicitly.
        with torch.autocast(hidden.device.type, enabled=False):
            compute_dtype = torch.promote_types(weight.dtype, torch.float32)
            need_grad = ctx.needs_input_grad[0]
            chunk_ce = _compiled_chunk_ce() if hidden.is_cuda else _chunk_ce
            rows = hidden.shape[0]
            loss_sum = torch.zeros((), dtype=compute_dtype, device=hidden.device)
            correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
            grad = torch.empty_like(hidden) if need_grad else None
            for start in range(0, rows, chunk_size):
                end = min(start + chunk_size, rows)
                logits = _chunk_logits(hidden[start:end], weight, compute_dtype)
                w = weights[start:end, None].to(compute_dtype)
                loss, correct[start:end], dlogits = chunk_ce(
                    logits, labels[start:end, None], w, weight.dtype if need_grad else None
                )
                loss_sum += loss
                if need_grad:
                    grad[start:end] = torch.mm(dlogits, weight).to(hidden.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
    chunk_size: int = 1024,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Weighted cross-entropy of drafter hidden states through the frozen LM head, never all logits at once.

    Args:
        hidden: (B, Q) x D drafter output, Q = A * block_size.
        lm_head_weight: (V, D) the target's LM head (a plain linear head: no softcapping or multiplier).
        labels: (B, Q) token ids, IGNORE_INDEX (-100) where unlabelled; those rows are skipped entirely.
        weights: (B, Q) loss weights of labelled rows (`DraftBatch.weights`).
        chunk_size: rows per chunk; a chunk holds chunk_size x V logits in fp32 (1024 x 248320 ≈ 1 GB).
        denominator: default Σ w of this call; pass a total over a whole optimizer step (all micro-batches and
            ranks) to weight every token of the step alike.

    Returns:
        loss = Σ w·CE / denominator (0 when nothing is labelled), and `LossStats` (detached counts).
    """
    check_loss_inputs(hidden, lm_head_weight, labels, weights, block_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    labelled = labels != IGNORE_INDEX
    rows = labelled.view(-1).nonzero().squeeze(1)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    # Sums in the loss's own precision (fp32, or fp64 for an fp64 head) so Σ w matches Σ w·CE.
    sum_dtype = torch.promote_types(torch.promote_types(weights.dtype, lm_head_weight.dtype), torch.float32)
    row_weights = weights.reshape(-1)[rows].to(sum_dtype)
    loss_sum, correct = LinearCrossEntropyFunction.apply(
        flat_hidden[rows], lm_head_weight, labels.reshape(-1)[rows], row_weights, chunk_size
    )
    weight_sum = row_weights.sum()
    if denominator is None:
        denominator = weight_sum
    denominator = torch.as_tensor(denominator, dtype=loss_sum.dtype, device=loss_sum.device)
    loss = loss_sum / torch.where(denominator > 0, denominator, torch.ones_like(denominator))

    with torch.no_grad():
        hits = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        hits[rows] = correct
        stats = block_stats(hits.view(labels.shape), labelled, loss_sum, weight_sum, block_size)
    return loss, stats


__all__ = ["LinearCrossEntropyFunction", "check_loss_inputs", "dflash_loss"]
