"""Plain-PyTorch reference of the causal depthwise conv1d (the semantics of causal-conv1d 1.7.0).

Runs on any device and dtype (float64 included) and is differentiable by autograd; the tests compare the
Triton kernels against it in float64. Shapes: `B` batch, `D` channels, `L` length, `W` kernel width.

    y[b, d, t] = act(bias[d] + sum_k weight[d, W-1-k] * x[b, d, t-k])

where `x[b, d, p]` for `p < 0` is `initial_states[b, d, W-1+p]` (zero without initial states). With `seq_idx`,
`x[t-k]` contributes to `y[t]` only if `seq_idx[t-k] == seq_idx[t]` (initial states belong to the sequence of
position 0), and `y[t] = 0` wherever `seq_idx[t] < 0` (padding; bias and activation included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class UnsupportedActivationError(ValueError, NotImplementedError):
    """Raised for an activation other than None, "silu" or "swish".

    A ValueError, and also the NotImplementedError that causal-conv1d raises, so callers written for either work.
    """


def check_activation(activation: str | None) -> bool:
    """Returns whether `activation` is SiLU; raises for anything but None, "silu" and "swish"."""
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise UnsupportedActivationError(f"expected activation None, 'silu' or 'swish', got {activation!r}")


def _work_dtype(*dtypes: torch.dtype) -> torch.dtype:
    # Half-precision inputs accumulate in float32, like the kernels; float64 stays float64.
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
):
    """Reference of `causal_conv1d_fn`.

    Args:
        x: `[B, D, L]`, any memory layout.
        weight: `[D, W]`.
        bias: `[D]` or None.
        seq_idx: `[B, L]` integer sequence ids of packed sequences; negative ids are padding.
        initial_states: `[B, D, W-1]`, the inputs before position 0.
        return_final_states: also return the last `W-1` inputs, `[B, D, W-1]`.
        final_states_out: `[B, D, W-1]` tensor the final states are copied into (and returned).
        activation: None, "silu" or "swish".

    Returns:
        y `[B, D, L]` in the dtype of x, or `(y, final_states)`.
    """
    silu = check_activation(activation)
    if seq_idx is not None and return_final_states:
        raise ValueError("expected return_final_states=False with seq_idx (as causal-conv1d), got True")
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    work = _work_dtype(x.dtype, weight.dtype)
    xw = x.to(work)
    if initial_states is None:
        head = xw.new_zeros(batch, dim, width - 1)
    else:
        head = initial_states.to(work)
    xx = torch.cat([head, xw], dim=-1)  # [B, D, W-1+L]
    windows = xx.unfold(-1, width, 1)  # [B, D, L, W]
    if seq_idx is not None:
        seq_idx = seq_idx.long()
        if initial_states is None:
            head_ids = seq_idx.new_full((batch, width - 1), -1)
        else:
            head_ids = seq_idx[:, :1].expand(-1, width - 1)
        ids = torch.cat([head_ids, seq_idx], dim=-1).unfold(-1, width, 1)  # [B, L, W]
        same = (ids == seq_idx.unsqueeze(-1)).to(work)
        windows = windows * same.unsqueeze(1)
    y = (windows * weight.to(work)[None, :, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.to(work)[None, :, None]
    if seq_idx is not None:
        y = y.masked_fill((seq_idx < 0).unsqueeze(1), 0.0)
    if silu:
        y = F.silu(y)
    y = y.to(x.dtype)
    if not return_final_states:
        return y
    final_states = xx[..., seqlen:].to(x.dtype)  # the last W-1 inputs, initial states included
    if final_states_out is not None:
        final_states_out.copy_(final_states)
        final_states = final_states_out
    return y, final_states


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of `causal_conv1d_update` in plain PyTorch, on any device and dtype (float64 included); updates the
    rows of `conv_state` it selects in place.

    Args:
        x: `[B, D]` or `[B, D, L]`, the new inputs.
        conv_state: `[B_cache, D, S]` with `S >= W-1`; row `conv_state_indices[b]` (or `b`) belongs to batch row b.
            Without `cache_seqlens` it holds the last S inputs (shifted left by L, new inputs appended);
            with it, a circular buffer written from position `cache_seqlens[b] % S`.
        weight: `[D, W]`.
        bias: `[D]` or None.
        activation: None, "silu" or "swish".
        cache_seqlens: `[B]` integer, number of tokens already in each row's buffer.
        conv_state_indices: `[B]` integer cache row per batch row; a negative index is a padding row:
            its output is 0 and no state is touched.

    Returns:
        y, same shape and dtype as x.
    """
    silu = check_activation(activation)
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    state_len = conv_state.shape[-1]
    work = _work_dtype(x.dtype, weight.dtype)
    if conv_state_indices is None:
        rows = torch.arange(batch, device=x.device)
    else:
        rows = conv_state_indices.long()
    valid = rows >= 0
    state = conv_state[rows.clamp(min=0)]  # [B, D, S], a copy
    if cache_seqlens is None:
        window = state[..., state_len - (width - 1) :]
        new_state = torch.cat([state, x.to(state.dtype)], dim=-1)[..., -state_len:]
    else:
        start = cache_seqlens.long().remainder(state_len)  # [B]
        read = (start[:, None] + torch.arange(-(width - 1), 0, device=x.device)).remainder(state_len)
        window = state.gather(-1, read[:, None, :].expand(-1, dim, -1))
        # Only the last S new tokens survive a wrap-around; they land on distinct slots.
        keep = min(seqlen, state_len)
        write = (start[:, None] + torch.arange(seqlen - keep, seqlen, device=x.device)).remainder(state_len)
        new_state = state.clone()
        new_state.scatter_(-1, write[:, None, :].expand(-1, dim, -1), x[..., seqlen - keep :].to(state.dtype))
    u = torch.cat([window.to(work), x.to(work)], dim=-1)  # [B, D, W-1+L]
    y = (u.unfold(-1, width, 1) * weight.to(work)[None, :, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.to(work)[None, :, None]
    if silu:
        y = F.silu(y)
    y = y.masked_fill(~valid[:, None, None], 0.0).to(x.dtype)
    conv_state[rows[valid]] = new_state[valid]
    return y.squeeze(-1) if squeeze else y
