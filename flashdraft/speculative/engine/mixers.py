"""The token mixers of a Qwen3.5 / Qwen3 layer over static caches: gated full attention and Gated DeltaNet.

    out = attention(layer.self_attn, x, positions, cos, sin, (keys, values), visible, norm)
    states = LinearStates(gdn_modules, block_size, dtype, state_dtype, device)
    out = linear_attention(module, states, i, x, mode, gated_norm, prefill_keep)
    commit_linear(states, keep, block_index)

The arithmetic is transformers' (the modules' own projections, norms and RoPE function); what differs is where the
state lives: preallocated buffers that one captured CUDA graph reads and writes at any context length. The target
engine (`target_runner.TargetEngine`) runs both; the target's MTP layer (`mtp_runner.MTPRunner`) runs the full
attention one over its own cache.

Exact rollback of Gated DeltaNet. A verification reads the linear-attention states but does not advance them; it
keeps what the recurrence consumes (the conv inputs and outputs, the raw decay and beta projections of the block;
the projections are computed straight into those buffers). `commit_linear` then advances the states over exactly
the first `keep` tokens, all layers at once: the conv window is the last W-1 of `[state, inputs[:keep]]`, and the
delta rule runs over the block with beta = 0 and decay = 1 (g = 0) after `keep`. Such a step leaves the state bit
for bit unchanged (S * 1 + k * 0), so the committed state is the one that the same kernel reaches over the `keep`
tokens alone.
"""

from __future__ import annotations

import sys

import torch

from flashdraft.speculative.engine import ops

# Prompts up to this length go through the fused recurrent kernel (exact float32 arithmetic; launch-bound either
# way at this length); longer ones through fla's chunk kernel (matmul-based: TF32 for float32 inputs on a GPU).
SHORT_PREFILL = 64


def _project(linear: torch.nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`linear(x)`, written into `out` when given: by the matmul itself for a plain bias-free Linear (the same
    cuBLAS call as F.linear, so the same bits), else copied."""
    if out is None:
        return linear(x)
    if type(linear) is torch.nn.Linear and linear.bias is None:
        return torch.mm(x, linear.weight.t(), out=out)
    return out.copy_(linear(x))


def attention(attn, x, positions, cos, sin, cache, visible, norm) -> torch.Tensor:
    """A full-attention layer's mixer (`attn`: the model's own attention module) over a static cache: x (T, D) at
    `positions` -> (T, D). The new keys/values go into `cache` (keys, values: (Hkv, S, d)) at their positions;
    `visible` (T, S) says which slots each query sees, or None for a prefill from an empty cache; `norm(module, x)`
    runs an RMSNorm module."""
    length, dim = x.shape[0], attn.head_dim
    projected = attn.q_proj(x)
    gate = None
    if projected.shape[-1] == 2 * attn.config.num_attention_heads * dim:
        # Qwen3.5's output gate: q_proj yields [query | gate] per head.
        query, gate = torch.chunk(projected.view(length, -1, 2 * dim), 2, dim=-1)
        gate = gate.reshape(length, -1)
    else:
        query = projected.view(length, -1, dim)
    query = norm(attn.q_norm, query).transpose(0, 1)
    key = norm(attn.k_norm, attn.k_proj(x).view(length, -1, dim)).transpose(0, 1)
    value = attn.v_proj(x).view(length, -1, dim).transpose(0, 1)
    # The family's own RoPE function (partial rotary for Qwen3.5), on (1, heads, T, d).
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    query, key = rope(query[None], key[None], cos[None], sin[None])
    query, key = query[0], key[0]
    keys, values = cache
    keys.index_copy_(1, positions, key)
    values.index_copy_(1, positions, value)
    if visible is None:
        out = ops.causal_attention(query, key, value, attn.scaling)
    else:
        out = ops.cached_attention(query, keys, values, visible, attn.scaling)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out)


class LinearStates:
    """Static buffers of all Gated DeltaNet layers: their states and what a verification keeps for the commit.

    The layers share their shapes, so the buffers are stacked: a layer's states are contiguous views, and
    `commit_linear` advances every layer at once — the delta rule runs over all layers' heads side by side (layer
    l's value head j is head l * HV + j, and its key head lands where the kernel's grouping expects it), a handful
    of kernels per round instead of a handful per layer.
    """

    def __init__(self, modules: dict[int, torch.nn.Module], block_size: int, dtype, state_dtype, device):
        first = next(iter(modules.values()))
        conv_dim, width = first.conv1d.weight.shape[0], first.conv1d.weight.shape[-1]
        count, heads_k, heads_v = len(modules), first.num_k_heads, first.num_v_heads
        k_dim, v_dim = first.head_k_dim, first.head_v_dim
        for i, m in modules.items():
            shapes = (m.conv1d.weight.shape[0], m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim)
            if shapes != (conv_dim, heads_k, heads_v, k_dim, v_dim):
                raise ValueError(f"layer {i}: Gated DeltaNet shapes differ from layer {next(iter(modules))}'s")
        self.slot = {i: j for j, i in enumerate(modules)}
        self.heads_k, self.heads_v, self.k_dim, self.v_dim = heads_k, heads_v, k_dim, v_dim
        self.conv = torch.zeros(count, conv_dim, width - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(count, heads_v, k_dim, v_dim, dtype=state_dtype, device=device)
        # What a verification keeps, per layer (layer-major, so that each layer's slice is contiguous).
        self.block_inputs = torch.zeros(count, block_size, conv_dim, dtype=dtype, device=device)  # conv inputs
        self.block_qkv = torch.zeros(count, block_size, conv_dim, dtype=dtype, device=device)  # conv outputs
        self.block_b = torch.zeros(count, block_size, heads_v, dtype=dtype, device=device)  # raw beta projection
        self.block_a = torch.zeros(count, block_size, heads_v, dtype=dtype, device=device)  # raw decay projection
        # Per-layer decay parameters side by side, as the stacked heads need them.
        self.A_log = torch.cat([m.A_log.detach() for m in modules.values()])
        self.dt_bias = torch.cat([m.dt_bias.detach() for m in modules.values()])


def _split_qkv(module, qkv: torch.Tensor):
    length = qkv.shape[0]
    q, k, v = torch.split(qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (
        q.reshape(length, -1, module.head_k_dim),
        k.reshape(length, -1, module.head_k_dim),
        v.reshape(length, -1, module.head_v_dim),
    )


def linear_attention(
    module, states: LinearStates, i: int, x: torch.Tensor, mode: str, gated_norm, prefill_keep: torch.Tensor | None
) -> torch.Tensor:
    """Gated DeltaNet layer `i` (transformers' Qwen3_5GatedDeltaNet arithmetic) over its static states: x (T, D)
    -> (T, D). mode: "prefill" (from zero states; the prompt's length `prefill_keep`, a device tensor, may be below
    T: the rest is padding), "decode" (one token, advances the states) or "verify" (reads the states, keeps what
    `commit_linear` needs)."""
    j = states.slot[i]
    conv, recurrent = states.conv[j], states.recurrent[j]
    length = x.shape[0]
    verify = mode == "verify"
    # A verification computes what commit needs straight into its buffers (no copy kernels).
    inputs = _project(module.in_proj_qkv, x, states.block_inputs[j] if verify else None)
    z = module.in_proj_z(x)
    b = _project(module.in_proj_b, x, states.block_b[j] if verify else None)
    a = _project(module.in_proj_a, x, states.block_a[j] if verify else None)
    weight = module.conv1d.weight.squeeze(1)
    if mode == "decode":
        qkv = ops.causal_conv_step(inputs, conv, weight, module.conv1d.bias)  # advances the window
    else:
        qkv = ops.causal_conv(inputs, conv, weight, module.conv1d.bias)
    if verify:
        states.block_qkv[j].copy_(qkv)
    beta = b.sigmoid()
    if mode == "prefill":
        # A padded prompt (target_runner): past its length the delta rule steps with beta = 0 and decay 1 (a = -inf
        # gives g = -0), which leave the state as the prompt left it.
        padding = (torch.arange(length, device=x.device) >= prefill_keep)[:, None]
        a, beta = a.masked_fill(padding, float("-inf")), beta.masked_fill(padding, 0)
    q, k, v = _split_qkv(module, qkv)
    advance, chunked = not verify, mode == "prefill" and length > SHORT_PREFILL
    out, final = ops.delta_rule(
        q, k, v, a, beta, module.A_log, module.dt_bias, recurrent, output_final_state=advance, chunked=chunked
    )
    if mode == "prefill":
        conv.copy_(ops.conv_tail(conv, inputs, prefill_keep))
    if advance:
        recurrent.copy_(final)
    out = gated_norm(out.reshape(-1, module.head_v_dim).to(x.dtype), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(length, -1))


def commit_linear(states: LinearStates, keep: torch.Tensor, block_index: torch.Tensor) -> None:
    """Advance every Gated DeltaNet layer's states over the first `keep` (a device tensor) tokens of the last
    verified block (see the module docstring)."""
    states.conv.copy_(ops.conv_tail(states.conv, states.block_inputs, keep))
    # All layers' heads side by side; beta = 0 and decay 1 (a = -inf: g = -0) past `keep`: those steps leave the
    # state exactly as it was. Keys, values and beta are derived from the kept conv outputs and projections by the
    # same ops as in the verification, so they are the same bits.
    rejected = (block_index >= keep)[:, None]
    count, length, _ = states.block_qkv.shape
    key_dim = states.heads_k * states.k_dim
    qkv = states.block_qkv.transpose(0, 1)  # (T, layers, conv_dim)
    k = qkv[..., key_dim : 2 * key_dim].reshape(length, count * states.heads_k, states.k_dim)
    v = qkv[..., 2 * key_dim :].reshape(length, count * states.heads_v, states.v_dim)
    a = states.block_a.transpose(0, 1).reshape(length, -1).masked_fill(rejected, float("-inf"))
    beta = states.block_b.transpose(0, 1).reshape(length, -1).sigmoid().masked_fill(rejected, 0)
    recurrent = states.recurrent.view(count * states.heads_v, *states.recurrent.shape[2:])
    _, final = ops.delta_rule(k, k, v, a, beta, states.A_log, states.dt_bias, recurrent, True)
    recurrent.copy_(final)
