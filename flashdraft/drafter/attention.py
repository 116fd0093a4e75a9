"""The drafter's attention: `DFlashAttention` (queries from the block, keys and values from the context and the
block), `attend`, the one place it calls a kernel (FlexAttention or SDPA), and `structural_mask`, the mask of its
causal and sliding-window layers."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, rotate_half


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from `concat(context, block)`; q/k RMSNorm; RoPE on both."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # The reference's rule: sliding-window layers are causal, full-attention layers bidirectional, unless the
        # config sets `is_causal` for all layers.
        layer_type = (config.layer_types or ["full_attention"] * config.num_hidden_layers)[layer_idx]
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | BlockMask | None = None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        batch, q_len = hidden_states.shape[:2]
        kv_len = context.shape[1] + q_len
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        # Context and block are projected separately (never concatenated before the projection) so that the
        # context rows can be cached and the result matches the reference bit for bit.
        key = torch.cat([self.k_proj(context), self.k_proj(hidden_states)], dim=1)
        value = torch.cat([self.v_proj(context), self.v_proj(hidden_states)], dim=1)
        key = self.k_norm(key.view(batch, kv_len, -1, self.head_dim)).transpose(1, 2)
        value = value.view(batch, kv_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        query = _rotate(query, cos[..., -q_len:, :], sin[..., -q_len:, :])
        key = _rotate(key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = structural_mask(
                q_len, key.shape[2], causal=self.is_causal, sliding_window=self.sliding_window, device=key.device
            )
        dropout = self.attention_dropout if self.training else 0.0
        out = attend(query, key, value, attention_mask, scale=self.scaling, dropout=dropout)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))
