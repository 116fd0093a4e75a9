"""The drafter's training input: anchors drawn in each response and one block of `block_size` tokens per anchor.

One training sequence of T tokens becomes one drafter sequence: T context features (the target's hidden states)
then A blocks of `block_size` tokens, one per anchor p_a, packed side by side (DFlash paper §4.2):

    anchors = sample_anchors(loss_mask[b], 512, bs, anchor_generator(seed, epoch, b))   # per sequence
    batch = build_blocks(input_ids, loss_mask, [anchors_0, ...], bs, mask_token_id)
    mask = drafter_mask(batch, drafter.config, kind)             # train/masks.py
    hidden = drafter(position_ids=batch.position_ids, attention_mask=mask,
                     noise_embedding=target.embed(batch.block_ids), target_hidden=target.capture(input_ids))
    loss, stats = dflash_loss(hidden, target.lm_head_weight, batch.labels, batch.weights, block_size=bs)

Decisions (each is what inference does, so that training and serving see the same thing):
- An anchor p is a response token (`loss_mask[p]`) whose next token is one too (every block has a label), with
  p >= 1 (the target has always prefilled at least one token before the first anchor) and room for the whole
  block (its last label at p + bs - 1 + offset <= T - 1).
- Block a holds the token at its anchor, then MASK tokens. Slot k predicts the token at p_a + k + offset: with
  offset 0 (DFlash) slot 0, the anchor, predicts nothing and slots 1 … bs − 1 draft the tokens at their own
  positions; with offset 1 (DSpark's convention, `sample_from_anchor`) the anchor's slot drafts the next token
  and every slot drafts the token after its position, so a block of bs gives bs drafts. Labels are those tokens
  when they are response tokens, weighted w = exp(-(j - 1) / γ) at label distance j = k + offset from the anchor
  (train/loss/ sums Σ w·ℓ / Σ w).
- With `recipe.reveal`, some blocks show the tokens at p + 1 … p + r in slots 1 … r in place of MASK
  (`sample_reveals`): what a block drafted in several passes sees when its kept drafts are right, the only case in
  which later drafts count. Those tokens are inputs, not labels, and the labels after them are weighted from the
  first hidden one: w = exp(-(j - 1 - r) / γ).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
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


def anchor_candidates(loss_mask: torch.Tensor, block_size: int, offset: int = 0) -> torch.Tensor:
    """Every position p that may anchor a block (see the module docstring), ascending, as a LongTensor."""
    if loss_mask.ndim != 1:
        raise ValueError(f"loss_mask must be (T,), got shape {tuple(loss_mask.shape)}")
    response = loss_mask.bool()
    length = response.numel()
    last = length - block_size - offset  # p + bs - 1 + offset <= T - 1
    if last < 1:
        return torch.empty(0, dtype=torch.long, device=loss_mask.device)
    p = torch.arange(1, last + 1, device=loss_mask.device)
    return p[response[1 : last + 1] & response[2 : last + 2]]


ANCHOR_SAMPLING = ("uniform", "stratified")


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    how: str = "uniform",
    offset: int = 0,
) -> torch.Tensor:
    """Up to `num_anchors` distinct anchor positions among `anchor_candidates`, sorted → (A,).

    how: "uniform" draws them uniformly at random; "stratified" cuts the (ascending) candidates into `num_anchors`
    runs of equal length (±1) and draws one uniformly in each, so the blocks cover the whole response. Fewer when
    there are fewer candidates (all of them are then taken); zero is possible (a short or prompt-only sequence).
    `generator` is a CPU generator, e.g. `anchor_generator(seed, epoch, sample_index)`.
    """
    if how not in ANCHOR_SAMPLING:
        raise ValueError(f"anchor sampling {how!r}: must be one of {', '.join(ANCHOR_SAMPLING)}")
    candidates = anchor_candidates(loss_mask, block_size, offset)
    count = candidates.numel()
    if count <= num_anchors:
        return candidates
    if how == "stratified":
        bounds = torch.arange(num_anchors + 1) * count // num_anchors  # run a: [bounds[a], bounds[a + 1])
        offsets = (torch.rand(num_anchors, generator=generator, dtype=torch.float64) * bounds.diff()).long()
        return candidates[(bounds[:-1] + offsets).to(candidates.device)]
    pick = torch.randperm(count, generator=generator)[:num_anchors].to(candidates.device)
    return candidates[pick].sort().values


def sample_reveals(count: int, block_size: int, fraction: float, generator: torch.Generator | None = None):
    """(count,) how many drafted positions each block reveals: 0, or with probability `fraction` a number drawn
    uniformly from 1 … block_size − 2 (at least one position stays hidden to learn)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"reveal fraction must be in [0, 1), got {fraction}")
    if fraction == 0 or block_size < 3:
        return torch.zeros(count, dtype=torch.long)
    chosen = torch.rand(count, generator=generator) < fraction
    sizes = torch.randint(1, block_size - 1, (count,), generator=generator)
    return torch.where(chosen, sizes, 0)


# ---- packed blocks ---------------------------------------------------------------------------------------------


@dataclass
class DraftBatch:
    """A batch of packed blocks, A per sequence; Q = A * block_size query tokens after T context positions."""

    block_ids: torch.Tensor
    """(B, Q) [token at the anchor, MASK x (bs - 1)] per block (the first r MASKs replaced by their tokens in a
    block that reveals r); MASK only for padding blocks."""
    position_ids: torch.Tensor
    """(B, T + Q) 0..T-1 for the context, then p_a + k for block a."""
    labels: torch.Tensor
    """(B, Q) the token at p_a + k for k >= 1 when it is a response token inside the sequence, else -100."""
    weights: torch.Tensor
    """(B, Q) float32 exp(-(k - 1) / γ) where labels are valid, 0 elsewhere."""
    anchors: torch.Tensor
    """(B, A) anchor positions; PAD_ANCHOR (-1) for padding blocks of sequences with fewer anchors."""
    block_size: int
    offset: int = 0
    """What slot k drafts: the token at p + k + offset (0: DFlash's convention; 1: the anchor's slot drafts too)."""

    @property
    def ctx_len(self) -> int:
        return self.position_ids.shape[1] - self.block_ids.shape[1]

    @property
    def label_positions(self) -> torch.Tensor:
        """(B, Q) the sequence position each query's label comes from (valid where `labels` is set)."""
        return self.position_ids[:, self.ctx_len :] + self.offset

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
        return DraftBatch(**moved, block_size=self.block_size, offset=self.offset)


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
    reveals: Sequence[torch.Tensor] | None = None,
    offset: int = 0,
) -> DraftBatch:
    """Pack one block per anchor (see `DraftBatch`); `gamma` defaults to `gamma_for(block_size + offset)`.

    `input_ids`/`loss_mask` are (B, T), right-padded (padding has loss_mask 0). `anchors` is a list of per-sequence
    (A_b,) tensors (e.g. from `sample_anchors`) or a (B, A) tensor padded with PAD_ANCHOR. `num_blocks` pads every
    sequence to that many blocks (static shapes); by default, to the most anchors of any sequence. `reveals`: per
    sequence, how many drafted positions each of its blocks reveals (`sample_reveals`, one per anchor); default none.
    `offset`: what each slot drafts (`DraftBatch.offset`).
    """
    if offset not in (0, 1):
        raise ValueError(f"offset must be 0 (DFlash) or 1 (the anchor's slot drafts too), got {offset}")
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
    # The decay of as many drafts as a DFlash block of block_size + offset has.
    gamma = gamma_for(block_size + offset) if gamma is None else float(gamma)
    num_blocks = anchors.shape[1]

    k = torch.arange(block_size, device=device)
    base = anchors.clamp(min=0)[..., None]
    pos = base + k  # (B, A, bs)

    def at(positions):  # tokens, response flags and inside-the-sequence flags at (B, A, bs) positions
        safe = positions.clamp(max=length - 1).view(batch, -1)
        shape = (batch, num_blocks, block_size)
        return (
            input_ids.gather(1, safe).view(shape),
            loss_mask.bool().gather(1, safe).view(shape),
            positions < length,
        )

    inputs, input_response, input_inside = at(pos)
    j = k + offset  # each slot's label distance from the anchor
    targets, target_response, target_inside = at(base + j)
    revealed = torch.zeros_like(anchors)
    if reveals is not None:
        if len(reveals) != batch or any(r.numel() != a for r, a in zip(reveals, valid.sum(1).tolist(), strict=True)):
            raise ValueError("reveals must give one count per anchor of each sequence")
        revealed = pad_anchors(reveals, device, num_blocks).clamp(min=0)  # as wide as the anchors, padded with 0
    # Revealed tokens p + 1 … p + r are inputs at slots 1 … r, never labels.
    shown = valid[..., None] & input_inside & input_response & (k >= 1) & (k <= revealed[..., None])
    labelled = valid[..., None] & target_inside & target_response & (j >= 1) & (j > revealed[..., None])

    block_ids = torch.where(shown, inputs, mask_token_id)
    block_ids[..., 0] = torch.where(valid, inputs[..., 0], mask_token_id)
    decay = torch.exp(-(j - 1 - revealed[..., None]).clamp(min=0).float() / gamma)
    context_pos = torch.arange(length, device=device).expand(batch, -1)
    return DraftBatch(
        block_ids=block_ids.view(batch, -1),
        position_ids=torch.cat([context_pos, pos.view(batch, -1)], dim=1),
        labels=torch.where(labelled, targets, IGNORE_INDEX).view(batch, -1),
        weights=torch.where(labelled, decay, 0.0).view(batch, -1),
        anchors=anchors,
        block_size=block_size,
        offset=offset,
    )


def before_labels(states: torch.Tensor, batch: DraftBatch) -> torch.Tensor:
    """(B, T, ...) per-token values → (B, Q, ...) the value one position before each query's label: the target's
    state where it predicts that label, or (for token ids) the true token before it. Queries without a label read a
    clamped position; their rows are never used."""
    positions = (batch.label_positions - 1).clamp(0, states.shape[1] - 1)
    if states.dim() == 2:
        return states.gather(1, positions)
    return states.gather(1, positions[..., None].expand(-1, -1, states.shape[-1]))


__all__ = [
    "ANCHOR_SAMPLING",
    "IGNORE_INDEX",
    "PAD_ANCHOR",
    "DraftBatch",
    "anchor_candidates",
    "anchor_generator",
    "before_labels",
    "build_blocks",
    "gamma_for",
    "pad_anchors",
    "sample_anchors",
    "sample_reveals",
]
