"""DFlash2's loss, a reconstruction: z-lab has not published its trainer; the open ones (NeMo Automodel's and
speculators') agree on its shape, which this follows.

    L = α_base · L_DFlash + α_sel · Σ w·m·CE_k(S, label) / N

- L_DFlash is the DFlash loss of the backbone's logits U over the whole vocabulary (fused.py: `recipe.loss`, its
  weighting, `recipe.labels`).
- The selector term is a cross-entropy over the k candidates C = topk(U) of each labelled position, scored by the
  selector S(a, c) = U(c) + ⟨A[a] ⊙ W_h h, B[c]⟩ with a the true previous token (the anchor, then the labels: teacher
  forcing, as both trainers do). Its label is the data token; when that token is not among the candidates the
  position is dropped (m = 0, NeMo's choice) or, with `absent = inject`, it replaces the last candidate and is
  learned there (speculators'). The top-k choice itself passes no gradient; U at the candidates does (into the
  backbone through h), and so does the pair score (into A, B, W_h and h).
- w is the exponential decay of the DFlash loss (`DraftBatch.weights`, also under D-PACE) and N the step's
  denominator, the same as the DFlash term's: a micro-batch's share of the step is then known before its forward, so
  accumulating micro-batches gives the step's loss exactly. NeMo divides by the weight of the positions kept and
  speculators by the count of positions instead; at a fixed recall the three differ by a constant factor.

The statistics count a position correct when the selector's pick (its argmax given the true previous token) is the
label: what greedy drafting emits while the drafts before it were accepted.

Only one chunk of logits exists at a time: `SelectorLossFunction` makes each chunk's candidates, scores and the
gradients with respect to h, A, B and W_h in one pass. `reference.reference_dflash2_loss` computes the same from full
logits with autograd; the tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.chunks import chunk_logits, options_of
from flashdraft.train.loss.fused import dflash_loss
from flashdraft.train.loss.stats import LossStats, block_stats

ABSENT = ("drop", "inject")


@dataclass(frozen=True)
class DFlash2Weights:
    """α of each term, and what becomes of a label outside the candidates (`recipe.dflash2`)."""

    base: float = 1.0
    selector: float = 1.0
    absent: str = "drop"

    def __post_init__(self):
        for name in ("base", "selector"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"the DFlash2 loss weight {name} = {getattr(self, name)}: must be >= 0")
        if self.base == 0 and self.selector == 0:
            raise ValueError("the DFlash2 loss needs a base or a selector weight above 0")
        if self.absent not in ABSENT:
            raise ValueError(f"absent = {self.absent!r}: must be one of {', '.join(ABSENT)}")


def candidates_with_label(logits, labels, top_k: int, inject: bool):
    """(U at C (c, k), C (c, k), the label's slot (c,), kept (c,)) of a chunk's logits (c, V) and labels (c,):
    the top-k candidates, largest first; a label outside them is injected into the last slot or not kept."""
    values, ids = torch.topk(logits, top_k, dim=-1, sorted=True)
    found = ids == labels[:, None]
    present = found.any(-1)
    slot = found.to(torch.int64).argmax(-1)
    if not inject:
        return values, ids, slot, present
    last = torch.full_like(slot, top_k - 1)
    ids = torch.cat([ids[:, :-1], torch.where(present, ids[:, -1], labels)[:, None]], dim=1)
    label_logit = logits.gather(1, labels[:, None])[:, 0]
    values = torch.cat([values[:, :-1], torch.where(present, values[:, -1], label_logit)[:, None]], dim=1)
    return values, ids, torch.where(present, slot, last), torch.ones_like(present)


class SelectorLossFunction(torch.autograd.Function):
    """Σ_i scale_i · kept_i · CE_k(S_i, slot_i) over rows in chunks, differentiable in the hidden states h (N, D), the
    codebooks A, B (V, r) and W_h (r, D); the LM head (V, D) is frozen. Also returns each row's CE and whether the
    selector's pick is the label (not differentiable)."""

    @staticmethod
    def forward(ctx, hidden, codebook_a, codebook_b, projection, weight, labels, prev, scale, top_k, inject, chunk):
        with torch.autocast(hidden.device.type, enabled=False):
            compute = torch.promote_types(weight.dtype, torch.float32)
            rows = hidden.shape[0]
            token_loss = torch.zeros(rows, dtype=compute, device=hidden.device)
            correct = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
            grads = [torch.zeros_like(t, dtype=compute) for t in (hidden, codebook_a, codebook_b, projection)]
            a_book, b_book, w_h = (t.to(compute) for t in (codebook_a, codebook_b, projection))
            for start in range(0, rows, chunk):
                end = min(start + chunk, rows)
                h, y, a = hidden[start:end].to(compute), labels[start:end], prev[start:end]
                values, ids, slot, kept = candidates_with_label(chunk_logits(h, weight, compute), y, top_k, inject)
                z = h @ w_h.t()  # (c, r)
                query = a_book[a] * z
                successors = b_book[ids]  # (c, k, r)
                scores = values + torch.einsum("cr,ckr->ck", query, successors)
                log_q = scores.log_softmax(-1)
                token_loss[start:end] = torch.where(kept, -log_q.gather(1, slot[:, None])[:, 0], 0.0)
                correct[start:end] = ids.gather(1, scores.argmax(-1, keepdim=True))[:, 0] == y
                # dCE/dS = softmax − one-hot, on the kept rows, times each row's scale.
                g = log_q.exp() - torch.nn.functional.one_hot(slot, top_k).to(compute)
                g = g * torch.where(kept, scale[start:end].to(compute), 0.0)[:, None]
                d_query = torch.einsum("ck,ckr->cr", g, successors)
                d_z = d_query * a_book[a]
                grads[0][start:end] = torch.einsum("ck,ckd->cd", g, weight[ids].to(compute)) + d_z @ w_h
                grads[1].index_add_(0, a, d_query * z)
                grads[2].index_add_(0, ids.reshape(-1), (g[:, :, None] * query[:, None, :]).reshape(-1, z.shape[1]))
                grads[3] += d_z.t() @ h
            loss_sum = (scale.to(compute) * token_loss).sum()
        ctx.save_for_backward(*grads)
        ctx.dtypes = [t.dtype for t in (hidden, codebook_a, codebook_b, projection)]
        ctx.mark_non_differentiable(token_loss, correct)
        return loss_sum, token_loss, correct

    @staticmethod
    def backward(ctx, grad_loss, *_):
        scaled = [(g * grad_loss.to(g.dtype)).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return (*scaled, *[None] * 7)


def dflash2_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    prev: torch.Tensor,
    selector,
    *,
    loss_weights: DFlash2Weights = DFlash2Weights(),
    offset: int = 0,
    **dflash_options,
) -> tuple[torch.Tensor, LossStats]:
    """The DFlash2 loss (module docstring) of a batch of packed blocks, never all logits at once.

    Args:
        hidden: (B, Q, D) the backbone's final-normed hidden states, Q = A * block_size.
        lm_head_weight: (V, D) the target's frozen LM head.
        labels, weights: (B, Q) as `DraftBatch` makes them.
        prev: (B, Q) the true token before each label (`blocks.before_labels`: the anchor, then the labels).
        selector: the drafter's `CandidateSelector`.
        loss_weights: α of the terms and the absent-label rule. offset: the batch's `DraftBatch.offset` (for the
            statistics).
        dflash_options: the DFlash term's keyword options (`dflash_loss`'s: block_size, objective, teacher_hidden,
            denominator, chunk_size, compile_chunks); the selector's term reads the same block_size, objective,
            denominator (default the objective's normaliser of this call; pass a whole step's total) and chunk_size.

    Returns:
        (loss, `LossStats`): the stats' hits are the selector's teacher-forced picks.
    """
    base, base_stats = dflash_loss(hidden, lm_head_weight, labels, weights, **dflash_options)
    shared = options_of(dflash_loss, dflash_options)
    block_size, objective, chunk_size = shared.block_size, shared.objective, shared.chunk_size
    if prev.shape != labels.shape:
        raise ValueError(f"prev must be shaped like labels {tuple(labels.shape)}, got {tuple(prev.shape)}")
    labelled = labels != IGNORE_INDEX
    rows = labelled.view(-1).nonzero().squeeze(1)
    sum_dtype = torch.promote_types(torch.promote_types(weights.dtype, lm_head_weight.dtype), torch.float32)
    normaliser = objective.normaliser(labels, weights.to(sum_dtype), block_size)
    denominator = (
        normaliser if shared.denominator is None else torch.as_tensor(shared.denominator, device=labels.device)
    )
    denominator = denominator.to(sum_dtype)
    denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    row_weights = weights.to(sum_dtype).reshape(-1)[rows]
    selector_sum, token_loss, correct = SelectorLossFunction.apply(
        hidden.reshape(-1, hidden.shape[-1])[rows],
        selector.predecessor_codebook,
        selector.successor_codebook,
        selector.hidden_projection.weight,
        lm_head_weight,
        labels.reshape(-1)[rows],
        prev.reshape(-1)[rows],
        row_weights / denominator,
        selector.top_k,
        loss_weights.absent == "inject",
        chunk_size,
    )
    loss = loss_weights.base * base + loss_weights.selector * selector_sum.to(base.dtype)
    with torch.no_grad():
        loss_sum = loss_weights.base * base_stats.loss_sum + loss_weights.selector * (row_weights * token_loss).sum()
        hits = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        hits[rows] = correct
        stats = block_stats(hits.view(labels.shape), labelled, loss_sum, base_stats.weight_sum, block_size, offset)
    return loss, stats


__all__ = ["ABSENT", "DFlash2Weights", "SelectorLossFunction", "candidates_with_label", "dflash2_loss"]
