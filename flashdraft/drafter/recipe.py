"""The DFlash training recipe (the DFlash paper, §4.2): anchors, packed blocks, the block mask, the weighted loss.

One training sequence of T tokens becomes one drafter sequence: T context features (the target's hidden states)
then A blocks of `block_size` tokens, one per anchor p_a, packed side by side:

    anchors = sample_anchors(loss_mask[b], 512, bs, anchor_generator(seed, epoch, b))   # per sequence
    batch = build_blocks(input_ids, loss_mask, [anchors_0, ...], bs, mask_token_id)
    mask = dense_block_mask(batch)                      # CPU; flex_block_mask(batch) on the GPU
    hidden = drafter(position_ids=batch.position_ids, attention_mask=mask,
                     noise_embedding=target.embed(batch.block_ids), target_hidden=target.capture(input_ids))
    loss, stats = dflash_loss(hidden, target.lm_head_weight, batch.labels, batch.weights, block_size=bs)

Decisions (each is what inference does, so that training and serving see the same thing):
- An anchor p is a response token (`loss_mask[p]`) whose next token is one too (every block has a label), with
  p >= 1 (the target has always prefilled at least one token before the first anchor) and room for the whole
  block (p + bs - 1 <= T - 1).
- Block a's queries see context keys at positions < p_a (the target state of p_a itself is what the verifier
  produces *after* the draft), their whole block both ways, never another block. Padding blocks (anchor -1) see
  only themselves, so no row of the dense mask is empty (SDPA returns NaN for an all-False row), and nobody sees
  them.
- The loss is Σ w·CE / Σ w over the labelled positions (k >= 1 whose token is a response token), with
  w_k = exp(-(k - 1) / γ); `denominator=` lets a caller normalise over a whole optimizer step instead.
- τ: `simulated_tau` = 1 + Σ_k Π_{j<=k} acc_j counts the bonus token, like the acceptance length measured at
  inference; `expected_accepted` = Σ_k Π_{j<=k} acc_j counts drafted tokens only.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

IGNORE_INDEX = -100
PAD_ANCHOR = -1
# The paper's γ per block size (App. A.1).
_PAPER_GAMMA = ((8, 4.0), (10, 5.0), (16, 7.0))


# ---- anchors ---------------------------------------------------------------------------------------------------


def gamma_for(block_size: int) -> float:
    """Loss-decay γ: 7 for bs 16, 5 for 10, 4 for 8 (the paper); piecewise linear between those points and
    extrapolated with the nearest segment's slope outside them (bs 4 → 2, bs 32 → 12.33), never below 1."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    points = _PAPER_GAMMA
    if block_size <= points[1][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    else:
        (x0, y0), (x1, y1) = points[1], points[2]
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def anchor_generator(seed: int, epoch: int, sample_index: int) -> torch.Generator:
    """A CPU generator seeded by (seed, epoch, sample index): anchors differ per epoch, and a resumed run or
    another rank draws exactly the same ones for the same sample."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{sample_index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def anchor_candidates(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every position p that may anchor a block (see the module docstring), ascending, as a LongTensor."""
    if loss_mask.ndim != 1:
        raise ValueError(f"loss_mask must be (T,), got shape {tuple(loss_mask.shape)}")
    response = loss_mask.bool()
    length = response.numel()
    last = length - block_size  # p + bs - 1 <= T - 1
    if last < 1:
        return torch.empty(0, dtype=torch.long, device=loss_mask.device)
    p = torch.arange(1, last + 1, device=loss_mask.device)
    return p[response[1 : last + 1] & response[2 : last + 2]]


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to `num_anchors` distinct anchor positions drawn uniformly from `anchor_candidates`, sorted → (A,).

    Fewer when there are fewer candidates (all of them are then taken); zero is possible (a short or prompt-only
    sequence). `generator` is a CPU generator, e.g. `anchor_generator(seed, epoch, sample_index)`.
    """
    candidates = anchor_candidates(loss_mask, block_size)
    if candidates.numel() <= num_anchors:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors].to(candidates.device)
    return candidates[pick].sort().values


# ---- packed blocks ---------------------------------------------------------------------------------------------


@dataclass
class DraftBatch:
    """A batch of packed blocks, A per sequence; Q = A * block_size query tokens after T context positions."""

    block_ids: torch.Tensor
    """(B, Q) [token at the anchor, MASK x (bs - 1)] per block; MASK only for padding blocks."""
    position_ids: torch.Tensor
    """(B, T + Q) 0..T-1 for the context, then p_a + k for block a."""
    labels: torch.Tensor
    """(B, Q) the token at p_a + k for k >= 1 when it is a response token inside the sequence, else -100."""
    weights: torch.Tensor
    """(B, Q) float32 exp(-(k - 1) / γ) where labels are valid, 0 elsewhere."""
    anchors: torch.Tensor
    """(B, A) anchor positions; PAD_ANCHOR (-1) for padding blocks of sequences with fewer anchors."""
    block_size: int

    @property
    def ctx_len(self) -> int:
        return self.position_ids.shape[1] - self.block_ids.shape[1]

    @property
    def block_valid(self) -> torch.Tensor:
        """(B, A) True for real blocks."""
        return self.anchors >= 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DraftBatch:
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return DraftBatch(**moved, block_size=self.block_size)


def pad_anchors(
    anchors: Sequence[torch.Tensor] | torch.Tensor, device: torch.device | None = None, width: int | None = None
) -> torch.Tensor:
    """Per-sequence anchor lists → (B, A) with PAD_ANCHOR after each list; A >= 1 so shapes never degenerate.
    `width` fixes A (static shapes); by default it is the longest list."""
    if isinstance(anchors, torch.Tensor):
        if anchors.ndim != 2:
            raise ValueError(f"anchors must be (B, A) or a list of (A_b,) tensors, got shape {tuple(anchors.shape)}")
        if width is None:
            return anchors.long() if device is None else anchors.long().to(device)
        anchors = [row[row != PAD_ANCHOR] for row in anchors]
    longest = max([1, *(a.numel() for a in anchors)])
    if width is not None and width < longest:
        raise ValueError(f"a sequence has {longest} anchors, more than the {width} blocks asked for")
    width = longest if width is None else width
    out = torch.full((len(anchors), width), PAD_ANCHOR, dtype=torch.long, device=device)
    for row, a in enumerate(anchors):
        out[row, : a.numel()] = a.to(out.device)
    return out


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: Sequence[torch.Tensor] | torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
    num_blocks: int | None = None,
) -> DraftBatch:
    """Pack one block per anchor (see `DraftBatch`); `gamma` defaults to `gamma_for(block_size)`.

    `input_ids`/`loss_mask` are (B, T), right-padded (padding has loss_mask 0). `anchors` is a list of per-sequence
    (A_b,) tensors (e.g. from `sample_anchors`) or a (B, A) tensor padded with PAD_ANCHOR. `num_blocks` pads every
    sequence to that many blocks (static shapes); by default, to the most anchors of any sequence.
    """
    if input_ids.shape != loss_mask.shape or input_ids.ndim != 2:
        raise ValueError(
            f"input_ids and loss_mask must both be (B, T), got {tuple(input_ids.shape)} and {tuple(loss_mask.shape)}"
        )
    device = input_ids.device
    batch, length = input_ids.shape
    anchors = pad_anchors(anchors, device, num_blocks)
    if anchors.shape[0] != batch:
        raise ValueError(f"anchors are given for {anchors.shape[0]} sequences, input_ids has {batch}")
    valid = anchors >= 0
    if bool((anchors[valid] >= length).any()) or bool((anchors < PAD_ANCHOR).any()):
        raise ValueError(f"anchors must lie in [0, {length - 1}] (or be {PAD_ANCHOR} for padding), got {anchors}")
    gamma = gamma_for(block_size) if gamma is None else float(gamma)
    num_blocks = anchors.shape[1]

    k = torch.arange(block_size, device=device)
    pos = anchors.clamp(min=0)[..., None] + k  # (B, A, bs)
    inside = pos < length
    safe = pos.clamp(max=length - 1).view(batch, -1)
    tokens = input_ids.gather(1, safe).view(batch, num_blocks, block_size)
    response = loss_mask.bool().gather(1, safe).view(batch, num_blocks, block_size)
    labelled = valid[..., None] & inside & response & (k >= 1)

    block_ids = torch.full_like(tokens, mask_token_id)
    block_ids[..., 0] = torch.where(valid, tokens[..., 0], mask_token_id)
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma)
    context_pos = torch.arange(length, device=device).expand(batch, -1)
    return DraftBatch(
        block_ids=block_ids.view(batch, -1),
        position_ids=torch.cat([context_pos, pos.view(batch, -1)], dim=1),
        labels=torch.where(labelled, tokens, IGNORE_INDEX).view(batch, -1),
        weights=torch.where(labelled, decay, 0.0).view(batch, -1),
        anchors=anchors,
        block_size=block_size,
    )


# ---- the block mask --------------------------------------------------------------------------------------------


def _visible(
    anchor: torch.Tensor,
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    *,
    ctx_len: int,
    block_size: int,
    window: int | None,
    causal: bool,
) -> torch.Tensor:
    """The one predicate both masks use: may query `q_idx` (in the block anchored at `anchor`) see key `kv_idx`?

    Keys are [context (ctx_len) ; blocks]. Elementwise only, so it serves broadcast tensors and FlexAttention's
    scalar `mask_mod` alike.
    """
    q_block, q_k = q_idx // block_size, q_idx % block_size
    in_context = kv_idx < ctx_len
    kv_block, kv_k = (kv_idx - ctx_len) // block_size, (kv_idx - ctx_len) % block_size
    see_context = in_context & (kv_idx < anchor)
    see_block = ~in_context & (kv_block == q_block)
    if causal:
        see_block = see_block & (kv_k <= q_k)
    if window is not None:
        # Positions: the query sits at anchor + q_k, a context key at kv_idx, a block key at anchor + kv_k.
        see_context = see_context & (anchor + q_k - kv_idx < window)
        see_block = see_block & (q_k - kv_k < window)
        if not causal:
            see_block = see_block & (kv_k - q_k < window)
    return see_context | see_block


def dense_block_mask(
    batch: DraftBatch, ctx_len: int | None = None, *, window: int | None = None, causal: bool = False
) -> torch.Tensor:
    """Boolean (B, 1, Q, T + Q), True = attend: the drafter's `attention_mask` for SDPA (CPU training path).

    `window`/`causal` reproduce what a sliding-window drafter layer does at inference (`structural_mask`: causal
    inside the block, keys less than `window` positions behind the query). A mask passed to the drafter replaces
    every layer's own rule, so one mask fits only drafters whose layers share a rule: see `layer_mask_rules`.
    """
    ctx_len = batch.ctx_len if ctx_len is None else ctx_len
    device = batch.anchors.device
    queries = batch.block_ids.shape[1]
    anchor = batch.anchors.repeat_interleave(batch.block_size, dim=1)[:, :, None]  # (B, Q, 1)
    q_idx = torch.arange(queries, device=device)[None, :, None]
    kv_idx = torch.arange(ctx_len + queries, device=device)[None, None, :]
    rule = dict(ctx_len=ctx_len, block_size=batch.block_size, window=window, causal=causal)
    return _visible(anchor, q_idx, kv_idx, **rule)[:, None]


def block_mask_mod(
    batch: DraftBatch, ctx_len: int | None = None, *, window: int | None = None, causal: bool = False
) -> Callable:
    """FlexAttention `mask_mod(b, h, q_idx, kv_idx)` with exactly the predicate of `dense_block_mask`."""
    ctx_len = batch.ctx_len if ctx_len is None else ctx_len
    anchors, block_size = batch.anchors, batch.block_size
    rule = dict(ctx_len=ctx_len, block_size=block_size, window=window, causal=causal)

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(anchors[b, q_idx // block_size], q_idx, kv_idx, **rule)

    return mask_mod


def flex_block_mask(
    batch: DraftBatch,
    ctx_len: int | None = None,
    *,
    window: int | None = None,
    causal: bool = False,
    compile: bool = False,
):
    """The same mask as a FlexAttention `BlockMask`, built on the batch's device (GPU training path).

    `compile=True` builds it with torch.compile (worth it for long sequences on the GPU; ~30 s on a CPU).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    ctx_len = batch.ctx_len if ctx_len is None else ctx_len
    queries = batch.block_ids.shape[1]
    return create_block_mask(
        block_mask_mod(batch, ctx_len, window=window, causal=causal),
        B=batch.anchors.shape[0],
        H=None,
        Q_LEN=queries,
        KV_LEN=ctx_len + queries,
        device=batch.anchors.device,
        _compile=compile,
    )


def layer_mask_rules(config) -> list[dict]:
    """Per drafter layer, the `window`/`causal` arguments that reproduce its inference-time attention.

    Mirrors `DFlashAttention`: "sliding_attention" layers are causal with `sliding_window`, full layers see all
    (unless the config sets `is_causal`). When the layers disagree, a single mask cannot serve them all: build one
    mask per distinct rule and give each layer its own (the drafter's forward takes one mask today).
    """
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    is_causal = getattr(config, "is_causal", None)
    rules = []
    for layer_type in layer_types:
        sliding = layer_type == "sliding_attention"
        causal = sliding if is_causal is None else bool(is_causal)
        rules.append({"window": config.sliding_window if sliding else None, "causal": causal})
    return rules


# ---- the loss --------------------------------------------------------------------------------------------------


@dataclass
class LossStats:
    """Counts, summable across steps and ranks (all tensors, on the loss's device: no host sync)."""

    loss_sum: torch.Tensor
    """Σ w·CE over labelled positions (float32 scalar)."""
    weight_sum: torch.Tensor
    """Σ w over labelled positions (float32 scalar)."""
    correct: torch.Tensor
    """(bs,) argmax == label per block position k (k = 0 is never labelled: 0)."""
    valid: torch.Tensor
    """(bs,) labelled positions per k."""
    accepted: torch.Tensor
    """Σ over blocks of the leading run of correct labelled positions (what greedy verification would accept)."""
    blocks: torch.Tensor
    """Number of blocks with at least one labelled position."""

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def accuracy(self) -> torch.Tensor:
        """(bs - 1,) accuracy at k = 1..bs-1 (0 where nothing was labelled)."""
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
    if hidden.shape[:2] != labels.shape or labels.shape != weights.shape:
        raise ValueError(
            f"expected hidden (B, Q, D) with labels and weights (B, Q); got {tuple(hidden.shape)}, "
            f"{tuple(labels.shape)}, {tuple(weights.shape)}"
        )
    if hidden.shape[-1] != lm_head_weight.shape[-1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != LM head input size {lm_head_weight.shape[-1]}")
    batch, queries = labels.shape
    if queries % block_size:
        raise ValueError(f"Q = {queries} query positions is not a multiple of block_size {block_size}")
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
        hits = torch.zeros(batch * queries, dtype=torch.bool, device=labels.device)
        hits[rows] = correct
        hits = hits.view(batch, -1, block_size)
        shaped = labelled.view(batch, -1, block_size)
        # A block's accepted run: labelled-and-correct positions from k = 1 up to the first miss.
        run = torch.cumprod((hits & shaped)[..., 1:].long(), dim=-1).sum(-1)
        stats = LossStats(
            loss_sum=loss_sum.detach().float(),
            weight_sum=weight_sum.detach(),
            correct=(hits & shaped).sum(dim=(0, 1)),
            valid=shaped.sum(dim=(0, 1)),
            accepted=run.sum(),
            blocks=shaped[..., 1:].any(-1).sum(),
        )
    return loss, stats


__all__ = [
    "IGNORE_INDEX",
    "PAD_ANCHOR",
    "DraftBatch",
    "LinearCrossEntropyFunction",
    "LossStats",
    "anchor_candidates",
    "anchor_generator",
    "block_mask_mod",
    "build_blocks",
    "dense_block_mask",
    "dflash_loss",
    "expected_accepted",
    "flex_block_mask",
    "gamma_for",
    "layer_mask_rules",
    "pad_anchors",
    "sample_anchors",
    "simulated_tau",
]
