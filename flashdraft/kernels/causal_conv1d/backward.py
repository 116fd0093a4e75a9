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

from flashdraft.kernels import tuned
from flashdraft.kernels.causal_conv1d.forward import (
    INTERPRET,
    _empty_like_output,
    _load_at,
    _load_rows,
    _load_seq_rows,
    _prune_by_width,
    _seq_at,
    _sigmoid,
    _strides,
    _sum,
    is_channel_last,
)

# Positions per program of the row-walking backward; fixed (not tuned) because it sizes the dweight workspace.
BWD_ROWS = 128
_INTERPRET_BWD_ROWS = 8


@triton.jit
def _bwd_grad_at(
    xt,
    dyt,
    st,
    c0,
    c1,
    c2,
    c3,
    b,
    xm1,
    xm2,
    xm3,
    sm1,
    sm2,
    sm3,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
):
    """g[r] from x[r], dy[r], seq_idx[r] and the window xm_k = x[r-k] (sm_k: its ids)."""
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
        sg = _sigmoid(z)
        g = dyt * sg * (1.0 + z * (1.0 - sg))
    if HAS_SEQ_IDX:
        # Padding outputs are the constant 0.
        g = tl.where(st >= 0, g, 0.0)
    return g


@triton.jit
def _bwd_store_dx(
    dht,
    dx,
    dh0,
    p_dx,
    i_b,
    o_d,
    m_d,
    u,
    t0,
    L,
    stride_dhtb,
    stride_dhtd,
    stride_dhtw,
    stride_dxl,
    stride_dh0b,
    stride_dh0d,
    stride_dh0w,
    c0,
    c1,
    c2,
    c3,
    gt,
    gm1,
    gm2,
    gm3,
    st,
    sm1,
    sm2,
    sm3,
    W: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_DH0: tl.constexpr,
):
    """dx[u] = sum_k c_k g[u+k] (u = r - (W-1); gt = g[r], gm_k = g[r-k], st / sm_k their ids); stores it when
    t0 <= u < L, and as the initial states' gradient when u < 0."""
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
        dxu += tl.load(p_dht, mask=m_d & (jf >= 0) & (jf < W - 1), other=0.0).to(tl.float32)
    tl.store(p_dx + u.to(tl.int64) * stride_dxl, dxu.to(p_dx.dtype.element_ty), mask=m_d & (u >= t0) & (u < L))
    if HAS_DH0:
        p_dh0 = dh0 + i_b * stride_dh0b + o_d * stride_dh0d + (u + W - 1) * stride_dh0w
        tl.store(p_dh0, dxu.to(dh0.dtype.element_ty), mask=m_d & (u < 0))


@triton.jit(do_not_specialize=["L", "NTOK_LOG2"])
def causal_conv1d_bwd_kernel(
    x,
    weight,
    bias,
    seq_idx,
    h0,
    dy,
    dht,
    dx,
    dh0,
    dw_part,
    db_part,
    D,
    L,
    NTOK_LOG2,
    stride_xb,
    stride_xd,
    stride_xl,
    stride_wd,
    stride_ww,
    stride_sb,
    stride_sl,
    stride_h0b,
    stride_h0d,
    stride_h0w,
    stride_dyb,
    stride_dyd,
    stride_dyl,
    stride_dhtb,
    stride_dhtd,
    stride_dhtw,
    stride_dxb,
    stride_dxd,
    stride_dxl,
    stride_dh0b,
    stride_dh0d,
    stride_dh0w,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_DH0: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUB_L: tl.constexpr,
    N_SUB: tl.constexpr,
):
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

    p_w = weight + o_d * stride_wd
    c0 = tl.load(p_w + (W - 1) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    c1 = tl.load(p_w + (W - 2) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    c2 = tl.full((BLOCK_D,), 0.0, tl.float32)
    c3 = tl.full((BLOCK_D,), 0.0, tl.float32)
    if W >= 3:
        c2 = tl.load(p_w + (W - 3) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    if W >= 4:
        c3 = tl.load(p_w + (W - 4) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    b = tl.full((BLOCK_D,), 0.0, tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)

    t0 = i_l * (SUB_L * N_SUB)
    xm1 = _load_at(p_x, p_h0, t0 - 1, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
    xm2 = tl.full((BLOCK_D,), 0.0, tl.float32)
    xm3 = tl.full((BLOCK_D,), 0.0, tl.float32)
    if W >= 3:
        xm2 = _load_at(p_x, p_h0, t0 - 2, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
    if W >= 4:
        xm3 = _load_at(p_x, p_h0, t0 - 3, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
    sm1 = t0 * 0
    sm2 = sm1
    sm3 = sm1
    if HAS_SEQ_IDX:
        s0 = -1
        if HAS_H0:
            s0 = tl.load(p_s)
        sm1 = _seq_at(p_s, t0 - 1, L, stride_sl, s0)
        sm2 = _seq_at(p_s, t0 - 2, L, stride_sl, s0)
        sm3 = _seq_at(p_s, t0 - 3, L, stride_sl, s0)
    # g before t0 is only needed for dx before t0, which this program does not write (or, for t0 == 0, the
    # initial states' gradient, where g before 0 is indeed 0).
    gm1 = tl.full((BLOCK_D,), 0.0, tl.float32)
    gm2 = tl.full((BLOCK_D,), 0.0, tl.float32)
    gm3 = tl.full((BLOCK_D,), 0.0, tl.float32)
    dw0 = tl.full((BLOCK_D,), 0.0, tl.float32)
    dw1 = tl.full((BLOCK_D,), 0.0, tl.float32)
    dw2 = tl.full((BLOCK_D,), 0.0, tl.float32)
    dw3 = tl.full((BLOCK_D,), 0.0, tl.float32)
    db = tl.full((BLOCK_D,), 0.0, tl.float32)

    # Rows are staged SUB_L at a time one block ahead, as in the forward (loads cannot pass earlier stores).
    xr = _load_rows(p_x, t0, L, stride_xl, m_d, t0 < L, SUB_L)
    dyr = _load_rows(p_dy, t0, L, stride_dyl, m_d, t0 < L, SUB_L)
    sr = _load_seq_rows(p_s, t0, L, stride_sl, t0 < L, SUB_L, HAS_SEQ_IDX)
    for i_s in tl.range(0, N_SUB):
        tb = t0 + i_s * SUB_L
        more = (i_s + 1 < N_SUB) & (tb + SUB_L < L)
        xn = _load_rows(p_x, tb + SUB_L, L, stride_xl, m_d, more, SUB_L)
        dyn = _load_rows(p_dy, tb + SUB_L, L, stride_dyl, m_d, more, SUB_L)
        sn = _load_seq_rows(p_s, tb + SUB_L, L, stride_sl, more, SUB_L, HAS_SEQ_IDX)
        for j in tl.static_range(SUB_L):
            r = tb + j
            xt = xr[j].to(tl.float32)
            st = sr[j]
            gt = _bwd_grad_at(
                xt, dyr[j].to(tl.float32), st, c0, c1, c2, c3, b, xm1, xm2, xm3, sm1, sm2, sm3, W, SILU, HAS_SEQ_IDX
            )
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
            _bwd_store_dx(
                dht,
                dx,
                dh0,
                p_dx,
                i_b,
                o_d,
                m_d,
                r - (W - 1),
                t0,
                L,
                stride_dhtb,
                stride_dhtd,
                stride_dhtw,
                stride_dxl,
                stride_dh0b,
                stride_dh0d,
                stride_dh0w,
                c0,
                c1,
                c2,
                c3,
                gt,
                gm1,
                gm2,
                gm3,
                st,
                sm1,
                sm2,
                sm3,
                W,
                HAS_SEQ_IDX,
                HAS_DHT,
                HAS_DH0,
            )
            xm3, xm2, xm1 = xm2, xm1, xt
            sm3, sm2, sm1 = sm2, sm1, st
            gm3, gm2, gm1 = gm2, gm1, gt
        xr = xn
        dyr = dyn
        sr = sn
    # Look ahead W-1 positions: their g completes dx of this program's last W-1 positions.
    ta = t0 + N_SUB * SUB_L
    xa = _load_rows(p_x, ta, L, stride_xl, m_d, ta < L, W - 1)
    dya = _load_rows(p_dy, ta, L, stride_dyl, m_d, ta < L, W - 1)
    sa = _load_seq_rows(p_s, ta, L, stride_sl, ta < L, W - 1, HAS_SEQ_IDX)
    for j in tl.static_range(W - 1):
        xt = xa[j].to(tl.float32)
        st = sa[j]
        gt = _bwd_grad_at(
            xt, dya[j].to(tl.float32), st, c0, c1, c2, c3, b, xm1, xm2, xm3, sm1, sm2, sm3, W, SILU, HAS_SEQ_IDX
        )
        _bwd_store_dx(
            dht,
            dx,
            dh0,
            p_dx,
            i_b,
            o_d,
            m_d,
            ta + j - (W - 1),
            t0,
            L,
            stride_dhtb,
            stride_dhtd,
            stride_dhtw,
            stride_dxl,
            stride_dh0b,
            stride_dh0d,
            stride_dh0w,
            c0,
            c1,
            c2,
            c3,
            gt,
            gm1,
            gm2,
            gm3,
            st,
            sm1,
            sm2,
            sm3,
            W,
            HAS_SEQ_IDX,
            HAS_DHT,
            HAS_DH0,
        )
        xm3, xm2, xm1 = xm2, xm1, xt
        sm3, sm2, sm1 = sm2, sm1, st
        gm3, gm2, gm1 = gm2, gm1, gt

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
    p_x,
    p_h0,
    p_dy,
    p_s,
    weight,
    bias,
    o_d,
    p,
    L,
    s0,
    m_d,
    stride_xl,
    stride_h0w,
    stride_dyl,
    stride_sl,
    stride_wd,
    stride_ww,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    """g at positions p `[1, N]` for the channels o_d `[BLOCK_D, 1]`, recomputing z from W shifted loads."""
    g = tl.load(p_dy + p.to(tl.int64) * stride_dyl, mask=m_d & (p >= 0) & (p < L), other=0.0).to(tl.float32)
    sp = p
    if HAS_SEQ_IDX:
        sp = _seq_at(p_s, p, L, stride_sl, s0)
    if SILU:
        z = tl.full(g.shape, 0.0, tl.float32)
        if HAS_BIAS:
            z += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        for k in tl.static_range(W):
            ck = tl.load(weight + o_d * stride_wd + (W - 1 - k) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
            xk = _load_at(p_x, p_h0, p - k, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
            if HAS_SEQ_IDX:
                xk = tl.where(_seq_at(p_s, p - k, L, stride_sl, s0) == sp, xk, 0.0)
            z += ck * xk
        sg = _sigmoid(z)
        g = g * sg * (1.0 + z * (1.0 - sg))
    if HAS_SEQ_IDX:
        g = tl.where(sp >= 0, g, 0.0)
    return g, sp


@triton.jit
def _tile_dx_at(
    p_x,
    p_h0,
    p_dy,
    p_s,
    p_dht,
    weight,
    bias,
    o_d,
    u,
    L,
    s0,
    m_d,
    stride_xl,
    stride_h0w,
    stride_dyl,
    stride_sl,
    stride_wd,
    stride_ww,
    stride_dhtw,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
):
    """dx at positions u `[1, N]` (negative u: the initial states' gradient), final-state gradient included."""
    su = u
    if HAS_SEQ_IDX:
        su = _seq_at(p_s, u, L, stride_sl, s0)
    acc = tl.full((o_d.shape[0], u.shape[1]), 0.0, tl.float32)
    for k in tl.static_range(W):
        ck = tl.load(weight + o_d * stride_wd + (W - 1 - k) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
        gk, sk = _tile_grad_at(
            p_x,
            p_h0,
            p_dy,
            p_s,
            weight,
            bias,
            o_d,
            u + k,
            L,
            s0,
            m_d,
            stride_xl,
            stride_h0w,
            stride_dyl,
            stride_sl,
            stride_wd,
            stride_ww,
            W,
            SILU,
            HAS_BIAS,
            HAS_SEQ_IDX,
            HAS_H0,
        )
        if HAS_SEQ_IDX:
            gk = tl.where(sk == su, gk, 0.0)
        acc += ck * gk
    if HAS_DHT:
        jf = u - L + (W - 1)
        acc += tl.load(p_dht + jf * stride_dhtw, mask=m_d & (jf >= 0) & (jf < W - 1), other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["L", "NTOK_LOG2"])
def causal_conv1d_bwd_tile_kernel(
    x,
    weight,
    bias,
    seq_idx,
    h0,
    dy,
    dht,
    dx,
    dh0,
    dw_part,
    db_part,
    D,
    L,
    NTOK_LOG2,
    stride_xb,
    stride_xd,
    stride_xl,
    stride_wd,
    stride_ww,
    stride_sb,
    stride_sl,
    stride_h0b,
    stride_h0d,
    stride_h0w,
    stride_dyb,
    stride_dyd,
    stride_dyl,
    stride_dhtb,
    stride_dhtd,
    stride_dhtw,
    stride_dxb,
    stride_dxd,
    stride_dxl,
    stride_dh0b,
    stride_dh0d,
    stride_dh0w,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_DH0: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
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

    dxt = _tile_dx_at(
        p_x,
        p_h0,
        p_dy,
        p_s,
        p_dht,
        weight,
        bias,
        o_d,
        o_t,
        L,
        s0,
        m_d,
        stride_xl,
        stride_h0w,
        stride_dyl,
        stride_sl,
        stride_wd,
        stride_ww,
        stride_dhtw,
        W,
        SILU,
        HAS_BIAS,
        HAS_SEQ_IDX,
        HAS_H0,
        HAS_DHT,
    )
    p_dx = dx + i_b * stride_dxb + o_d * stride_dxd + o_t.to(tl.int64) * stride_dxl
    tl.store(p_dx, dxt.to(dx.dtype.element_ty), mask=m_d & (o_t < L))

    g, st = _tile_grad_at(
        p_x,
        p_h0,
        p_dy,
        p_s,
        weight,
        bias,
        o_d,
        o_t,
        L,
        s0,
        m_d,
        stride_xl,
        stride_h0w,
        stride_dyl,
        stride_sl,
        stride_wd,
        stride_ww,
        W,
        SILU,
        HAS_BIAS,
        HAS_SEQ_IDX,
        HAS_H0,
    )
    row = i_b * tl.num_programs(0) + i_l
    o_dw = dw_part + row * W * D + o_d1
    for k in tl.static_range(W):
        xk = _load_at(p_x, p_h0, o_t - k, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
        if HAS_SEQ_IDX:
            xk = tl.where(_seq_at(p_s, o_t - k, L, stride_sl, s0) == st, xk, 0.0)
        tl.store(o_dw + (W - 1 - k) * D, _sum(g * xk, 1), mask=m_d1)
    if HAS_BIAS:
        tl.store(db_part + row * D + o_d1, _sum(g, 1), mask=m_d1)

    if HAS_DH0:
        if i_l == 0:
            u = (tl.arange(0, 4) - (W - 1))[None, :]
            dxu = _tile_dx_at(
                p_x,
                p_h0,
                p_dy,
                p_s,
                p_dht,
                weight,
                bias,
                o_d,
                u,
                L,
                s0,
                m_d,
                stride_xl,
                stride_h0w,
                stride_dyl,
                stride_sl,
                stride_wd,
                stride_ww,
                stride_dhtw,
                W,
                SILU,
                HAS_BIAS,
                HAS_SEQ_IDX,
                HAS_H0,
                HAS_DHT,
            )
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


_INTERPRET_ROW_META = {"BLOCK_D": 16, "SUB_L": 4, "N_SUB": _INTERPRET_BWD_ROWS // 4}
_INTERPRET_TILE_META = {"BLOCK_D": 8, "BLOCK_L": 16}

_tuned: dict = {}


def _tuned_kernel(kind: str, elem_size: int):
    key = (kind, elem_size)
    if key not in _tuned:
        if kind == "rows":
            # Half the forward's vector per thread: the backward keeps ~16 vectors of state per thread.
            vec = max(16 // elem_size // 2, 4)
            fn, configs = causal_conv1d_bwd_kernel, _row_configs(vec)
        else:
            fn, configs = causal_conv1d_bwd_tile_kernel, _tile_configs()
        _tuned[key] = triton.autotune(
            configs,
            key=["D", "W", "NTOK_LOG2", "SILU", "HAS_SEQ_IDX"],
            prune_configs_by={"early_config_prune": _prune_by_width},
            # Triton's disk cache of autotune results (beside its kernel cache): a new process skips the timing.
            cache_results=True,
        )(fn)
        # And on a fresh machine, the choices shipped for this GPU (kernels/tuned.py) where they cover the shape.
        tuned.fill(_tuned[key])
    return _tuned[key]


def causal_conv1d_bwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    dy: torch.Tensor,
    dfinal_states: torch.Tensor | None,
    silu: bool,
    need_dinitial_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launches the backward kernel.

    Args:
        x, weight, bias, seq_idx, initial_states: the forward's inputs (validated).
        dy: `[B, D, L]` gradient of y, any strides.
        dfinal_states: `[B, D, W-1]` gradient of the final states, or None.
        need_dinitial_states: compute the gradient of initial_states.

    Returns:
        dx `[B, D, L]` (dtype and layout of x), dweight `[D, W]` (dtype of weight), dbias `[D]` or None,
        dinitial_states `[B, D, W-1]` or None.
    """
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    channel_last = is_channel_last(x)
    kind = "rows" if channel_last else "tile"
    if channel_last and dy.stride(1) != 1:
        # The row walk reads dy rows like x rows; a transposed dy would make every load a gather.
        dy = dy.transpose(1, 2).contiguous().transpose(1, 2)
    dx = _empty_like_output(x.shape, x.dtype, x.device, channel_last)
    dh0 = None
    if need_dinitial_states and initial_states is not None:
        dh0 = _empty_like_output(initial_states.shape, initial_states.dtype, x.device, channel_last)
    if kind == "rows":
        rows = _INTERPRET_BWD_ROWS if INTERPRET else BWD_ROWS
    else:
        rows = _INTERPRET_TILE_META["BLOCK_L"] if INTERPRET else 128
    n_l = triton.cdiv(seqlen, rows)
    dw_part = _empty_like_output((batch * n_l, width, dim), torch.float32, x.device)
    db_part = _empty_like_output((batch * n_l, dim), torch.float32, x.device) if bias is not None else None

    args = (
        x,
        weight,
        bias,
        seq_idx,
        initial_states,
        dy,
        dfinal_states,
        dx,
        dh0,
        dw_part,
        db_part,
        dim,
        seqlen,
        (batch * seqlen).bit_length(),
        *x.stride(),
        *weight.stride(),
        *_strides(seq_idx, 2),
        *_strides(initial_states, 3),
        *dy.stride(),
        *_strides(dfinal_states, 3),
        *dx.stride(),
        *_strides(dh0, 3),
    )
    flags = dict(
        W=width,
        SILU=silu,
        HAS_BIAS=bias is not None,
        HAS_SEQ_IDX=seq_idx is not None,
        HAS_H0=initial_states is not None,
        HAS_DHT=dfinal_states is not None,
        HAS_DH0=dh0 is not None,
    )
    if INTERPRET:
        kernel = causal_conv1d_bwd_kernel if kind == "rows" else causal_conv1d_bwd_tile_kernel
        meta = _INTERPRET_ROW_META if kind == "rows" else _INTERPRET_TILE_META
        kernel[(n_l, triton.cdiv(dim, meta["BLOCK_D"]), batch)](*args, **flags, **meta)
    else:
        with torch.cuda.device(x.device):
            _tuned_kernel(kind, x.element_size())[lambda meta: (n_l, triton.cdiv(dim, meta["BLOCK_D"]), batch)](
                *args, **flags
            )
    # Taps were accumulated per program; sum them in a fixed order (deterministic).
    dweight = dw_part.sum(0).t().to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dh0
