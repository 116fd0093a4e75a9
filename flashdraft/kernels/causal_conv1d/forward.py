"""Forward Triton kernels of the causal depthwise conv1d and their host function.

Two kernels, one per memory layout of x `[B, D, L]`:

- `causal_conv1d_fwd_kernel` (channel-last, D contiguous: what transformers passes). A program owns `BLOCK_D`
  channels and a run of `SUB_L * N_SUB` positions and walks them in order, one row `x[b, :, t]` at a time: each
  thread loads 16 contiguous bytes of the row, and the W-1 previous rows stay in registers, so every input is read
  from memory once (plus W-1 halo rows per program, which hit L2). Rows are loaded SUB_L at a time into a tuple,
  one block ahead of the rows being computed, so that SUB_L 16-byte loads per thread are always in flight.
- `causal_conv1d_fwd_tile_kernel` (channel-first, L contiguous, or any other strides). A `[BLOCK_D, BLOCK_L]` tile
  is computed from W shifted loads of x; the shifted loads mostly hit L1 but cannot be vectorised (misaligned),
  so this layout runs well below the channel-last one.

Both accumulate in float32, take any float dtype of weight and bias, and support seq_idx, initial states and
final states in either layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels.causal_conv1d import common
from flashdraft.kernels.utils import as_mask, sigmoid


@triton.jit
def _store_final_states(
    p_x, p_h0, p_ht, L, stride_xl, stride_h0w, stride_htw, m_d, W: tl.constexpr, HAS_H0: tl.constexpr
):
    """final_states[:, j] = input at position L-(W-1)+j (initial states when that is negative)."""
    for j in tl.static_range(W - 1):
        v = common.load_at(p_x, p_h0, L - (W - 1) + j, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
        tl.store(p_ht + j * stride_htw, v.to(p_ht.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["L", "NTOK_LOG2"])
def causal_conv1d_fwd_kernel(
    x, weight, bias, seq_idx, h0, y, ht, D, L, NTOK_LOG2,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_ww, stride_sb, stride_sl, stride_h0b, stride_h0d, stride_h0w,
    stride_yb, stride_yd, stride_yl, stride_htb, stride_htd, stride_htw,
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_HT: tl.constexpr, BLOCK_D: tl.constexpr, SUB_L: tl.constexpr, N_SUB: tl.constexpr,
):  # fmt: skip
    """Row-walking forward. Grid: (cdiv(L, SUB_L * N_SUB), cdiv(D, BLOCK_D), B). NTOK_LOG2 only keys autotuning."""
    i_l, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_x = x + i_b * stride_xb + o_d * stride_xd
    p_y = y + i_b * stride_yb + o_d * stride_yd
    p_h0 = h0 + i_b * stride_h0b + o_d * stride_h0d if HAS_H0 else h0
    p_s = seq_idx + i_b * stride_sb if HAS_SEQ_IDX else seq_idx

    # Tap k multiplies x[t-k] (c_k); the W-1 rows before t0 (x[t0-1] in xm1, ...) and their sequence ids.
    c0, c1, c2, c3, b = common.load_taps(weight, bias, o_d, m_d, stride_wd, stride_ww, W, HAS_BIAS)
    t0 = i_l * (SUB_L * N_SUB)
    xm1, xm2, xm3, sm1, sm2, sm3 = common.load_halo(
        p_x, p_h0, p_s, t0, L, m_d, stride_xl, stride_h0w, stride_sl, W, HAS_SEQ_IDX, HAS_H0
    )

    # Rows are loaded SUB_L at a time, one block ahead of the one being computed: ptxas cannot move a load above
    # an earlier store (y might alias x), so the loads of a block must come before the previous block's stores
    # in program order to be in flight together.
    xr = common.load_rows(p_x, t0, L, stride_xl, m_d, t0 < L, SUB_L)
    sr = common.load_seq_rows(p_s, t0, L, stride_sl, t0 < L, SUB_L, HAS_SEQ_IDX)
    for i_s in tl.range(0, N_SUB):
        tb = t0 + i_s * SUB_L
        more = (i_s + 1 < N_SUB) & (tb + SUB_L < L)
        xn = common.load_rows(p_x, tb + SUB_L, L, stride_xl, m_d, more, SUB_L)
        sn = common.load_seq_rows(p_s, tb + SUB_L, L, stride_sl, more, SUB_L, HAS_SEQ_IDX)
        for j in tl.static_range(SUB_L):
            t = tb + j
            xt = xr[j].to(tl.float32)
            acc = b + c0 * xt
            if HAS_SEQ_IDX:
                st = sr[j]
                acc += tl.where(sm1 == st, c1 * xm1, 0.0)
                if W >= 3:
                    acc += tl.where(sm2 == st, c2 * xm2, 0.0)
                if W >= 4:
                    acc += tl.where(sm3 == st, c3 * xm3, 0.0)
                acc = tl.where(st >= 0, acc, 0.0)
                sm3 = sm2
                sm2 = sm1
                sm1 = st
            else:
                acc += c1 * xm1
                if W >= 3:
                    acc += c2 * xm2
                if W >= 4:
                    acc += c3 * xm3
            if SILU:
                acc = acc * sigmoid(acc)
            tl.store(p_y + t.to(tl.int64) * stride_yl, acc.to(y.dtype.element_ty), mask=m_d & as_mask(t < L))
            xm3 = xm2
            xm2 = xm1
            xm1 = xt
        xr = xn
        sr = sn

    if HAS_HT:
        if i_l == tl.num_programs(0) - 1:
            p_ht = ht + i_b * stride_htb + o_d * stride_htd
            _store_final_states(p_x, p_h0, p_ht, L, stride_xl, stride_h0w, stride_htw, m_d, W, HAS_H0)


@triton.jit(do_not_specialize=["NTOK_LOG2"])
def causal_conv1d_fwd_tile_kernel(
    x, weight, bias, seq_idx, h0, y, ht, D, L, NTOK_LOG2,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_ww, stride_sb, stride_sl, stride_h0b, stride_h0d, stride_h0w,
    stride_yb, stride_yd, stride_yl, stride_htb, stride_htd, stride_htw,
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_HT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Tiled forward. Grid: (cdiv(L, BLOCK_L), cdiv(D, BLOCK_D), B)."""
    i_l, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_t = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_d = o_d < D
    m_t = o_t < L
    p_x = x + i_b * stride_xb + o_d * stride_xd
    p_h0 = h0 + i_b * stride_h0b + o_d * stride_h0d if HAS_H0 else h0
    p_s = seq_idx + i_b * stride_sb if HAS_SEQ_IDX else seq_idx
    if HAS_SEQ_IDX:
        s0 = -1
        if HAS_H0:
            s0 = tl.load(p_s)
        s_cur = common.seq_at(p_s, o_t, L, stride_sl, s0)

    acc = tl.full((BLOCK_D, BLOCK_L), 0.0, tl.float32)
    for k in tl.static_range(W):
        ck = tl.load(weight + o_d * stride_wd + (W - 1 - k) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
        xk = common.load_at(
            p_x[:, None],
            p_h0[:, None] if HAS_H0 else p_h0,
            (o_t - k)[None, :],
            L,
            stride_xl,
            stride_h0w,
            m_d[:, None],
            W,
            HAS_H0,
        )
        if HAS_SEQ_IDX and k > 0:
            sk = common.seq_at(p_s, o_t - k, L, stride_sl, s0)
            xk = tl.where((sk == s_cur)[None, :], xk, 0.0)
        acc += ck[:, None] * xk
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[:, None]
    if HAS_SEQ_IDX:
        acc = tl.where((s_cur >= 0)[None, :], acc, 0.0)
    if SILU:
        acc = acc * sigmoid(acc)
    p_y = y + i_b * stride_yb + o_d[:, None] * stride_yd + o_t[None, :].to(tl.int64) * stride_yl
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_d[:, None] & m_t[None, :])

    if HAS_HT:
        if i_l == tl.num_programs(0) - 1:
            p_ht = ht + i_b * stride_htb + o_d * stride_htd
            _store_final_states(p_x, p_h0, p_ht, L, stride_xl, stride_h0w, stride_htw, m_d, W, HAS_H0)


def _row_configs(vec: int) -> list[triton.Config]:
    """Row-walk configs. Most have BLOCK_D = vec * 32 * num_warps, so each thread loads vec elements (16 bytes) of
    a row; the last two are narrower."""
    c = triton.Config
    return [
        c({"BLOCK_D": vec * 64, "SUB_L": 8, "N_SUB": 8}, num_warps=2, num_stages=1),
        c({"BLOCK_D": vec * 128, "SUB_L": 8, "N_SUB": 8}, num_warps=4, num_stages=1),
        c({"BLOCK_D": vec * 32, "SUB_L": 8, "N_SUB": 16}, num_warps=1, num_stages=1),
        c({"BLOCK_D": vec * 128, "SUB_L": 8, "N_SUB": 4}, num_warps=4, num_stages=1),
        c({"BLOCK_D": vec * 32, "SUB_L": 16, "N_SUB": 4}, num_warps=2, num_stages=1),
        # More bytes in flight per thread.
        c({"BLOCK_D": vec * 32, "SUB_L": 16, "N_SUB": 8}, num_warps=2, num_stages=1),
        c({"BLOCK_D": vec * 32, "SUB_L": 16, "N_SUB": 4}, num_warps=1, num_stages=1),
        # Short runs (an engine verifying 16 tokens): more programs, each walking fewer rows. At L=16 the configs
        # above give one program per 256+ channels that walks all 16 rows: too few programs to fill the GPU, each
        # with a long serial walk.
        c({"BLOCK_D": vec * 32, "SUB_L": 4, "N_SUB": 1}, num_warps=1, num_stages=1),
        c({"BLOCK_D": vec * 32, "SUB_L": 8, "N_SUB": 1}, num_warps=1, num_stages=1),
        # Narrower programs (4 or 2 elements per thread): more of them per SM when B * L is small.
        c({"BLOCK_D": vec * 16, "SUB_L": 16, "N_SUB": 4}, num_warps=1, num_stages=1),
        c({"BLOCK_D": vec * 8, "SUB_L": 16, "N_SUB": 4}, num_warps=1, num_stages=1),
    ]


def _tile_configs() -> list[triton.Config]:
    """Tiles for channel-first x: long along L, the contiguous axis."""
    c = triton.Config
    return [
        c({"BLOCK_D": 16, "BLOCK_L": 128}, num_warps=4, num_stages=1),
        c({"BLOCK_D": 32, "BLOCK_L": 128}, num_warps=4, num_stages=1),
        c({"BLOCK_D": 16, "BLOCK_L": 256}, num_warps=4, num_stages=1),
        c({"BLOCK_D": 32, "BLOCK_L": 256}, num_warps=8, num_stages=1),
    ]


# The autotuned kernels (compiled mode), made on first use; configs are built per element size.
autotuned_kernel = common.Autotuners(
    causal_conv1d_fwd_kernel,
    lambda elem_size: _row_configs(16 // elem_size),
    causal_conv1d_fwd_tile_kernel,
    _tile_configs,
)


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    final_states: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """Launches the forward kernel; arguments are already validated (see `causal_conv1d_fn`).

    Args:
        x: `[B, D, L]`, channel-last or any other strides.
        weight: `[D, W]`; bias `[D]` or None; seq_idx `[B, L]` int32 or None; initial_states `[B, D, W-1]` or None.
        final_states: `[B, D, W-1]` to write the last W-1 inputs into, or None.
        silu: apply SiLU.

    Returns:
        y `[B, D, L]` in the dtype and memory layout of x.
    """
    batch, dim, seqlen = x.shape
    channel_last = common.is_channel_last(x)
    y = common.empty_like_output(x.shape, x.dtype, x.device, channel_last)
    args = common.kernel_args(x, weight, bias, seq_idx, initial_states, (y, final_states), (y, final_states))
    flags = common.kernel_flags(weight, bias, seq_idx, initial_states, silu, HAS_HT=final_states is not None)
    if channel_last:
        kind, kernel = "rows", causal_conv1d_fwd_kernel
        grid = lambda meta: (
            triton.cdiv(seqlen, meta["SUB_L"] * meta["N_SUB"]),
            triton.cdiv(dim, meta["BLOCK_D"]),
            batch,
        )
    else:
        kind, kernel = "tile", causal_conv1d_fwd_tile_kernel
        grid = lambda meta: (triton.cdiv(seqlen, meta["BLOCK_L"]), triton.cdiv(dim, meta["BLOCK_D"]), batch)
    common.launch(kernel, kind, grid, x, args, flags, autotuned_kernel)
    return y
