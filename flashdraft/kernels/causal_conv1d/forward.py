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

from flashdraft.kernels import tuned


def _empty_like_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, channel_last: bool = False):
    """Allocates a kernel output `[B, D, L]` (or any shape when not channel_last), uninitialised.

    Every kernel output of this package is allocated here, and each kernel must write all of it: the tests patch
    this function to return NaN-filled tensors, so that an element a kernel fails to write shows.

    channel_last: the memory of `[B, L, D]`, returned as its `[B, D, L]` transposed view.
    """
    if channel_last:
        return torch.empty((shape[0], shape[2], shape[1]), dtype=dtype, device=device).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=device)


# The kernels call only Triton builtins and functions of this package: the interpreter cannot call Triton's own
# @jit library functions (tl.sigmoid, tl.sum, tl.zeros, ...) when triton was first imported without
# TRITON_INTERPRET, as happens when another module imported it before this package.
@triton.jit
def _add(a, b):
    return a + b


# Triton reads TRITON_INTERPRET when `@triton.jit` runs, i.e. when this module is imported: the kernels of this
# package are then interpreted (and run on CPU tensors) instead of compiled.
INTERPRET = not isinstance(_add, triton.runtime.JITFunction)
# Compiled kernels take SiLU's sigmoid from approximate PTX instructions (the interpreter runs no PTX).
_FAST_SIGMOID = tl.constexpr(not INTERPRET)


@triton.jit
def _sigmoid(z):
    """1 / (1 + exp(-z)) in float32. Compiled, 4 instructions where `tl.exp` and `/` compile to 12 with their range
    checks: the same ex2.approx that tl.exp uses and rcp.approx (1 ulp), both flushing subnormals, which changes
    nothing here (the denominator is >= 1; exp(-z) below 2^-126 only meets 1 + exp(-z) = 1). SiLU's instructions,
    not memory, set the channel-last forward's speed on the H200."""
    if _FAST_SIGMOID:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; add.f32 t, t, 0f3F800000; "
            "rcp.approx.ftz.f32 $0, t; }",
            "=r,r",
            [z],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def _load_at(p_x, p_h0, p, L, stride_xl, stride_h0w, mask, W: tl.constexpr, HAS_H0: tl.constexpr):
    """Input rows at positions p (a scalar or a vector broadcast against the mask), in float32:
    x[p] for 0 <= p < L, initial_states[W-1+p] for -(W-1) <= p < 0, and 0 elsewhere."""
    v = tl.load(p_x + tl.cast(p, tl.int64) * stride_xl, mask=mask & (p >= 0) & (p < L), other=0.0).to(tl.float32)
    if HAS_H0:
        v += tl.load(p_h0 + (p + W - 1) * stride_h0w, mask=mask & (p < 0) & (p > -W), other=0.0).to(tl.float32)
    return v


@triton.jit
def _load_rows(p_x, t_first, L, stride_xl, m_d, active, SUB_L: tl.constexpr):
    """The SUB_L rows x[t_first + j] (native dtype, 0 past L or when not active), as a tuple."""
    rows = ()
    for j in tl.static_range(SUB_L):
        t = t_first + j
        rows = rows + (tl.load(p_x + t.to(tl.int64) * stride_xl, mask=m_d & (t < L) & active, other=0.0),)
    return rows


@triton.jit
def _load_seq_rows(p_s, t_first, L, stride_sl, active, SUB_L: tl.constexpr, HAS_SEQ_IDX: tl.constexpr):
    """seq_idx[t_first + j] (-1 past L) as a tuple; a tuple of zeros without seq_idx."""
    ids = ()
    for j in tl.static_range(SUB_L):
        t = t_first + j
        if HAS_SEQ_IDX:
            ids = ids + (tl.load(p_s + t * stride_sl, mask=(t < L) & active, other=-1),)
        else:
            ids = ids + (t * 0,)
    return ids


@triton.jit
def _seq_at(p_s, p, L, stride_sl, s0):
    """Sequence ids at positions p: seq_idx[p] inside [0, L), s0 (the id of the initial states) before, -1 after."""
    s = tl.load(p_s + p * stride_sl, mask=(p >= 0) & (p < L), other=-1)
    return tl.where(p < 0, s0, s)


@triton.jit
def _store_final_states(
    p_x, p_h0, p_ht, L, stride_xl, stride_h0w, stride_htw, m_d, W: tl.constexpr, HAS_H0: tl.constexpr
):
    """final_states[:, j] = input at position L-(W-1)+j (initial states when that is negative)."""
    for j in tl.static_range(W - 1):
        v = _load_at(p_x, p_h0, L - (W - 1) + j, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
        tl.store(p_ht + j * stride_htw, v.to(p_ht.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["L", "NTOK_LOG2"])
def causal_conv1d_fwd_kernel(
    x,
    weight,
    bias,
    seq_idx,
    h0,
    y,
    ht,
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
    stride_yb,
    stride_yd,
    stride_yl,
    stride_htb,
    stride_htd,
    stride_htw,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_HT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUB_L: tl.constexpr,
    N_SUB: tl.constexpr,
):
    """Row-walking forward. Grid: (cdiv(L, SUB_L * N_SUB), cdiv(D, BLOCK_D), B). NTOK_LOG2 only keys autotuning."""
    i_l, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_x = x + i_b * stride_xb + o_d * stride_xd
    p_y = y + i_b * stride_yb + o_d * stride_yd
    p_h0 = h0 + i_b * stride_h0b + o_d * stride_h0d if HAS_H0 else h0
    p_s = seq_idx + i_b * stride_sb if HAS_SEQ_IDX else seq_idx

    # Tap k multiplies x[t-k]: c_k = weight[:, W-1-k].
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
    # The W-1 rows before t0 (x[t0-1] in xm1, ...) and their sequence ids.
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

    # Rows are loaded SUB_L at a time, one block ahead of the one being computed: ptxas cannot move a load above
    # an earlier store (y might alias x), so the loads of a block must come before the previous block's stores
    # in program order to be in flight together.
    xr = _load_rows(p_x, t0, L, stride_xl, m_d, t0 < L, SUB_L)
    sr = _load_seq_rows(p_s, t0, L, stride_sl, t0 < L, SUB_L, HAS_SEQ_IDX)
    for i_s in tl.range(0, N_SUB):
        tb = t0 + i_s * SUB_L
        more = (i_s + 1 < N_SUB) & (tb + SUB_L < L)
        xn = _load_rows(p_x, tb + SUB_L, L, stride_xl, m_d, more, SUB_L)
        sn = _load_seq_rows(p_s, tb + SUB_L, L, stride_sl, more, SUB_L, HAS_SEQ_IDX)
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
                acc = acc * _sigmoid(acc)
            tl.store(p_y + t.to(tl.int64) * stride_yl, acc.to(y.dtype.element_ty), mask=m_d & (t < L))
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
    x,
    weight,
    bias,
    seq_idx,
    h0,
    y,
    ht,
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
    stride_yb,
    stride_yd,
    stride_yl,
    stride_htb,
    stride_htd,
    stride_htw,
    W: tl.constexpr,
    SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_HT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
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
        s_cur = _seq_at(p_s, o_t, L, stride_sl, s0)

    acc = tl.full((BLOCK_D, BLOCK_L), 0.0, tl.float32)
    for k in tl.static_range(W):
        ck = tl.load(weight + o_d * stride_wd + (W - 1 - k) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
        xk = _load_at(
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
            sk = _seq_at(p_s, o_t - k, L, stride_sl, s0)
            xk = tl.where((sk == s_cur)[None, :], xk, 0.0)
        acc += ck[:, None] * xk
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[:, None]
    if HAS_SEQ_IDX:
        acc = tl.where((s_cur >= 0)[None, :], acc, 0.0)
    if SILU:
        acc = acc * _sigmoid(acc)
    p_y = y + i_b * stride_yb + o_d[:, None] * stride_yd + o_t[None, :].to(tl.int64) * stride_yl
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_d[:, None] & m_t[None, :])

    if HAS_HT:
        if i_l == tl.num_programs(0) - 1:
            p_ht = ht + i_b * stride_htb + o_d * stride_htd
            _store_final_states(p_x, p_h0, p_ht, L, stride_xl, stride_h0w, stride_htw, m_d, W, HAS_H0)


def _prune_by_width(configs, named_args, **kwargs):
    # Blocks much wider than D only mask lanes off; keep the narrowest config at least.
    cap = max(triton.next_power_of_2(named_args["D"]), min(c.kwargs["BLOCK_D"] for c in configs))
    return [c for c in configs if c.kwargs["BLOCK_D"] <= cap]


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
        # above give one program per 256+ channels that walks all 16 rows (9 us at D=10240 on the H200).
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


# Small blocks under the interpreter, so that CPU tests cross program boundaries with small shapes.
_INTERPRET_ROW_META = {"BLOCK_D": 16, "SUB_L": 4, "N_SUB": 2}
_INTERPRET_TILE_META = {"BLOCK_D": 8, "BLOCK_L": 16}

_tuned: dict[tuple[str, int], triton.runtime.Autotuner] = {}


def _tuned_kernel(kind: str, elem_size: int):
    """The autotuned kernel of `kind` ("rows" or "tile") for an element size (configs are built per element size)."""
    key = (kind, elem_size)
    if key not in _tuned:
        if kind == "rows":
            fn, configs = causal_conv1d_fwd_kernel, _row_configs(16 // elem_size)
        else:
            fn, configs = causal_conv1d_fwd_tile_kernel, _tile_configs()
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


def is_channel_last(x: torch.Tensor) -> bool:
    """x `[B, D, L]` has D contiguous (a transposed view of `[B, L, D]`), as causal-conv1d decides it."""
    return x.stride(1) == 1 and x.stride(2) != 1


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return t.stride() if t is not None else (0,) * n


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
    width = weight.shape[1]
    channel_last = is_channel_last(x)
    y = _empty_like_output(x.shape, x.dtype, x.device, channel_last)
    args = (
        x,
        weight,
        bias,
        seq_idx,
        initial_states,
        y,
        final_states,
        dim,
        seqlen,
        (batch * seqlen).bit_length(),
        *x.stride(),
        *weight.stride(),
        *_strides(seq_idx, 2),
        *_strides(initial_states, 3),
        *y.stride(),
        *_strides(final_states, 3),
    )
    flags = dict(
        W=width,
        SILU=silu,
        HAS_BIAS=bias is not None,
        HAS_SEQ_IDX=seq_idx is not None,
        HAS_H0=initial_states is not None,
        HAS_HT=final_states is not None,
    )
    kind = "rows" if channel_last else "tile"
    if kind == "rows":
        grid = lambda meta: (
            triton.cdiv(seqlen, meta["SUB_L"] * meta["N_SUB"]),
            triton.cdiv(dim, meta["BLOCK_D"]),
            batch,
        )
    else:
        grid = lambda meta: (triton.cdiv(seqlen, meta["BLOCK_L"]), triton.cdiv(dim, meta["BLOCK_D"]), batch)
    if INTERPRET:
        kernel = causal_conv1d_fwd_kernel if kind == "rows" else causal_conv1d_fwd_tile_kernel
        meta = _INTERPRET_ROW_META if kind == "rows" else _INTERPRET_TILE_META
        kernel[grid(meta)](*args, **flags, **meta)
    else:
        with torch.cuda.device(x.device):
            _tuned_kernel(kind, x.element_size())[grid](*args, **flags)
    return y
