"""`causal_conv1d_fn`: the differentiable causal depthwise conv1d (drop-in for causal-conv1d 1.7.0)."""

from __future__ import annotations

import torch

from flashdraft.kernels.causal_conv1d import common
from flashdraft.kernels.causal_conv1d.backward import causal_conv1d_bwd
from flashdraft.kernels.causal_conv1d.forward import causal_conv1d_fwd
from flashdraft.kernels.causal_conv1d.reference import check_activation


def _check_args(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = common.describe(x) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expected x of shape (B, D, L), got {got}")
    batch, dim, seqlen = x.shape
    common.check_float("x", x)
    if seqlen < 1:
        raise ValueError(f"expected x with L >= 1, got {common.describe(x)}")
    common.check_weight(weight, dim)
    width = weight.shape[1]
    if bias is not None and (bias.shape != (dim,) or bias.dtype not in common.FLOAT_DTYPES):
        raise ValueError(
            f"expected bias of shape (D,) = ({dim},), float32, float16 or bfloat16, got {common.describe(bias)}"
        )
    if seq_idx is not None:
        if seq_idx.shape != (batch, seqlen) or seq_idx.dtype != torch.int32:
            raise ValueError(
                f"expected seq_idx of shape (B, L) = ({batch}, {seqlen}) and dtype torch.int32, "
                f"got {common.describe(seq_idx)}"
            )
        if return_final_states:
            raise ValueError("expected return_final_states=False with seq_idx (as causal-conv1d), got True")
    if initial_states is not None and (
        initial_states.shape != (batch, dim, width - 1) or initial_states.dtype != x.dtype
    ):
        raise ValueError(
            f"expected initial_states of shape (B, D, W-1) = ({batch}, {dim}, {width - 1}) and the dtype of x "
            f"({x.dtype}), got {common.describe(initial_states)}"
        )
    if (
        return_final_states
        and final_states_out is not None
        and (final_states_out.shape != (batch, dim, width - 1) or final_states_out.dtype != x.dtype)
    ):
        raise ValueError(
            f"expected final_states_out of shape (B, D, W-1) = ({batch}, {dim}, {width - 1}) and the dtype of x "
            f"({x.dtype}), got {common.describe(final_states_out)}"
        )
    common.check_devices(
        x,
        "causal_conv1d_fn",
        weight=weight,
        bias=bias,
        seq_idx=seq_idx,
        initial_states=initial_states,
        final_states_out=final_states_out if return_final_states else None,
    )


def _forward(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, silu):
    """(y, final states or None): the forward kernel, with the final-states buffer made when none is given."""
    final_states = None
    if return_final_states:
        final_states = final_states_out
        if final_states is None:
            batch, dim, _ = x.shape
            shape = (batch, dim, weight.shape[1] - 1)
            final_states = common.empty_like_output(shape, x.dtype, x.device, common.is_channel_last(x))
    return causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, final_states, silu), final_states


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd of the causal conv1d: forward and backward are Triton kernels (see forward.py, backward.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, silu):
        if final_states_out is not None:
            ctx.mark_dirty(final_states_out)
        y, final_states = _forward(
            x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, silu
        )
        ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
        ctx.silu = silu
        ctx.return_final_states = return_final_states
        return (y, final_states) if return_final_states else y

    @staticmethod
    def backward(ctx, dy, *rest):
        dfinal_states = rest[0] if ctx.return_final_states else None
        need_dinitial_states = ctx.needs_input_grad[4]
        # ctx.saved_tensors: x, weight, bias, seq_idx, initial_states.
        grads = causal_conv1d_bwd(ctx.saved_tensors, dy, dfinal_states, ctx.silu, need_dinitial_states)
        dx, dweight, dbias, dinitial_states = grads
        return dx, dweight, dbias, None, dinitial_states, None, None, None


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
):
    """Causal depthwise conv1d, `y[:, d, t] = act(bias[d] + sum_k weight[d, W-1-k] * x[:, d, t-k])`.

    Same signature and semantics as causal-conv1d 1.7.0's `causal_conv1d_fn`, differentiable in x, weight, bias,
    initial_states (and through the final states).

    Args:
        x: `[B, D, L]`, channel-first (L contiguous) or channel-last (a transposed view of a contiguous
            `[B, L, D]`); float32, float16 or bfloat16.
        weight: `[D, W]`, 2 <= W <= 4, any of those float dtypes (accumulation is float32).
        bias: `[D]` or None.
        seq_idx: `[B, L]` int32 ids of packed sequences: x[t-k] reaches y[t] only if both ids are equal; y is 0
            wherever the id is negative (padding). Initial states belong to the sequence of position 0.
        initial_states: `[B, D, W-1]` (dtype of x), the inputs before position 0.
        return_final_states: also return the last W-1 inputs `[B, D, W-1]` (not with seq_idx, as causal-conv1d).
        final_states_out: `[B, D, W-1]` tensor to write the final states into (returned), or None.
        activation: None, "silu" or "swish".

    Returns:
        y `[B, D, L]` (dtype and memory layout of x), or `(y, final_states)` if return_final_states.
    """
    silu = check_activation(activation)
    _check_args(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out)
    if bias is not None and bias.stride(0) != 1:
        # The kernels read bias with unit stride (D floats at most: the copy is free).
        bias = bias.contiguous()
    differentiable = (x, weight, bias, initial_states)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)):
        # Inference (a frozen target, decoding): the kernel without autograd.Function's bookkeeping, which is host
        # time on every call; for the short inputs of decoding, the launch path's host time is of the order of the
        # kernel's own, so what it saves shows.
        out = final_states_out if return_final_states else None
        y, final_states = _forward(x, weight, bias, seq_idx, initial_states, return_final_states, out, silu)
        return (y, final_states) if return_final_states else y
    return CausalConv1dFunction.apply(
        x,
        weight,
        bias,
        seq_idx,
        initial_states,
        return_final_states,
        final_states_out if return_final_states else None,
        silu,
    )
