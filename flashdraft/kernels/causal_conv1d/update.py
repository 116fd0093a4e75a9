"""Decode step of the causal conv1d: `causal_conv1d_update`, one Triton kernel launch, conv_state updated in place.

This sits on the decode hot path (one call per GDN layer and token), so the host side is kept lean: everything
that depends only on shapes, dtypes and flags (validation, block sizes, grid, the compiled kernel) is computed once
per signature and cached in a `_Plan`; a call then allocates y and launches the compiled kernel directly. The
kernel is compiled without integer or alignment specialisation, so one compiled kernel is valid for any strides
and pointers, and the plan never has to look at them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels.causal_conv1d import common
from flashdraft.kernels.causal_conv1d.reference import check_activation
from flashdraft.kernels.utils import INTERPRET, as_mask, sigmoid

_INTS = [
    "D",
    "L",
    "S",
    "stride_xb",
    "stride_xd",
    "stride_xl",
    "stride_cb",
    "stride_cd",
    "stride_cl",
    "stride_wd",
    "stride_ww",
    "stride_yb",
    "stride_yd",
    "stride_yl",
    "stride_csl",
    "stride_idx",
]
_PTRS = ["x", "conv_state", "weight", "bias", "cache_seqlens", "state_indices", "y"]


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=_PTRS)
def causal_conv1d_update_kernel(
    x,
    conv_state,
    weight,
    bias,
    cache_seqlens,
    state_indices,
    y,
    D,
    L,
    S,
    stride_xb,
    stride_xd,
    stride_xl,
    stride_cb,
    stride_cd,
    stride_cl,
    stride_wd,
    stride_ww,
    stride_yb,
    stride_yd,
    stride_yl,
    stride_csl,
    stride_idx,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CIRCULAR: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Grid: (cdiv(D, BLOCK_D), B). x `[B, D, L]`, conv_state `[B_cache, D, S]`, y `[B, D, L]`.

    The conv of token i reads u[i : i+W] of u = [the W-1 inputs before x (from the state) | x]. The state's
    window starts at slot (c - (W-1)) mod S, with c = cache_seqlens[b] mod S for a circular buffer and c = 0
    otherwise (then the window is the last W-1 slots).
    """
    i_d, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    if HAS_INDICES:
        row = tl.load(state_indices + i_b * stride_idx).to(tl.int64)
    else:
        row = i_b
    # A negative cache row is a padding batch row: output 0, no state touched.
    valid = row >= 0
    m_dv = m_d & as_mask(valid)
    c = 0
    if CIRCULAR:
        c = tl.load(cache_seqlens + i_b * stride_csl) % S
        c = tl.where(c < 0, c + S, c)
    p_c = conv_state + row * stride_cb + o_d[:, None] * stride_cd
    p_x = x + i_b * stride_xb + o_d[:, None] * stride_xd
    o_l = tl.arange(0, BLOCK_L)
    m_l = o_l < L

    acc = tl.full((BLOCK_D, BLOCK_L), 0.0, tl.float32)
    for j in tl.static_range(W):
        m = o_l + j
        in_state = m < W - 1
        q = c - (W - 1) + m
        q = tl.where(q < 0, q + S, q)
        vs = tl.load(p_c + q[None, :] * stride_cl, mask=m_dv[:, None] & (in_state & m_l)[None, :], other=0.0)
        vx = tl.load(
            p_x + (m - (W - 1))[None, :] * stride_xl, mask=m_d[:, None] & (~in_state & m_l)[None, :], other=0.0
        )
        wj = tl.load(weight + o_d * stride_wd + j * stride_ww, mask=m_d, other=0.0).to(tl.float32)
        acc += wj[:, None] * (vs.to(tl.float32) + vx.to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc * sigmoid(acc)
    acc = tl.where(valid, acc, 0.0)

    # Every read of the old state above and below completes before the first write (tl.debug_barrier).
    if CIRCULAR:
        # Only the last S tokens survive a wrap-around; they land on distinct slots.
        keep = m_l & (o_l >= L - S)
        vals = tl.load(p_x + o_l[None, :] * stride_xl, mask=m_d[:, None] & keep[None, :], other=0.0)
        tl.debug_barrier()
        tl.store(
            p_c + ((c + o_l) % S)[None, :] * stride_cl,
            vals.to(conv_state.dtype.element_ty),
            mask=m_dv[:, None] & keep[None, :],
        )
    else:
        # new_state[s] = [old state | x][L + s]
        o_s = tl.arange(0, BLOCK_S)
        m_s = o_s < S
        q = L + o_s
        from_state = q < S
        vs = tl.load(p_c + q[None, :] * stride_cl, mask=m_dv[:, None] & (m_s & from_state)[None, :], other=0.0)
        vx = tl.load(p_x + (q - S)[None, :] * stride_xl, mask=m_d[:, None] & (m_s & ~from_state)[None, :], other=0.0)
        new = tl.where(from_state[None, :], vs, vx.to(vs.dtype))
        tl.debug_barrier()
        tl.store(p_c + o_s[None, :] * stride_cl, new, mask=m_dv[:, None] & m_s[None, :])

    p_y = y + i_b * stride_yb + o_d[:, None] * stride_yd + o_l[None, :] * stride_yl
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_d[:, None] & m_l[None, :])


class _Plan:
    """What one signature of causal_conv1d_update needs at call time: grid, constexprs, compiled kernel."""

    __slots__ = ("grid", "meta", "num_warps", "y_shape", "dtype", "device", "device_index", "tail", "compiled")

    def __init__(self, x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
        _validate(x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
        batch, dim = x.shape[:2]
        seqlen = 1 if x.dim() == 2 else x.shape[2]
        block_l = triton.next_power_of_2(seqlen)
        block_d = min(triton.next_power_of_2(dim), max(4096 // block_l, 16), 8 if INTERPRET else 256)
        self.meta = dict(
            W=weight.shape[1],
            SILU=silu,
            HAS_BIAS=bias is not None,
            CIRCULAR=cache_seqlens is not None,
            HAS_INDICES=conv_state_indices is not None,
            BLOCK_D=block_d,
            BLOCK_L=block_l,
            BLOCK_S=triton.next_power_of_2(conv_state.shape[2]),
        )
        self.num_warps = 4
        self.grid = (triton.cdiv(dim, block_d), batch, 1)
        self.y_shape = tuple(x.shape)
        self.dtype = x.dtype
        self.device = x.device
        self.device_index = x.device.index if x.device.type == "cuda" else None
        # A 2-D x (and y) is one token: its length stride is never used.
        pad = (0,) if x.dim() == 2 else ()
        y_strides = torch.empty(self.y_shape, device="meta").stride()
        # The kernel's arguments after the tensors: sizes, strides (all part of the signature) and constexprs.
        self.tail = (
            dim,
            seqlen,
            conv_state.shape[2],
            *x.stride(),
            *pad,
            *conv_state.stride(),
            *weight.stride(),
            *y_strides,
            *pad,
            cache_seqlens.stride(0) if cache_seqlens is not None else 0,
            conv_state_indices.stride(0) if conv_state_indices is not None else 0,
            *self.meta.values(),
        )
        self.compiled = None


def _validate(x, conv_state, weight, bias, cache_seqlens, conv_state_indices):
    if x.dim() not in (2, 3):
        raise ValueError(f"expected x of shape (B, D) or (B, D, L), got {common.describe(x)}")
    common.check_float("x", x)
    batch, dim = x.shape[:2]
    if x.dim() == 3 and x.shape[2] < 1:
        raise ValueError(f"expected x with L >= 1 new tokens, got {common.describe(x)}")
    common.check_weight(weight, dim)
    width = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"expected conv_state of shape (B_cache, D, state_len) = (B_cache, {dim}, >= {width - 1}), "
            f"got {common.describe(conv_state)}"
        )
    if conv_state.dtype != x.dtype:
        raise ValueError(f"expected conv_state of the dtype of x ({x.dtype}), got {conv_state.dtype}")
    if conv_state_indices is None and conv_state.shape[0] != batch:
        raise ValueError(
            f"expected conv_state with B = {batch} rows (or conv_state_indices), got {common.describe(conv_state)}"
        )
    if bias is not None and (bias.shape != (dim,) or bias.dtype not in common.FLOAT_DTYPES or bias.stride(0) != 1):
        raise ValueError(
            f"expected bias of shape (D,) = ({dim},), unit stride, float32, float16 or bfloat16, got "
            f"{common.describe(bias)} with stride {bias.stride()}"
        )
    for name, t in (("cache_seqlens", cache_seqlens), ("conv_state_indices", conv_state_indices)):
        if t is not None and (t.shape != (batch,) or t.dtype != torch.int32):
            raise ValueError(
                f"expected {name} of shape (B,) = ({batch},) and dtype torch.int32, got {common.describe(t)}"
            )
    common.check_devices(
        x,
        "causal_conv1d_update",
        conv_state=conv_state,
        weight=weight,
        bias=bias,
        cache_seqlens=cache_seqlens,
        conv_state_indices=conv_state_indices,
    )


_plans: dict[tuple, _Plan] = {}
# The stream query Triton's own launcher uses (a raw cudaStream_t of the current stream of a device).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_SILU = {None: False, "silu": True, "swish": True}


def _signature(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices) -> tuple:
    # Everything _Plan derives from or validates (pointers are the only per-call kernel arguments).
    return (
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        conv_state.shape,
        conv_state.stride(),
        conv_state.dtype,
        conv_state.device,
        weight.shape,
        weight.stride(),
        weight.dtype,
        weight.device,
        silu,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
        None
        if cache_seqlens is None
        else (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device),
        None
        if conv_state_indices is None
        else (
            conv_state_indices.shape,
            conv_state_indices.stride(),
            conv_state_indices.dtype,
            conv_state_indices.device,
        ),
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the causal depthwise conv1d (drop-in for causal-conv1d's `causal_conv1d_update`).

    Args:
        x: `[B, D]` or `[B, D, L]`, the L >= 1 new inputs.
        conv_state: `[B_cache, D, S]`, S >= W-1, same dtype as x; updated in place. Without cache_seqlens it
            holds the last S inputs (shifted left by L, the new inputs appended); with it, a circular buffer.
        weight: `[D, W]`, 2 <= W <= 4, any float dtype (accumulation is float32).
        bias: `[D]` or None.
        activation: None, "silu" or "swish".
        cache_seqlens: `[B]` int32, tokens already in each row's buffer; the new tokens are written from slot
            `cache_seqlens[b] % S` and the window read is the W-1 slots before it.
        conv_state_indices: `[B]` int32, the cache row of each batch row (continuous batching). A negative index
            marks a padding row: its output is 0 and no state row is touched.

    Returns:
        y, same shape and dtype as x.
    """
    silu = _SILU.get(activation) if isinstance(activation, (str, type(None))) else None
    if silu is None:
        check_activation(activation)
    key = _signature(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    y = common.empty_like_output(plan.y_shape, plan.dtype, plan.device)
    compiled = plan.compiled
    if (
        compiled is not None
        and _current_raw_stream is not None
        and torch.cuda.current_device() == plan.device_index
        and not triton.knobs.runtime.launch_enter_hook.calls
        and not triton.knobs.runtime.launch_exit_hook.calls
    ):
        # The JIT's own launch minus its per-call binding, cache lookup and hooks (none are installed).
        stream = _current_raw_stream(plan.device_index)
        grid = plan.grid
        compiled[0](
            grid[0],
            grid[1],
            grid[2],
            stream,
            compiled[1],
            compiled[2],
            None,
            None,
            None,
            x,
            conv_state,
            weight,
            bias,
            cache_seqlens,
            conv_state_indices,
            y,
            *plan.tail,
        )
        return y
    _launch_jit(plan, (x, conv_state, weight, bias, cache_seqlens, conv_state_indices, y) + plan.tail)
    return y


def _launch_jit(plan: _Plan, args: tuple) -> None:
    """Launches through Triton's JIT (first call of a plan, interpreter, profiler hooks) and caches the compiled
    kernel's launcher for the direct path. args: every kernel argument in order, constexprs included."""
    n = len(plan.meta)
    runtime_args, meta = args[:-n], plan.meta
    if INTERPRET:
        causal_conv1d_update_kernel[plan.grid](*runtime_args, **meta, num_warps=plan.num_warps)
        return
    with torch.cuda.device(plan.device):
        kernel = causal_conv1d_update_kernel[plan.grid](*runtime_args, **meta, num_warps=plan.num_warps)
    try:
        plan.compiled = (kernel.run, kernel.function, kernel.packed_metadata)
    except AttributeError:
        # Another Triton version's CompiledKernel: keep launching through the JIT.
        plan.compiled = None
