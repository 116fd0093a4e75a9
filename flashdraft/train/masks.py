"""The drafter's attention mask in training: which keys each block's queries see, as a dense mask or a BlockMask.

    kind = attention_kind(cfg.train.attention, device)   # "flex" or "sdpa"; auto: flex on CUDA, sdpa elsewhere
    mask = drafter_mask(batch, drafter.config, kind)      # a FlexAttention BlockMask, or the dense boolean mask

Keys are [context (T positions) ; blocks]. The rule is what inference does, so that training and serving see the
same thing: block a's queries see context keys at positions < p_a (the target state of p_a itself is what the
verifier produces *after* the draft), their whole block both ways, never another block. Padding blocks (anchor -1)
see only themselves, so no row of the dense mask is empty (SDPA returns NaN for an all-False row), and nobody sees
them. Sliding-window drafter layers add their window and causality inside the block (`layer_mask_rules`).

Both masks apply the one predicate `_visible` (the BlockMask sorts its tiles into empty, partial and full by the
same rule written as key intervals, `visible_block_counts`, tested against it). FlexAttention skips the masked-out
blocks (a block sees only the context before its anchor: ~15% of the dense scores at 512 anchors over 3072 tokens)
and reads K/V once per KV head; its backward does not run on the CPU, where the dense mask with SDPA is the path
(cheap at CPU sizes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashdraft.drafter.attention import FLEX_BLOCK
from flashdraft.train.blocks import DraftBatch

ATTENTION = ("auto", "flex", "sdpa")


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


def flex_block_mask(batch: DraftBatch, ctx_len: int | None = None, *, window: int | None = None, causal: bool = False):
    """The same mask as a FlexAttention `BlockMask`, built on the batch's device (GPU training path).

    Built from each query's visible key intervals (`visible_block_counts`), not by evaluating the predicate on
    every (query, key) pair as `create_block_mask` does: that materialises (Q, T + Q) index tensors eagerly
    (gigabytes at 32K tokens) and compiled costs minutes of Triton compile on a fresh machine. The BlockMask holds
    the same blocks and the same `mask_mod` for the partial ones (tests/train/test_masks.py compares them).
    """
    from torch.nn.attention.flex_attention import BlockMask

    ctx_len = batch.ctx_len if ctx_len is None else ctx_len
    queries = batch.block_ids.shape[1]
    seen = visible_block_counts(batch, ctx_len, window=window, causal=causal)
    full = seen == FLEX_BLOCK**2  # every query of the 128-row tile sees every key of the 128-key tile
    partial = (seen > 0) & ~full
    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=block_mask_mod(batch, ctx_len, window=window, causal=causal),
        seq_lengths=(queries, ctx_len + queries),
    )


def visible_block_counts(
    batch: DraftBatch, ctx_len: int, *, window: int | None = None, causal: bool = False
) -> torch.Tensor:
    """Visible (query, key) pairs per 128 x 128 tile (FLEX_BLOCK), shape (B, 1, Q tiles, KV tiles).

    Under `_visible` each query sees two intervals of keys: the context [lo, anchor) (lo = 0, or the window's
    start) and a stretch of its own block. Counting their overlap with every key tile takes (Q, KV tiles) work, not
    (Q, T + Q). Query rows past Q and key columns past T + Q count as unseen, as create_block_mask pads them.
    """
    bs, device = batch.block_size, batch.anchors.device
    queries = batch.block_ids.shape[1]
    kv_len = ctx_len + queries
    q_idx = torch.arange(queries, device=device)
    q_k = q_idx % bs
    anchor = batch.anchors.repeat_interleave(bs, dim=1).long()  # (B, Q)
    ctx_hi = anchor.clamp(0, ctx_len)
    ctx_lo = torch.zeros_like(ctx_hi) if window is None else (anchor + q_k - window + 1).clamp(0, ctx_len)
    own = ctx_len + (q_idx - q_k)  # the key index of the query's block's first position
    blk_lo = own + (0 if window is None else (q_k - window + 1).clamp(min=0))
    if causal:
        blk_hi = own + q_k + 1
    else:
        blk_hi = own + (bs if window is None else (q_k + window).clamp(max=bs))
    kv_tiles = -(-kv_len // FLEX_BLOCK)
    tile_lo = torch.arange(kv_tiles, device=device) * FLEX_BLOCK  # (KV tiles,)
    tile_hi = tile_lo + FLEX_BLOCK

    def overlap(lo, hi):  # (B or 1, Q) intervals against every tile: (B, Q, KV tiles)
        lo, hi = lo[..., None], hi[..., None]
        return (torch.minimum(hi, tile_hi) - torch.maximum(lo, tile_lo)).clamp(min=0)

    per_query = overlap(ctx_lo, ctx_hi) + overlap(blk_lo, blk_hi).expand(anchor.shape[0], -1, -1)
    q_tiles = -(-queries // FLEX_BLOCK)
    padded = torch.nn.functional.pad(per_query, (0, 0, 0, q_tiles * FLEX_BLOCK - queries))
    seen = padded.view(anchor.shape[0], q_tiles, FLEX_BLOCK, kv_tiles).sum(2)
    return seen[:, None]


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A boolean (B, H, Q tiles, KV tiles) as BlockMask's (count, indices): each row's True tiles first, in order."""
    count = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, indices


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


def attention_kind(setting: str, device: torch.device) -> str:
    """`train.attention` resolved for `device`: "flex" or "sdpa"."""
    if setting not in ATTENTION:
        raise ValueError(f"train.attention = {setting!r}: must be one of {', '.join(ATTENTION)}")
    if setting == "auto":
        # Compiled FlexAttention at static shapes (train.static_shapes): on the H200 it matches the SDPA path's
        # losses step for step and skips the masked-out blocks.
        return "flex" if device.type == "cuda" else "sdpa"
    if setting == "flex" and device.type != "cuda":
        raise ValueError(
            f"train.attention = flex needs a CUDA device (training on {device.type}): FlexAttention has "
            "no backward on the CPU; use auto or sdpa"
        )
    return setting


def mask_rule(config) -> dict:
    """The `window`/`causal` rule all drafter layers share (`layer_mask_rules`); one training mask serves them all."""
    rules = layer_mask_rules(config)
    distinct = {tuple(sorted(r.items())) for r in rules}
    if len(distinct) > 1:
        raise ValueError(
            f"drafter layers mix attention rules {rules}: one training mask cannot serve them all; give "
            "every layer the same type (drafter.overrides.layer_types)"
        )
    return rules[0]


def drafter_mask(batch: DraftBatch, config, kind: str):
    """The drafter's `attention_mask` for `batch`: a FlexAttention `BlockMask` ("flex") or a dense boolean mask."""
    rule = mask_rule(config)
    if kind == "flex":
        # Built once per micro-batch and shared by every layer.
        return flex_block_mask(batch, **rule)
    return dense_block_mask(batch, **rule)


__all__ = [
    "ATTENTION",
    "attention_kind",
    "block_mask_mod",
    "dense_block_mask",
    "drafter_mask",
    "flex_block_mask",
    "layer_mask_rules",
    "mask_rule",
    "visible_block_counts",
]
