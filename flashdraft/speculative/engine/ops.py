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
from torch.nn.attention import SDPBackend, sdpa_kernel


@functools.cache
def _fla_rules():
    """fla's (chunk, fused_recurrent) gated delta rule, or None when fla does not import."""
    try:
        mod = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # any failure (missing, broken build) means: use the torch loop
        return None
    return mod.chunk_gated_delta_rule, mod.fused_recurrent_gated_delta_rule


@functools.cache
def _fla_rms_norm():
    try:
        return importlib.import_module("fla.modules.norm.layernorm").rms_norm
    except Exception:
        return None


def _use_fla(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16, torch.float32) and _fla_rules() is not None


class Norm:
    """An RMSNorm module, run as one fused kernel (fla's Triton RMSNorm) on the GPU when it is one.

    transformers' RMSNorms differ in their weight (Qwen3.5's is zero-centred: `1 + w`) and rounding; instead of
    trusting class names, the effective weight is found by probing the module in float32 against
    `x * rsqrt(mean(x^2) + eps) * w` for both forms. Anything else keeps the module's own forward.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.weight: torch.Tensor | None = None
        self.eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 1 or not weight.is_cuda or _fla_rms_norm() is None:
            return
        generator = torch.Generator(device=weight.device).manual_seed(0)  # not the caller's random stream
        probe = torch.randn(4, weight.shape[0], device=weight.device, generator=generator)
        with torch.inference_mode():
            got = module(probe)
            normed = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + self.eps)
            for candidate in (1.0 + weight.float(), weight.float()):
                if got.dtype == torch.float32 and torch.allclose(got, normed * candidate, rtol=1e-5, atol=1e-5):
                    self.weight = candidate.contiguous()
                    break

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or not x.is_cuda:
            return self.module(x)
        return _fla_rms_norm()(x, self.weight, None, eps=self.eps)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums of half-precision partial results are taken in float32; float32/64 in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# Caches of at least this many slots are attended in chunks of ATTENTION_CHUNK slots (see `cached_attention`);
# engines round such slot counts up to a multiple of the chunk. 0 turns chunking off (benchmarks' A/B runs).
ATTENTION_CHUNK = 512
CHUNKED_FROM = 2048


def attention_slots(slots: int) -> int:
    """The slot count an engine allocates for `slots` wanted: a multiple of the chunk when it will be chunked."""
    if ATTENTION_CHUNK and slots >= CHUNKED_FROM:
        return -(-slots // ATTENTION_CHUNK) * ATTENTION_CHUNK
    return slots


def cached_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of `T` queries over a static cache: (H, T, d) x (Hkv, S, d) -> (T, H * d); `visible` (T, S) bool.

    Plain batched matmuls and a masked softmax: cuBLAS needs no per-call planning, reads each cache slot once
    for all the query heads of its group (the group is folded into the query rows, no K/V repeat), and runs
    inside a CUDA graph whatever the number of valid slots. Invalid slots cost bandwidth but never weight.

    probs @ values reduces over all S slots into a small (rows x d) output: one GEMM has few output tiles to
    spread over the GPU, each reducing over all slots. Long caches are therefore split into chunks of
    ATTENTION_CHUNK slots, each a GEMM of the batch, and the partial outputs summed (in float32 for half
    precision; split-K by hand, as flash-decoding splits the keys). bench/RESULTS.md has the
    engine's timings.
    """
    heads, length, dim = query.shape
    kv_heads, slots = keys.shape[:2]
    groups = heads // kv_heads
    rows = groups * length
    # Query head h uses key head h // groups (transformers' repeat_kv order). The scale goes into the (few) query
    # rows rather than over all scores, and the softmax (float32 inside for half precision) writes the input
    # dtype: two passes over the (rows x S) scores fewer.
    q = (query * scale).reshape(kv_heads, rows, dim)
    scores = torch.bmm(q, keys.transpose(1, 2))
    scores.view(kv_heads, groups, length, slots).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    chunk = ATTENTION_CHUNK
    if chunk and slots >= CHUNKED_FROM and slots % chunk == 0:
        count = slots // chunk
        parts = probs.view(kv_heads, rows, count, chunk).transpose(1, 2).reshape(kv_heads * count, rows, chunk)
        partial = torch.bmm(parts, values.view(kv_heads * count, chunk, dim))
        out = partial.view(kv_heads, count, rows, dim).sum(dim=1, dtype=accumulation_dtype(query.dtype)).to(query.dtype)
    else:
        out = torch.bmm(probs.view(kv_heads, rows, slots), values)
    return out.view(heads, length, dim).transpose(0, 1).reshape(length, heads * dim)


_PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of T tokens among themselves (a prefill from an empty cache): (H, T, d) -> (T, H * d)."""
    heads, length, dim = query.shape
    groups = heads // keys.shape[0]
    keys, values = (t.repeat_interleave(groups, dim=0) for t in (keys, values))
    # Not cuDNN's attention: it builds a plan per sequence length (about 70 ms on an H100 for each new prompt
    # length, which every prompt of a new length paid); flash and memory-efficient attention build none.
    with sdpa_kernel(_PREFILL_ATTENTION):
        out = F.scaled_dot_product_attention(query[None], keys[None], values[None], is_causal=True, scale=scale)
    return out[0].transpose(0, 1).reshape(length, heads * dim)


def _triton_conv(x: torch.Tensor) -> bool:
    """Whether the conv runs flashdraft's Triton kernels (on CUDA; tests may also route the interpreter here)."""
    return x.is_cuda


def _kernels():
    from flashdraft import kernels

    return kernels


def conv_window(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The conv inputs `[state, x]`: state (..., D, W-1) and x (..., T, D) -> (..., D, W-1+T)."""
    return torch.cat([state, x.transpose(-1, -2).to(state.dtype)], dim=-1)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x (T, D) continuing from `state` (D, W-1) (the last W-1 inputs); -> (T, D).

    The state is not modified (see `conv_tail`).
    """
    if _triton_conv(x):
        # Our Triton kernel reads x as a channel-last view (no copy) and the state as its initial inputs.
        y = _kernels().causal_conv1d_fn(
            x.transpose(0, 1)[None], weight, bias, initial_states=state[None].to(x.dtype), activation="silu"
        )
        return y[0].transpose(0, 1)
    # transformers' own update arithmetic: conv over the window in the weight's dtype, then SiLU.
    window = conv_window(state, x).to(weight.dtype)[None]
    y = F.conv1d(window, weight[:, None, :], bias, groups=weight.shape[0])[0]
    return F.silu(y).to(x.dtype).transpose(0, 1)


def causal_conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """One token: SiLU(conv) of x (1, D) after `state` (D, W-1), which advances by that token in place."""
    if _triton_conv(x):
        return _kernels().causal_conv1d_update(x, state[None], weight, bias, activation="silu")
    y = causal_conv(x, state, weight, bias)
    state.copy_(conv_window(state, x)[:, 1:])
    return y


def conv_tail(state: torch.Tensor, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The conv state (..., D, W-1) after the first `keep` (0-d long tensor) of the T inputs x (..., T, D): the
    last W-1 inputs of `[state, x[:keep]]`."""
    window = conv_window(state, x)
    index = keep + torch.arange(state.shape[-1], device=state.device)
    return window.index_select(window.dim() - 1, index)


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


def log_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's log decay g from the raw projection a (T, HV), transformers' arithmetic; a = -inf gives g = -0."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def delta_rule(q, k, v, a, beta, A_log, dt_bias, state, output_final_state: bool, chunked: bool = False):
    """Gated delta rule continuing from `state`; the decay comes from the raw projection a (T, HV) (`log_decay`),
    other shapes as in `delta_rule_loop`. fla's kernels on the GPU.

    chunked: fla's chunk kernel (long prefills); otherwise the fused recurrent one, which is what decoding and
    verification use, so that a verified prefix and the same tokens decoded one by one compute alike. The fused
    kernel computes the decay itself (fewer launches per step).
    """
    if not _use_fla(v):
        return delta_rule_loop(q, k, v, log_decay(a, A_log, dt_bias), beta, state, output_final_state)
    chunk, recurrent = _fla_rules()
    if chunked:
        out, final = chunk(
            q[None],
            k[None],
            v[None],
            g=log_decay(a, A_log, dt_bias)[None],
            beta=beta[None],
            initial_state=state[None],
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True,
        )
    else:
        out, final = recurrent(
            q[None],
            k[None],
            v[None],
            g=a[None],
            beta=beta[None],
            initial_state=state[None],
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
        )
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
