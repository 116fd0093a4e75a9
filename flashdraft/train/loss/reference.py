"""The losses written plainly: every logit at once, torch's cross-entropy and softmax, and each `Objective`
from its definition (what `dflash_loss`, `dspark_loss` and `dflash2_loss` must equal).

It holds all B·Q·V logits and their gradient, so it serves tests and checks of a new head, dtype or device, not
training. Same arguments and return contract as `dflash_loss`: (loss, `LossStats`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss.chunks import options_of
from flashdraft.train.loss.dflash2 import dflash2_loss
from flashdraft.train.loss.dspark import dspark_loss
from flashdraft.train.loss.fused import check_loss_inputs, dflash_loss
from flashdraft.train.loss.objective import PAPER, Objective, labelled_blocks
from flashdraft.train.loss.stats import LossStats, block_stats


def reference_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
    denominator: torch.Tensor | float | None = None,
    objective: Objective = PAPER,
    teacher_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Σ w·ℓ / denominator over the labelled positions from full logits `hidden @ lm_head_weight.T`.

    Computed in the inputs' common dtype, at least float32 (pass float64 tensors for a float64 reference); the
    denominator defaults to Σ w (exp weighting) or the labelled blocks (dpace), and the loss is 0 when it is 0.
    With `teacher_hidden`, ℓ compares the whole distributions: torch's KL divergence against the target's softmax,
    and the LK loss's acceptance rate Σ min(p, q) written as that sum.
    """
    check_loss_inputs(hidden, lm_head_weight, labels, weights, block_size, teacher_hidden)
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, lm_head_weight.dtype), torch.float32)
    dtype = torch.promote_types(dtype, weights.dtype)
    labelled = labels != IGNORE_INDEX
    logits = hidden.to(dtype) @ lm_head_weight.to(dtype).t()  # (B, Q, V)
    if teacher_hidden is None:
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
        divergence = ce.view(labels.shape)
        # The drafter's probability of each label, from the softmax itself (IGNORE rows read token 0, then masked).
        confidence = logits.softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    else:
        teacher_logits = teacher_hidden.to(dtype) @ lm_head_weight.to(dtype).t()
        log_q = logits.log_softmax(-1)
        log_p = teacher_logits.log_softmax(-1)
        divergence = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
        confidence = torch.minimum(log_p.exp(), log_q.exp()).sum(-1)
    if objective.loss == "lk":
        lam = torch.exp(-objective.lk_eta * confidence).detach()
        token_loss = lam * divergence + (1 - lam) * (1 - confidence)
    else:
        token_loss = divergence
    if objective.weighting == "dpace":
        w = _dpace_by_definition(confidence.detach(), labelled, block_size, objective.dpace_alpha)
        normaliser = labelled_blocks(labels, block_size).sum().to(dtype)
    else:
        w = torch.where(labelled, weights.to(dtype), 0.0)
        normaliser = w.sum()
    loss_sum = torch.where(labelled, w * token_loss, 0.0).sum()
    denominator = normaliser if denominator is None else torch.as_tensor(denominator, dtype=dtype)
    loss = loss_sum / denominator if denominator > 0 else loss_sum * 0
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & labelled
        stats = block_stats(hits, labelled, loss_sum, normaliser, block_size)
    return loss, stats


def _dpace_by_definition(q: torch.Tensor, labelled: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """w_j = Σ_{m >= j} Π_{i <= m} q̃_i over the labelled i, m of each block, as sums over index matrices:
    log Π_{i<=m} = Σ_i [i <= m] log q̃_i, then Σ_m [m >= j] (one triangular matrix, both times)."""
    shape = (q.shape[0], -1, block_size)
    keep = labelled.view(shape)
    log_smooth = torch.where(keep, torch.log((1 - alpha) * q.view(shape) + alpha), 0.0)
    upper = torch.ones(block_size, block_size, dtype=q.dtype, device=q.device).triu()  # upper[i, m] = [i <= m]
    reach = torch.where(keep, torch.exp(log_smooth @ upper), 0.0)  # (B, A, bs): Π up to m, at labelled m
    return torch.where(keep, reach @ upper.t(), 0.0).view(q.shape)  # Σ_m upper[j, m] reach_m


def reference_dspark_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    **options,
) -> tuple[torch.Tensor, LossStats]:
    """`dspark_loss` written plainly from full (B, Q, V) logits with torch's own functions and autograd: what it
    must equal, for tests (in float64: pass float64 tensors). `options`: dspark_loss's keyword arguments, with its
    defaults (its chunking ones, chunk_size and compile_chunks, change nothing here)."""
    options = options_of(dspark_loss, options)  # the same options with the same defaults
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, lm_head_weight.dtype), torch.float32)
    labelled = labels != IGNORE_INDEX
    logits = hidden.to(dtype) @ lm_head_weight.to(dtype).t()
    if options.markov is not None:
        logits = logits + options.markov.to(dtype) @ options.markov_w2.to(dtype).t()
    teacher = (teacher_hidden.to(dtype) @ lm_head_weight.to(dtype).t()).detach()
    q, p = logits.softmax(-1), teacher.softmax(-1)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    distance = (q - p).abs().sum(-1)
    acceptance = torch.minimum(q, p).sum(-1).clamp(0, 1).detach()
    token_loss = options.loss_weights.ce * ce.view(labels.shape) + options.loss_weights.distance * distance
    if options.confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(options.confidence_logits.to(dtype), acceptance, reduction="none")
        token_loss = token_loss + options.loss_weights.confidence * bce
    if options.objective.weighting == "dpace":
        w = _dpace_by_definition(acceptance, labelled, options.block_size, options.objective.dpace_alpha)
    else:
        w = torch.where(labelled, weights.to(dtype), 0.0)
    normaliser = options.objective.normaliser(labels, weights.to(dtype), options.block_size)
    denominator = normaliser if options.denominator is None else torch.as_tensor(options.denominator, dtype=dtype)
    loss_sum = torch.where(labelled, w * token_loss, 0.0).sum()
    loss = loss_sum / denominator if denominator > 0 else loss_sum * 0
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & labelled
        stats = block_stats(hits, labelled, loss_sum, normaliser, options.block_size, options.offset)
    return loss, stats


def reference_dflash2_loss(hidden, lm_head_weight, labels, weights, prev, selector, **options):
    """`dflash2_loss` (same arguments) from full (B, Q, V) logits with autograd: `reference_loss` for the DFlash
    term, and the selector's scores written from their formula with torch's cross-entropy over the candidates."""
    options = options_of(dflash2_loss, options)
    base_options = options_of(dflash_loss, options.dflash_options)
    names = ("block_size", "denominator", "objective", "teacher_hidden")
    base, base_stats = reference_loss(
        hidden, lm_head_weight, labels, weights, **{name: getattr(base_options, name) for name in names}
    )
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, lm_head_weight.dtype), torch.float32)
    labelled = labels != IGNORE_INDEX
    logits = hidden.to(dtype) @ lm_head_weight.to(dtype).t()
    ids = logits.detach().topk(selector.top_k, dim=-1).indices  # the choice passes no gradient
    safe_labels = labels.clamp(min=0)
    present = (ids == safe_labels[..., None]).any(-1)
    if options.loss_weights.absent == "inject":
        ids[..., -1] = torch.where(present, ids[..., -1], safe_labels)
    kept = labelled & (present | (options.loss_weights.absent == "inject"))
    slot = (ids == safe_labels[..., None]).to(torch.int64).argmax(-1)
    a_book, b_book = selector.predecessor_codebook.to(dtype), selector.successor_codebook.to(dtype)
    projected = hidden.to(dtype) @ selector.hidden_projection.weight.to(dtype).t()
    pair = ((a_book[prev] * projected)[..., None, :] * b_book[ids]).sum(-1)
    scores = logits.gather(-1, ids) + pair
    ce = F.cross_entropy(scores.flatten(0, 1), slot.flatten(), reduction="none").view(labels.shape)
    normaliser = base_options.objective.normaliser(labels, weights.to(dtype), base_options.block_size)
    denominator = (
        normaliser if base_options.denominator is None else torch.as_tensor(base_options.denominator, dtype=dtype)
    )
    denominator = denominator if denominator > 0 else torch.ones_like(denominator)
    selector_sum = torch.where(kept, weights.to(dtype) * ce, 0.0).sum()
    loss = options.loss_weights.base * base + options.loss_weights.selector * selector_sum / denominator
    with torch.no_grad():
        hits = (ids.gather(-1, scores.argmax(-1, keepdim=True))[..., 0] == labels) & labelled
        loss_sum = options.loss_weights.base * base_stats.loss_sum + options.loss_weights.selector * selector_sum
        stats = block_stats(hits, labelled, loss_sum, base_stats.weight_sum, base_options.block_size, options.offset)
    return loss, stats


__all__ = ["reference_dflash2_loss", "reference_dspark_loss", "reference_loss"]
