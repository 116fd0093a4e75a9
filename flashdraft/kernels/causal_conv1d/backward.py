"""Backward Triton kernels of the causal depthwise conv1d and their host function.

With c_k = weight[:, W-1-k] (the tap on x[t-k]), pre-activation z and upstream gradient dy:

    g[t]     = dy[t] * silu'(z[t])            (dy[t] without activation; 0 where seq_idx[t] < 0)
    dx[u]    = sum_k c_k * g[u+k]             over the k with seq_idx[u] == seq_idx[u+k]
    dc_k     = sum_t g[t] * x[t-k]            over the t with seq_idx[t-k] == seq_idx[t]
    dbias    = sum_t g[t]

dx at a negative position u is the gradient of initial_states[:, W-1+u]; the gradient of the final states is
added to the W-1 inputs they were copied from. dweight and dbias are written as float32 partial sums, one row per
program, and summed afterwards (deterministic, no atomics).

- `causal_conv1d_bwd_kernel` (channel-last): walks `BWD_ROWS` positions per program like the forward, keeping the
  last W-1 inputs, gradients g and sequence ids in registers; dx[u] is final once g[u+W-1] is known, so each
  program walks W-1 positions past its end (a look-ahead that only recomputes g).
- `causal_conv1d_bwd_tile_kernel` (channel-first or any other strides): shifted loads, g recomputed per shift.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels.causal_conv1d import common
from flashdraft.kernels.utils import INTERPRET, as_mask, reduce_sum, sigmoid

# Positions per program of the row-walking backward; fixed (not tuned) because it sizes the dweight workspace.
BWD_ROWS = 128
_INTERPRET_BWD_ROWS = common.INTERPRET_ROW_META["SUB_L"] * common.INTERPRET_ROW_META["N_SUB"]


@triton.jit
def _bwd_grad_at(xt, dyt, st, taps, xw, sw, W: tl.constexpr, SILU: tl.constexpr, HAS_SEQ_IDX: tl.constexpr):
    """g[r] from x[r], dy[r], seq_idx[r], the taps and bias (c0, c1, c2, c3, b) and the window xw = (x[r-1],
    x[r-2], x[r-3]), sw their ids."""
    c0, c1, c2, c3, b = taps
    xm1, xm2, xm3 = xw
    sm1, sm2, sm3 = sw
    g = dyt
    if SILU:
        t1 = c1 * xm1
        t2 = c2 * xm2
        t3 = c3 * xm3
        if HAS_SEQ_IDX:
            t1 = tl.where(sm1 == st, t1, 0.0)
            t2 = tl.where(sm2 == st, t2, 0.0)
            t3 = tl.where(sm3 == st, t3, 0.0)
        z = b + c0 * xt + t1
        if W >= 3:
            z += t2
        if W >= 4:
            z += t3
        sg = sigmoid(z)
        g = dyt * sg * (1.0 + z * (1.0 - sg))
    if HAS_SEQ_IDX:
        # Padding outputs are the constant 0.
        g = tl.where(st >= 0, g, 0.0)
    return g


@triton.jit
def _bwd_store_dx(
    u,
    gt,
    st,
    taps,
    gw,
    sw,
    out,
    W: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_DH0: tl.constexpr,
):
    """dx[u] = sum_k c_k g[u+k] (u = r - (W-1); gt = g[r], gw = (g[r-1], g[r-2], g[r-3]), st and sw their ids);
    stores it when t0 <= u < L, and as the initial states' gradient when u < 0. out: see `_bwd_row`."""
    c0, c1, c2, c3, _ = taps
    gm1, gm2, gm3 = gw
    sm1, sm2, sm3 = sw
    p_dx, dht, dh0, i_b, o_d, m_d, t0, L = out[:8]
    stride_dhtb, stride_dhtd, stride_dhtw, stride_dxl, stride_dh0b, stride_dh0d, stride_dh0w = out[8:]
    if W == 2:
        su = sm1
        e1 = c1 * gt
        if HAS_SEQ_IDX:
            e1 = tl.where(su == st, e1, 0.0)
        dxu = c0 * gm1 + e1
    elif W == 3:
        su = sm2
        e2 = c2 * gt
        e1 = c1 * gm1
        if HAS_SEQ_IDX:
            e2 = tl.where(su == st, e2, 0.0)
            e1 = tl.where(su == sm1, e1, 0.0)
        dxu = c0 * gm2 + e1 + e2
    else:
        su = sm3
        e3 = c3 * gt
        e2 = c2 * gm1
        e1 = c1 * gm2
        if HAS_SEQ_IDX:
            e3 = tl.where(su == st, e3, 0.0)
            e2 = tl.where(su == sm1, e2, 0.0)
            e1 = tl.where(su == sm2, e1, 0.0)
        dxu = c0 * gm3 + e1 + e2 + e3
    if HAS_DHT:
        # Final state jf is a copy of the input at u = L - (W-1) + jf.
        jf = u - L + (W - 1)
        p_dht = dht + i_b * stride_dhtb + o_d * stride_dhtd + jf * stride_dhtw
        dxu += tl.load(p_dht, mask=m_d & as_mask(jf >= 0) & as_mask(jf < W - 1), other=0.0).to(tl.float32)
    m_u = m_d & as_mask(u >= t0) & as_mask(u < L)
    tl.store(p_dx + u.to(tl.int64) * stride_dxl, dxu.to(p_dx.dtype.element_ty), mask=m_u)
    if HAS_DH0:
        p_dh0 = dh0 + i_b * stride_dh0b + o_d * stride_dh0d + (u + W - 1) * stride_dh0w
        tl.store(p_dh0, dxu.to(dh0.dtype.element_ty), mask=m_d & as_mask(u < 0))


@triton.jit
def _bwd_row(
    x_r,
    dy_r,
    s_r,
    t_base,
    j,
    taps,
    win,
    acc,
    out,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_DH0: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """Position r = t_base + j of the row walk, from x[r], dy[r] (native dtype) and seq_idx[r]: g[r]; when
    ACCUMULATE, its terms of the partial sums; then dx[r-(W-1)], which g[r] completes. Returns the window and the
    sums moved on to r. The main walk and its look-ahead (ACCUMULATE off) both run it.

    taps: (c0, c1, c2, c3, b) of `common.load_taps`.
    win: (xw, sw, gw), x, sequence ids and g of positions r-1, r-2, r-3, each a tuple of three.
    acc: (dw0, dw1, dw2, dw3, db), dw_k = sum_t g[t] * x[t-k] and db = sum_t g[t] over the program's positions.
    out: (p_dx, dht, dh0, i_b, o_d, m_d, t0, L, stride_dhtb, stride_dhtd, stride_dhtw, stride_dxl, stride_dh0b,
        stride_dh0d, stride_dh0w): the program's channels of dx, the gradients of the final and initial states
        (stand-ins when absent), the program's batch row, channels and first position t0 (dx before t0 is another
        program's), and the strides.
    """
    xw, sw, gw = win
    xt = x_r.to(tl.float32)
    st = s_r
    gt = _bwd_grad_at(xt, dy_r.to(tl.float32), st, taps, xw, sw, W, SILU, HAS_SEQ_IDX)
    if ACCUMULATE:
        xm1, xm2, xm3 = xw
        sm1, sm2, sm3 = sw
        dw0, dw1, dw2, dw3, db = acc
        db += gt
        dw0 += gt * xt
        if HAS_SEQ_IDX:
            dw1 += tl.where(sm1 == st, gt * xm1, 0.0)
            dw2 += tl.where(sm2 == st, gt * xm2, 0.0)
            dw3 += tl.where(sm3 == st, gt * xm3, 0.0)
        else:
            dw1 += gt * xm1
            dw2 += gt * xm2
            dw3 += gt * xm3
        acc = (dw0, dw1, dw2, dw3, db)
    _bwd_store_dx(t_base + j - (W - 1), gt, st, taps, gw, sw, out, W, HAS_SEQ_IDX, HAS_DHT, HAS_DH0)
    win = ((xt, xw[0], xw[1]), (st, sw[0], sw[1]), (gt, gw[0], gw[1]))
    return win, acc


@triton.jit(do_not_specialize=["L", "NTOK_LOG2"])
def causal_conv1d_bwd_kernel(
    x, weight, bias, seq_idx, h0, dy, dht, dx, dh0, dw_part, db_part, D, L, NTOK_LOG2,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_ww, stride_sb, stride_sl, stride_h0b, stride_h0d, stride_h0w,
    stride_dyb, stride_dyd, stride_dyl, stride_dhtb, stride_dhtd, stride_dhtw, stride_dxb, stride_dxd, stride_dxl,
    stride_dh0b, stride_dh0d, stride_dh0w,
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, BLOCK_D: tl.constexpr, SUB_L: tl.constexpr, N_SUB: tl.constexpr,
):  # fmt: skip
    """Row-walking backward. Grid: (cdiv(L, SUB_L * N_SUB), cdiv(D, BLOCK_D), B).

    dw_part: `[B * grid[0], W, D]` float32, row (b, program) holds sum_t g[t] * x[t-k] of its positions;
    db_part: `[B * grid[0], D]` float32 likewise for sum_t g[t].
    """
    i_l, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_x = x + i_b * stride_xb + o_d * stride_xd
    p_dy = dy + i_b * stride_dyb + o_d * stride_dyd
    p_dx = dx + i_b * stride_dxb + o_d * stride_dxd
    p_h0 = h0 + i_b * stride_h0b + o_d * stride_h0d if HAS_H0 else h0
    p_s = seq_idx + i_b * stride_sb if HAS_SEQ_IDX else seq_idx

    c0, c1, c2, c3, b = common.load_taps(weight, bias, o_d, m_d, stride_wd, stride_ww, W, HAS_BIAS)
    t0 = i_l * (SUB_L * N_SUB)
    xm1, xm2, xm3, sm1, sm2, sm3 = common.load_halo(
        p_x, p_h0, p_s, t0, L, m_d, stride_xl, stride_h0w, stride_sl, W, HAS_SEQ_IDX, HAS_H0
    )
    taps = (c0, c1, c2, c3, b)
    # Where dx goes. An absent gradient of the states is never written; dx stands in for it (a tuple cannot hold
    # None).
    out = (p_dx, dht if HAS_DHT else dx, dh0 if HAS_DH0 else dx, i_b, o_d, m_d, t0, L)
    out += (stride_dhtb, stride_dhtd, stride_dhtw, stride_dxl, stride_dh0b, stride_dh0d, stride_dh0w)
    # g before t0 is only needed for dx before t0, which this program does not write (or, for t0 == 0, the
    # initial states' gradient, where g before 0 is indeed 0).
    zero = tl.full((BLOCK_D,), 0.0, tl.float32)
    win = ((xm1, xm2, xm3), (sm1, sm2, sm3), (zero, zero, zero))
    acc = (zero, zero, zero, zero, zero)

    # Rows are staged SUB_L at a time one block ahead, as in the forward (loads cannot pass earlier stores).
    xr = common.load_rows(p_x, t0, L, stride_xl, m_d, t0 < L, SUB_L)
    dyr = common.load_rows(p_dy, t0, L, stride_dyl, m_d, t0 < L, SUB_L)
    sr = common.load_seq_rows(p_s, t0, L, stride_sl, t0 < L, SUB_L, HAS_SEQ_IDX)
    for i_s in tl.range(0, N_SUB):
        tb = t0 + i_s * SUB_L
        more = (i_s + 1 < N_SUB) & (tb + SUB_L < L)
        xn = common.load_rows(p_x, tb + SUB_L, L, stride_xl, m_d, more, SUB_L)
        dyn = common.load_rows(p_dy, tb + SUB_L, L, stride_dyl, m_d, more, SUB_L)
        sn = common.load_seq_rows(p_s, tb + SUB_L, L, stride_sl, more, SUB_L, HAS_SEQ_IDX)
        for j in tl.static_range(SUB_L):
            win, acc = _bwd_row(
                xr[j], dyr[j], sr[j], tb, j, taps, win, acc, out, W, SILU, HAS_SEQ_IDX, HAS_DHT, HAS_DH0, True
            )
        xr = xn
        dyr = dyn
        sr = sn
    # Look ahead W-1 positions: their g completes dx of this program's last W-1 positions.
    ta = t0 + N_SUB * SUB_L
    xa = common.load_rows(p_x, ta, L, stride_xl, m_d, ta < L, W - 1)
    dya = common.load_rows(p_dy, ta, L, stride_dyl, m_d, ta < L, W - 1)
    sa = common.load_seq_rows(p_s, ta, L, stride_sl, ta < L, W - 1, HAS_SEQ_IDX)
    for j in tl.static_range(W - 1):
        win, acc = _bwd_row(
            xa[j], dya[j], sa[j], ta, j, taps, win, acc, out, W, SILU, HAS_SEQ_IDX, HAS_DHT, HAS_DH0, False
        )

    dw0, dw1, dw2, dw3, db = acc
    row = i_b * tl.num_programs(0) + i_l
    p_dw = dw_part + row * W * D + o_d
    tl.store(p_dw + (W - 1) * D, dw0, mask=m_d)
    tl.store(p_dw + (W - 2) * D, dw1, mask=m_d)
    if W >= 3:
        tl.store(p_dw + (W - 3) * D, dw2, mask=m_d)
    if W >= 4:
        tl.store(p_dw + (W - 4) * D, dw3, mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + row * D + o_d, db, mask=m_d)


@triton.jit
def _tile_grad_at(
    src,
    p_h0,
    p_s,
    bias,
    p,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    """g at positions p `[1, N]` for the channels o_d `[BLOCK_D, 1]`, recomputing z from W shifted loads; returns
    it and the sequence ids of p.

    src: (p_x, p_dy, weight, o_d, m_d, L, s0, stride_xl, stride_h0w, stride_dyl, stride_sl, stride_wd, stride_ww,
        stride_dhtw), the program's channels of x and dy, the length, the sequence id of the initial states and
        the strides; p_h0, p_s, bias: the program's initial states, sequence ids and bias.
    """
    p_x, p_dy, weight, o_d, m_d, L, s0, stride_xl, stride_h0w, stride_dyl, stride_sl, stride_wd, stride_ww, _ = src
    g = tl.load(p_dy + p.to(tl.int64) * stride_dyl, mask=m_d & (p >= 0) & (p < L), other=0.0).to(tl.float32)
    sp = p
    if HAS_SEQ_IDX:
        sp = common.seq_at(p_s, p, L, stride_sl, s0)
    if SILU:
        z = tl.full(g.shape, 0.0, tl.float32)
        if HAS_BIAS:
            z += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        for k in tl.static_range(W):
            ck = tl.load(weight + o_d * stride_wd + (W - 1 - k) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
            xk = common.load_at(p_x, p_h0, p - k, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
            if HAS_SEQ_IDX:
                xk = tl.where(common.seq_at(p_s, p - k, L, stride_sl, s0) == sp, xk, 0.0)
            z += ck * xk
        sg = sigmoid(z)
        g = g * sg * (1.0 + z * (1.0 - sg))
    if HAS_SEQ_IDX:
        g = tl.where(sp >= 0, g, 0.0)
    return g, sp


@triton.jit
def _tile_dx_at(
    src,
    p_h0,
    p_s,
    bias,
    p_dht,
    u,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
):
    """dx at positions u `[1, N]` (negative u: the initial states' gradient), final-state gradient included.
    src, p_h0, p_s, bias: see `_tile_grad_at`; p_dht: the program's channels of the final states' gradient."""
    _, _, weight, o_d, m_d, L, s0, _, _, _, stride_sl, stride_wd, stride_ww, stride_dhtw = src
    su = u
    if HAS_SEQ_IDX:
        su = common.seq_at(p_s, u, L, stride_sl, s0)
    acc = tl.full((o_d.shape[0], u.shape[1]), 0.0, tl.float32)
    for k in tl.static_range(W):
        ck = tl.load(weight + o_d * stride_wd + (W - 1 - k) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
        gk, sk = _tile_grad_at(src, p_h0, p_s, bias, u + k, W, SILU, HAS_BIAS, HAS_SEQ_IDX, HAS_H0)
        if HAS_SEQ_IDX:
            gk = tl.where(sk == su, gk, 0.0)
        acc += ck * gk
    if HAS_DHT:
        jf = u - L + (W - 1)
        acc += tl.load(p_dht + jf * stride_dhtw, mask=m_d & (jf >= 0) & (jf < W - 1), other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["L", "NTOK_LOG2"])
def causal_conv1d_bwd_tile_kernel(
    x, weight, bias, seq_idx, h0, dy, dht, dx, dh0, dw_part, db_part, D, L, NTOK_LOG2,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_ww, stride_sb, stride_sl, stride_h0b, stride_h0d, stride_h0w,
    stride_dyb, stride_dyd, stride_dyl, stride_dhtb, stride_dhtd, stride_dhtw, stride_dxb, stride_dxd, stride_dxl,
    stride_dh0b, stride_dh0d, stride_dh0w,
    W: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Tiled backward. Grid: (cdiv(L, BLOCK_L), cdiv(D, BLOCK_D), B); dw_part / db_part as the row kernel's."""
    i_l, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d1 = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d1 = o_d1 < D
    o_d = o_d1[:, None]
    m_d = m_d1[:, None]
    o_t = (i_l * BLOCK_L + tl.arange(0, BLOCK_L))[None, :]
    p_x = x + i_b * stride_xb + o_d * stride_xd
    p_dy = dy + i_b * stride_dyb + o_d * stride_dyd
    p_h0 = h0 + i_b * stride_h0b + o_d * stride_h0d if HAS_H0 else h0
    p_dht = dht + i_b * stride_dhtb + o_d * stride_dhtd if HAS_DHT else dht
    p_s = seq_idx + i_b * stride_sb if HAS_SEQ_IDX else seq_idx
    s0 = -1
    if HAS_SEQ_IDX and HAS_H0:
        s0 = tl.load(p_s)
    # What the shifted loads read besides h0, seq_idx and bias (a tuple cannot hold those when they are absent).
    src = (p_x, p_dy, weight, o_d, m_d, L, s0)
    src += (stride_xl, stride_h0w, stride_dyl, stride_sl, stride_wd, stride_ww, stride_dhtw)

    dxt = _tile_dx_at(src, p_h0, p_s, bias, p_dht, o_t, W, SILU, HAS_BIAS, HAS_SEQ_IDX, HAS_H0, HAS_DHT)
    p_dx = dx + i_b * stride_dxb + o_d * stride_dxd + o_t.to(tl.int64) * stride_dxl
    tl.store(p_dx, dxt.to(dx.dtype.element_ty), mask=m_d & (o_t < L))

    g, st = _tile_grad_at(src, p_h0, p_s, bias, o_t, W, SILU, HAS_BIAS, HAS_SEQ_IDX, HAS_H0)
    row = i_b * tl.num_programs(0) + i_l
    o_dw = dw_part + row * W * D + o_d1
    for k in tl.static_range(W):
        xk = common.load_at(p_x, p_h0, o_t - k, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
        if HAS_SEQ_IDX:
            xk = tl.where(common.seq_at(p_s, o_t - k, L, stride_sl, s0) == st, xk, 0.0)
        tl.store(o_dw + (W - 1 - k) * D, reduce_sum(g * xk, 1), mask=m_d1)
    if HAS_BIAS:
        tl.store(db_part + row * D + o_d1, reduce_sum(g, 1), mask=m_d1)

    if HAS_DH0:
        if i_l == 0:
            u = (tl.arange(0, 4) - (W - 1))[None, :]
            dxu = _tile_dx_at(src, p_h0, p_s, bias, p_dht, u, W, SILU, HAS_BIAS, HAS_SEQ_IDX, HAS_H0, HAS_DHT)
            p_dh0 = dh0 + i_b * stride_dh0b + o_d * stride_dh0d + (u + W - 1) * stride_dh0w
            tl.store(p_dh0, dxu.to(dh0.dtype.element_ty), mask=m_d & (u < 0))


def _row_configs(vec: int) -> list[triton.Config]:
    """Row-walk configs, SUB_L * N_SUB == BWD_ROWS; vec elements per thread and row."""
    c = triton.Config
    return [
        c({"BLOCK_D": vec * 32, "SUB_L": 8, "N_SUB": BWD_ROWS // 8}, num_warps=1, num_stages=1),
        c({"BLOCK_D": vec * 64, "SUB_L": 8, "N_SUB": BWD_ROWS // 8}, num_warps=2, num_stages=1),
        c({"BLOCK_D": vec * 128, "SUB_L": 8, "N_SUB": BWD_ROWS // 8}, num_warps=4, num_stages=1),
        c({"BLOCK_D": vec * 64, "SUB_L": 4, "N_SUB": BWD_ROWS // 4}, num_warps=2, num_stages=1),
    ]


def _tile_configs() -> list[triton.Config]:
    c = triton.Config
    return [
        c({"BLOCK_D": 8, "BLOCK_L": 128}, num_warps=4, num_stages=1),
        c({"BLOCK_D": 16, "BLOCK_L": 128}, num_warps=8, num_stages=1),
    ]


# The autotuned kernels (compiled mode), made on first use. Half the forward's vector per thread in the row walk:
# the backward keeps ~16 vectors of state per thread.
autotuned_kernel = common.Autotuners(
    causal_conv1d_bwd_kernel,
    lambda elem_size: _row_configs(max(16 // elem_size // 2, 4)),
    causal_conv1d_bwd_tile_kernel,
    _tile_configs,
)


def causal_conv1d_bwd(
    inputs: tuple[torch.Tensor | None, ...],
    dy: torch.Tensor,
    dfinal_states: torch.Tensor | None,
    silu: bool,
    need_dinitial_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launches the backward kernel.

    Args:
        inputs: the forward's (validated) x, weight, bias, seq_idx and initial_states, as autograd saved them.
        dy: `[B, D, L]` gradient of y, any strides.
        dfinal_states: `[B, D, W-1]` gradient of the final states, or None.
        need_dinitial_states: compute the gradient of initial_states.

    Returns:
        dx `[B, D, L]` (dtype and layout of x), dweight `[D, W]` (dtype of weight), dbias `[D]` or None,
        dinitial_states `[B, D, W-1]` or None.
    """
    x, weight, bias, seq_idx, initial_states = inputs
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    channel_last = common.is_channel_last(x)
    kind = "rows" if channel_last else "tile"
    if channel_last and dy.stride(1) != 1:
        # The row walk reads dy rows like x rows; a transposed dy would make every load a gather.
        dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
    dx = common.empty_like_output(x.shape, x.dtype, x.device, channel_last)
    dh0 = None
    if need_dinitial_states and initial_states is not None:
        dh0 = common.empty_like_output(initial_states.shape, initial_states.dtype, x.device, channel_last)
    if kind == "rows":
        rows = _INTERPRET_BWD_ROWS if INTERPRET else BWD_ROWS
    else:
        rows = common.INTERPRET_TILE_META["BLOCK_L"] if INTERPRET else 128
    n_l = triton.cdiv(seqlen, rows)
    dw_part = common.empty_like_output((batch * n_l, width, dim), torch.float32, x.device)
    db_part = common.empty_like_output((batch * n_l, dim), torch.float32, x.device) if bias is not None else None

    tensors = (dy, dfinal_states, dx, dh0, dw_part, db_part)
    args = common.kernel_args(x, weight, bias, seq_idx, initial_states, tensors, (dy, dfinal_states, dx, dh0))
    flags = common.kernel_flags(
        weight, bias, seq_idx, initial_states, silu, HAS_DHT=dfinal_states is not None, HAS_DH0=dh0 is not None
    )
    kernel = causal_conv1d_bwd_kernel if kind == "rows" else causal_conv1d_bwd_tile_kernel
    common.launch(
        kernel, kind, lambda meta: (n_l, triton.cdiv(dim, meta["BLOCK_D"]), batch), x, args, flags, autotuned_kernel
    )
    # Taps were accumulated per program; sum them in a fixed order (deterministic).
    dweight = dw_part.sum(0).t().to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dh0
