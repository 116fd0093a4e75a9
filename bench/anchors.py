"""The implementations flashdraft is measured against, in the call signatures of transformers' Qwen3.5 module.

torch_conv_fn / torch_conv_update   transformers' torch fallback of the causal conv (what runs when neither fla
                                    nor causal-conv1d is installed), same semantics
fla_kernels()                       fla's Triton conv and chunk gated delta rule, wrapped to replace
                                    `modeling_qwen3_5.causal_conv1d_fn` / `torch_chunk_gated_delta_rule`
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_conv_fn(x, weight, bias=None, activation=None, **_):
    """transformers' torch fallback of `causal_conv1d_fn` on x `[B, D, L]`."""
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    out = out[..., : x.shape[-1]]
    return (F.silu(out) if activation in ("silu", "swish") else out).to(x.dtype)


def torch_conv_update(x, conv_state, weight, bias=None, activation=None):
    """transformers' torch fallback of `causal_conv1d_update`: x `[B, D, L]`, conv_state `[B, D, W]` updated in place."""
    seqlen, state_len = x.shape[-1], conv_state.shape[-1]
    xs = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(xs[..., -state_len:])
    out = F.conv1d(xs, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[..., -seqlen:]
    return (F.silu(out) if activation in ("silu", "swish") else out).to(x.dtype)


def fla_kernels():
    """(conv, gated delta rule) from fla in the signatures of transformers' module globals; None when fla cannot run
    here (the caller reports it)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print(f"fla unavailable: {exc}")
        return None

    def conv(x, weight, bias=None, activation=None, **_):
        return fla_conv(x.transpose(1, 2), weight, bias, activation=activation)[0].transpose(1, 2)

    def gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        **_,
    ):
        return fla_chunk(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
        )

    return conv, gated_delta_rule
