"""The few computations the engine runs itself, each device-aware: the fast kernel on CUDA, plain torch elsewhere.

Everything here works on one sequence (batch 1, no batch dimension unless stated) and on static buffers, so that
a CUDA graph can capture it: no host synchronisation, no data-dependent shapes. Shapes: `T` new tokens, `S` cache
slots, `H`/`Hkv` query/key-value heads, `d` head dim; for the gated delta rule `H` key heads, `HV` value heads,
`K`/`V` head dims; `D` conv channels, `W` conv width.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F


@functools.cache
def _fla_rules():
    """fla's (chunk, fused_recurrent) gated delta rule, or None when fla does not import."""
    try:
        mod = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # any failure (missing, broken build) means: use the torch loop
        return None
    return mod.chunk_gated_delta_rule, mod.fused_recurrent_gated_delta_rule


def _use_fla(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16, torch.float32) and _fla_rules() is not None


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision attends in float32 (as transformers' eager attention does); float32/64 in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def cached_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of `T` queries over a static cache: (H, T, d) x (Hkv, S, d) -> (T, H * d); `visible` (T, S) bool.

    Plain batched matmuls and a masked softmax: cuBLAS needs no per-call planning, reads each cache slot once
    for all the query heads of its group (the group is folded into the query rows, no K/V repeat), and runs
    inside a CUDA graph whatever the number of valid slots. Invalid slots cost bandwidth but never weight.
    """
    heads, length, dim = query.shape
    kv_heads, slots = keys.shape[:2]
    groups = heads // kv_heads
    # Query head h uses key head h // groups (transformers' repeat_kv order).
    q = query.reshape(kv_heads, groups * length, dim)
    scores = torch.bmm(q, keys.transpose(1, 2)) * scale
    scores = scores.view(kv_heads, groups, length, slots).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype(query.dtype)).to(query.dtype)
    out = torch.bmm(probs.view(kv_heads, groups * length, slots), values)
    return out.view(heads, length, dim).transpose(0, 1).reshape(length, heads * dim)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of T tokens among themselves (a prefill from an empty cache): (H, T, d) -> (T, H * d)."""
    heads, length, dim = query.shape
    groups = heads // keys.shape[0]
    keys, values = (t.repeat_interleave(groups, dim=0) for t in (keys, values))
    out = F.scaled_dot_product_attention(query[None], keys[None], values[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1).reshape(length, heads * dim)


def conv_window(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The conv inputs `[state, x]`: state (D, W-1) and x (T, D) -> (D, W-1+T)."""
    return torch.cat([state, x.transpose(0, 1).to(state.dtype)], dim=-1)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x (T, D) continuing from `state` (D, W-1) (the last W-1 inputs); -> (T, D).

    The state is not modified (see `conv_tail`).
    """
    if x.is_cuda:
        from flashdraft import kernels

        # Our Triton kernel reads x as a channel-last view (no copy) and the state as its initial inputs.
        y = kernels.causal_conv1d_fn(
            x.transpose(0, 1)[None], weight, bias, initial_states=state[None].to(x.dtype), activation="silu"
        )
        return y[0].transpose(0, 1)
    # transformers' own update arithmetic: conv over the window in the weight's dtype, then SiLU.
    window = conv_window(state, x).to(weight.dtype)[None]
    y = F.conv1d(window, weight[:, None, :], bias, groups=weight.shape[0])[0]
    return F.silu(y).to(x.dtype).transpose(0, 1)


def conv_tail(state: torch.Tensor, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The conv state after the first `keep` (0-d long tensor) of the T inputs x (T, D): the last W-1 of them."""
    window = conv_window(state, x)
    index = keep + torch.arange(state.shape[-1], device=state.device)
    return window.index_select(1, index)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_loop(q, k, v, g, beta, state, output_final_state: bool):
    """The gated delta rule token by token in the dtype of `state`: the reference off the GPU.

    q, k (T, H, K); v (T, HV, V); g (log decay), beta (T, HV); state (HV, K, V). Returns (out (T, HV, V) in v's
    dtype, final state or None). Queries and keys are L2-normalised and queries scaled by K^-1/2, as fla does.
    """
    dtype = state.dtype
    ratio = v.shape[1] // k.shape[1]
    q, k = (l2norm(t.to(dtype)).repeat_interleave(ratio, dim=1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    s = state
    out = torch.empty(v.shape, dtype=dtype, device=v.device)
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, (s if output_final_state else None)


def delta_rule(q, k, v, g, beta, state, output_final_state: bool, chunked: bool = False):
    """Gated delta rule continuing from `state` (shapes of `delta_rule_loop`); fla's kernels on the GPU.

    chunked: fla's chunk kernel (long prefills); otherwise the fused recurrent one, which is what decoding and
    verification use, so that a verified prefix and the same tokens decoded one by one compute alike.
    """
    if not _use_fla(v):
        return delta_rule_loop(q, k, v, g, beta, state, output_final_state)
    chunk, recurrent = _fla_rules()
    fn = chunk if chunked else recurrent
    out, final = fn(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], (final[0] if final is not None else None)


def rope_table(rotary: torch.nn.Module, length: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, rotary dim) of positions 0 .. length-1, computed by the model's own rotary module.

    The module computes every position independently (an outer product, then cos/sin), so rows gathered from
    this table equal what the module returns for any position list.
    """
    positions = torch.arange(length, device=device)[None]
    if hasattr(rotary, "mrope_section"):
        # Qwen3.5's multimodal RoPE: text tokens have the same position on all three axes.
        positions = positions[None].expand(3, 1, length)
    probe = torch.empty(1, dtype=dtype, device=device)
    cos, sin = rotary(probe, positions)
    return cos[0].contiguous(), sin[0].contiguous()
