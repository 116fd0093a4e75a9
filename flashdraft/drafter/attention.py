"""The drafter's attention: `attend`, the one place it calls a kernel (FlexAttention or SDPA), and
`structural_mask`, the mask of its causal and sliding-window layers."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | BlockMask | None,
    *,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention, (B, H, Q, d) x (B, Hkv, K, d) → (B, H, Q, d); `mask` True = attend.

    The one place the drafter calls an attention kernel. A FlexAttention `BlockMask` (training on the GPU,
    `train.masks.flex_block_mask`) runs compiled FlexAttention, which skips the masked-out blocks and reads K/V
    once per KV head; a boolean mask or None runs SDPA (the CPU path: FlexAttention has no backward on the CPU). No
    causal flag: every non-bidirectional pattern arrives as an explicit mask.
    """
    if isinstance(mask, BlockMask):
        return _flex(query, key, value, mask, scale=scale, dropout=dropout)
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1:
        # Native GQA only without a mask and with head_dim <= 256 (else SDPA falls back to its math kernel):
        # repeat K/V in the other cases, as transformers' SDPA integration does, so results match it exactly.
        if mask is None and key.shape[-1] <= 256:
            gqa = {"enable_gqa": True}
        else:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, **gqa)


FLEX_BLOCK = 128
"""FlexAttention's sparse block (tile) size, create_block_mask's default BLOCK_SIZE."""


def _flex(query, key, value, block_mask: BlockMask, *, scale: float, dropout: float) -> torch.Tensor:
    if dropout:
        raise ValueError(f"FlexAttention has no attention dropout (attention_dropout = {dropout}); use the SDPA path")
    # FlexAttention is no autocast op: q/k leave the fp32-weighted RMSNorms in fp32 while v is bf16, so cast all three
    # to what SDPA's autocast rule would use.
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    gqa = query.shape[1] != key.shape[1]
    # Inside a compiled region (train.compile) dynamo traces flex_attention itself; eager CUDA calls go through one
    # compiled wrapper (eager FlexAttention materialises every score); the CPU runs it eagerly (forward only).
    if torch.compiler.is_compiling() or device == "cpu":
        fn = flex_attention
    else:
        fn = _compiled_flex()
    # torch 2.11's forward lowering finds no valid kernel config for short query lengths (96 queries on an H200)
    # unless its tile is given; long sequences keep the tuned defaults.
    options = {"BLOCK_M": 64, "BLOCK_N": 64} if query.shape[-2] < FLEX_BLOCK else None
    with torch.autocast(device, enabled=False):
        return fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def structural_mask(
    q_len: int, k_len: int, *, causal: bool, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """The (1, 1, q_len, k_len) boolean mask of a causal and/or sliding-window layer.

    The queries are the last `q_len` of the `k_len` keys (context, possibly cached, then the block). Causal:
    a query sees keys at or before it. Sliding window w: keys less than w behind it and, when not causal,
    less than w ahead of it.
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
        if not causal:
            visible &= k_pos - q_pos < sliding_window
    return visible[None, None]
