"""What the causal conv1d's kernels and host functions share.

Host side: the checks of arguments common to `causal_conv1d_fn` and `causal_conv1d_update`, the allocation of every
kernel output, the layout test, and the autotuning of the forward and backward kernels (one key, one pruning rule,
the shipped choices of kernels/tuned.py).

Device side (@triton.jit): loads of input rows and sequence ids at positions that may fall before the sequence
(initial states) or past it, and the prologue of the row-walking kernels (`load_taps`, `load_halo`). A position p
or t below is a scalar in the row-walking kernels and a block of positions in the tiled ones.

The kernel modules call these through the module (`common.load_rows(...)`): the tests replace
`common.empty_like_output` to poison every output, and a name imported elsewhere would escape that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels import tuned
from flashdraft.kernels.utils import INTERPRET, as_mask

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Small blocks under the interpreter, so that CPU tests cross program boundaries with small shapes.
INTERPRET_ROW_META = {"BLOCK_D": 16, "SUB_L": 4, "N_SUB": 2}
INTERPRET_TILE_META = {"BLOCK_D": 8, "BLOCK_L": 16}

# What the forward and backward kernels are autotuned on (besides every tensor's dtype, which Triton adds).
AUTOTUNE_KEY = ["D", "W", "NTOK_LOG2", "SILU", "HAS_SEQ_IDX"]


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} ({t.dtype}, {t.device})"


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"expected {name} of dtype float32, float16 or bfloat16, got {t.dtype}")


def check_weight(weight: torch.Tensor, dim: int) -> None:
    """weight `[D, W]`, 2 <= W <= 4, of a float dtype."""
    if weight.dim() != 2 or weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"expected weight of shape (D, W) = ({dim}, W) with 2 <= W <= 4, got {describe(weight)}")
    check_float("weight", weight)


def check_devices(x: torch.Tensor, fn_name: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor on the device of x, and a device the kernels run on (see `triton_available_for`)."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"expected {name} on the device of x ({x.device}), got {t.device}")
    if not (x.is_cuda or INTERPRET):
        raise RuntimeError(
            f"{fn_name} runs Triton kernels: it needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            f"flashdraft.kernels is imported; got x on {x.device}"
        )


def empty_like_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, channel_last: bool = False):
    """Allocates a kernel output `[B, D, L]` (or any shape when not channel_last), uninitialised.

    Every kernel output of this package is allocated here, and each kernel must write all of it: the tests patch
    this function to return NaN-filled tensors, so that an element a kernel fails to write shows.

    channel_last: the memory of `[B, L, D]`, returned as its `[B, D, L]` transposed view.
    """
    if channel_last:
        return torch.empty((shape[0], shape[2], shape[1]), dtype=dtype, device=device).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=device)


def is_channel_last(x: torch.Tensor) -> bool:
    """x `[B, D, L]` has D contiguous (a transposed view of `[B, L, D]`), as causal-conv1d decides it."""
    return x.stride(1) == 1 and x.stride(2) != 1


def strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """The strides of t, or n zeros for an absent tensor (the kernels then never read them)."""
    return t.stride() if t is not None else (0,) * n


def kernel_args(x, weight, bias, seq_idx, initial_states, tensors: tuple, strided: tuple) -> tuple:
    """The positional arguments of a forward or backward kernel: x, weight, bias, seq_idx, initial_states, then
    `tensors` (the direction's own), the sizes D, L and NTOK_LOG2 (the bit length of B * L, which keys autotuning),
    and the strides of x, weight, seq_idx, initial_states and of each `strided` tensor (`[B, D, *]`); an absent
    tensor's strides are zeros."""
    batch, dim, seqlen = x.shape
    sizes = (dim, seqlen, (batch * seqlen).bit_length())
    input_strides = (*x.stride(), *weight.stride(), *strides(seq_idx, 2), *strides(initial_states, 3))
    other_strides = tuple(s for t in strided for s in strides(t, 3))
    return (x, weight, bias, seq_idx, initial_states, *tensors, *sizes, *input_strides, *other_strides)


def kernel_flags(weight, bias, seq_idx, initial_states, silu: bool, **more: bool) -> dict:
    """The constexpr flags of a forward or backward kernel: those of the inputs, and the direction's own `more`."""
    return dict(
        W=weight.shape[1],
        SILU=silu,
        HAS_BIAS=bias is not None,
        HAS_SEQ_IDX=seq_idx is not None,
        HAS_H0=initial_states is not None,
        **more,
    )


def launch(kernel, kind: str, grid, x: torch.Tensor, args: tuple, flags: dict, autotuned_kernel) -> None:
    """Runs `kernel` of `kind` ("rows" or "tile") on `grid(meta)`: under the interpreter directly, with the small
    blocks of INTERPRET_ROW_META or INTERPRET_TILE_META; compiled, through `autotuned_kernel(kind, element size)`."""
    if INTERPRET:
        meta = INTERPRET_ROW_META if kind == "rows" else INTERPRET_TILE_META
        kernel[grid(meta)](*args, **flags, **meta)
    else:
        with torch.cuda.device(x.device):
            autotuned_kernel(kind, x.element_size())[grid](*args, **flags)


def prune_by_width(configs, named_args, **kwargs):
    # Blocks much wider than D only mask lanes off; keep the narrowest config at least.
    cap = max(triton.next_power_of_2(named_args["D"]), min(c.kwargs["BLOCK_D"] for c in configs))
    return [c for c in configs if c.kwargs["BLOCK_D"] <= cap]


class Autotuners:
    """The autotuned kernels of one direction (forward or backward), one per layout kind and element size, made on
    first use: `self(kind, elem_size)` is the row-walking kernel autotuned over `row_configs(elem_size)` for
    kind "rows", the tiled kernel over `tile_configs()` for kind "tile". `built` holds those made so far."""

    def __init__(self, row_kernel, row_configs, tile_kernel, tile_configs):
        self.kinds = {"rows": (row_kernel, row_configs), "tile": (tile_kernel, lambda elem_size: tile_configs())}
        self.built: dict[tuple[str, int], triton.runtime.Autotuner] = {}

    def __call__(self, kind: str, elem_size: int) -> triton.runtime.Autotuner:
        key = (kind, elem_size)
        if key not in self.built:
            kernel, configs = self.kinds[kind]
            self.built[key] = autotune(kernel, configs(elem_size))
        return self.built[key]


def autotune(fn, configs: list[triton.Config]) -> triton.runtime.Autotuner:
    """`fn` autotuned over `configs` on AUTOTUNE_KEY, with the choices shipped for this GPU placed first."""
    autotuner = triton.autotune(
        configs,
        key=AUTOTUNE_KEY,
        prune_configs_by={"early_config_prune": prune_by_width},
        # Triton's disk cache of autotune results (beside its kernel cache): a new process skips the timing.
        cache_results=True,
    )(fn)
    # And on a fresh machine, the choices shipped for this GPU (kernels/tuned.py) where they cover the shape.
    tuned.fill(autotuner)
    return autotuner


@triton.jit
def load_at(p_x, p_h0, p, L, stride_xl, stride_h0w, mask, W: tl.constexpr, HAS_H0: tl.constexpr):
    """Input rows at positions p (a scalar or a block broadcast against the mask), in float32:
    x[p] for 0 <= p < L, initial_states[W-1+p] for -(W-1) <= p < 0, and 0 elsewhere."""
    # Masks first: Triton evaluates a call's keyword arguments before its positional ones, and this keeps the
    # order of the generated code.
    m_x = mask & as_mask(p >= 0) & as_mask(p < L)
    v = tl.load(p_x + tl.cast(p, tl.int64) * stride_xl, mask=m_x, other=0.0).to(tl.float32)
    if HAS_H0:
        m_h0 = mask & as_mask(p < 0) & as_mask(p > -W)
        v += tl.load(p_h0 + (p + W - 1) * stride_h0w, mask=m_h0, other=0.0).to(tl.float32)
    return v


@triton.jit
def load_rows(p_x, t_first, L, stride_xl, m_d, active, SUB_L: tl.constexpr):
    """The SUB_L rows x[t_first + j] (native dtype, 0 past L or when not active), as a tuple."""
    rows = ()
    for j in tl.static_range(SUB_L):
        t = t_first + j
        rows = rows + (
            tl.load(p_x + t.to(tl.int64) * stride_xl, mask=m_d & as_mask(t < L) & as_mask(active), other=0.0),
        )
    return rows


@triton.jit
def load_seq_rows(p_s, t_first, L, stride_sl, active, SUB_L: tl.constexpr, HAS_SEQ_IDX: tl.constexpr):
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
def seq_at(p_s, p, L, stride_sl, s0):
    """Sequence ids at positions p: seq_idx[p] inside [0, L), s0 (the id of the initial states) before, -1 after."""
    s = tl.load(p_s + p * stride_sl, mask=(p >= 0) & (p < L), other=-1)
    return tl.where(p < 0, s0, s)


@triton.jit
def load_taps(weight, bias, o_d, m_d, stride_wd, stride_ww, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The taps and bias of channels o_d in float32, as (c0, c1, c2, c3, b): c_k = weight[:, W-1-k] multiplies
    x[t-k] (0 for k >= W); b is 0 without bias."""
    p_w = weight + o_d * stride_wd
    c0 = tl.load(p_w + (W - 1) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    c1 = tl.load(p_w + (W - 2) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    c2 = tl.full(o_d.shape, 0.0, tl.float32)
    c3 = tl.full(o_d.shape, 0.0, tl.float32)
    if W >= 3:
        c2 = tl.load(p_w + (W - 3) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    if W >= 4:
        c3 = tl.load(p_w + (W - 4) * stride_ww, mask=m_d, other=0.0).to(tl.float32)
    b = tl.full(o_d.shape, 0.0, tl.float32)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    return c0, c1, c2, c3, b


@triton.jit
def load_halo(
    p_x,
    p_h0,
    p_s,
    t0,
    L,
    m_d,
    stride_xl,
    stride_h0w,
    stride_sl,
    W: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    """The W-1 rows before position t0 that a row-walking program starts from, as (xm1, xm2, xm3, sm1, sm2, sm3):
    xm_k = x[t0-k] in float32 (from the initial states before position 0; 0 for k >= W) and sm_k its sequence id
    (0 without seq_idx)."""
    xm1 = load_at(p_x, p_h0, t0 - 1, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
    xm2 = tl.full(m_d.shape, 0.0, tl.float32)
    xm3 = tl.full(m_d.shape, 0.0, tl.float32)
    if W >= 3:
        xm2 = load_at(p_x, p_h0, t0 - 2, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
    if W >= 4:
        xm3 = load_at(p_x, p_h0, t0 - 3, L, stride_xl, stride_h0w, m_d, W, HAS_H0)
    sm1 = t0 * 0
    sm2 = sm1
    sm3 = sm1
    if HAS_SEQ_IDX:
        s0 = -1
        if HAS_H0:
            s0 = tl.load(p_s)
        sm1 = seq_at(p_s, t0 - 1, L, stride_sl, s0)
        sm2 = seq_at(p_s, t0 - 2, L, stride_sl, s0)
        sm3 = seq_at(p_s, t0 - 3, L, stride_sl, s0)
    return xm1, xm2, xm3, sm1, sm2, sm3
