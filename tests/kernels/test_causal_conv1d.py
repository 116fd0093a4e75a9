"""Triton causal conv1d against its float64 reference: outputs, final states, updated conv_state, every gradient.

Inputs are drawn in the test dtype; the reference runs in float64 on exactly those values, so the only expected
difference is the kernels' float32 accumulation and the final rounding to the output dtype. Tolerances (the same on
CPU and GPU) sit a few roundings above that: float32 1e-5, float16 2e-3 (2^-11 rounding, with margin), bfloat16
1e-2 (2^-8 rounding) in relative norm, plus an elementwise bound of a few roundings so that no single element can
hide in the norm. Outputs are NaN-poisoned (see conftest), so an element a kernel does not write fails.

Axes are combined, not crossed: every value of every axis appears, every (dtype, layout, W) triple is run.
On CPU: `TRITON_INTERPRET=1 pytest tests/kernels` is implied (conftest); on a GPU the same tests use large shapes.

The cases marked `versions` are those CI runs again on the oldest supported releases (`pytest -m versions`, see
tests/conftest.py): on a CPU they run every kernel (forward and backward of both layouts, with initial and final
states and packed sequences, the update, odd shapes) under that release's stock Triton interpreter, and they are
chosen among the small shapes to keep CI's time.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import CUDA

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
F32, F16, BF16 = DTYPES


VERSIONS = pytest.mark.versions


def versions(*values):
    """A case that CI runs on the oldest supported releases too."""
    return pytest.param(*values, marks=VERSIONS)


def case_id(value) -> str:
    return str(value)[6:] if isinstance(value, torch.dtype) else str(value)


# dtype: (relative norm, elementwise relative, elementwise absolute as a fraction of max |ref|)
TOL = {
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.float16: (2e-3, 4e-3, 1e-3),
    torch.bfloat16: (1e-2, 2e-2, 4e-3),
}


def assert_close(actual: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == ref.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: {(~torch.isfinite(actual)).sum().item()} non-finite elements"
    a, r = actual.double(), ref.double()
    norm_tol, rtol, atol = TOL[dtype]
    scale = r.abs().max().clamp_min(1e-30)
    rel = (a - r).norm() / r.norm().clamp_min(1e-30)
    assert rel <= norm_tol, f"{what}: relative norm error {rel:.3g} > {norm_tol:g}"
    bad = (a - r).abs() > rtol * r.abs() + atol * scale
    assert not bad.any(), f"{what}: {bad.sum().item()} elements off, first at {bad.nonzero()[0].tolist()}"


def make_x(gen, shape, dtype, device, channel_last: bool) -> torch.Tensor:
    batch, dim, seqlen = shape
    if channel_last:
        return torch.randn(batch, seqlen, dim, generator=gen).to(device, dtype).transpose(1, 2)
    return torch.randn(batch, dim, seqlen, generator=gen).to(device, dtype)


def make_seq_idx(batch: int, seqlen: int, width: int, device) -> torch.Tensor:
    """Packed sequences: a boundary inside the first W-1 positions, several more, padding (negative) runs."""
    seq = torch.empty(batch, seqlen, dtype=torch.int32)
    for b in range(batch):
        t = torch.arange(seqlen)
        ids = (t >= width - 2).int() + (t >= seqlen // 3).int() + (t >= seqlen // 2).int() * 2
        if b % 2:
            ids = t.div(3, rounding_mode="floor").int()
        ids[(t >= (2 * seqlen) // 3) & (t < (2 * seqlen) // 3 + 2)] = -1
        if seqlen > 4:
            ids[-1] = -7
        seq[b] = ids
    return seq.to(device)


def run_fn(cc, x, weight, bias, seq_idx, h0, return_final_states, final_states_out, activation, gen, ref: bool):
    """Runs causal_conv1d_fn (or its reference in float64) and backpropagates a random loss through y and the
    final states. Returns (y, final_states, grads of x, weight, bias, initial_states)."""
    # detach() keeps the exact strides of x (a view stays a view); the kernels never write their inputs.
    cast = (lambda t: t.detach().double()) if ref else (lambda t: t.detach())
    inputs = [cast(t).requires_grad_() if t is not None else None for t in (x, weight, bias, h0)]
    xi, wi, bi, hi = inputs
    fn = cc.causal_conv1d_ref if ref else cc.causal_conv1d_fn
    out = fn(xi, wi, bi, seq_idx, hi, return_final_states, final_states_out, activation)
    y, fs = out if return_final_states else (out, None)
    dy = torch.randn(y.shape, generator=gen.manual_seed(1)).to(y.device)
    loss = (y.double() * dy.double()).sum()
    if fs is not None:
        dfs = torch.randn(fs.shape, generator=gen.manual_seed(2)).to(y.device)
        loss = loss + (fs.double() * dfs.double()).sum()
    loss.backward()
    return y, fs, [t.grad if t is not None else None for t in inputs]


def check_fn(
    cc,
    x,
    weight,
    bias=None,
    seq_idx=None,
    h0=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
    gen=None,
):
    y, fs, grads = run_fn(
        cc, x, weight, bias, seq_idx, h0, return_final_states, final_states_out, activation, gen, ref=False
    )
    y_ref, fs_ref, grads_ref = run_fn(
        cc, x, weight, bias, seq_idx, h0, return_final_states, None, activation, gen, ref=True
    )
    assert y.dtype == x.dtype
    channel_last = x.stride(1) == 1 and x.stride(2) != 1
    assert (y.stride(1) == 1) if channel_last else (y.stride(2) == 1), f"layout of y {y.stride()} vs x {x.stride()}"
    assert_close(y, y_ref, x.dtype, "y")
    if return_final_states:
        # The final states are copies of inputs: exact.
        assert torch.equal(fs, fs_ref.to(fs.dtype)), "final_states"
        if final_states_out is not None:
            assert fs.data_ptr() == final_states_out.data_ptr()
    for name, g, g_ref, t in zip(
        ("dx", "dweight", "dbias", "dinitial_states"), grads, grads_ref, (x, weight, bias, h0), strict=True
    ):
        if t is not None:
            assert g.dtype == t.dtype, name
            assert_close(g, g_ref, t.dtype if t.dtype != torch.float32 else x.dtype, name)
    return y


# Every (dtype, layout, W); bias, activation, weight dtype and shape rotate so that each value appears. The cases
# in FN_VERSIONS (every dtype and layout, W 2 to 4, no "long" shape) run on the oldest releases too.
FN_VERSIONS = {0, 2, 11, 14, 16}
FN_CASES = [
    pytest.param(
        dtype,
        layout,
        width,
        i % 2 == 0,
        [None, "silu", "swish"][i % 3],
        i % 4 == 3,
        ["main", "long", "short", "one"][i % 4],
        id=f"{str(dtype)[6:]}-{layout}-W{width}-{'bias' if i % 2 == 0 else 'nobias'}-"
        f"{[None, 'silu', 'swish'][i % 3]}-{'w32' if i % 4 == 3 else 'wsame'}-"
        f"{['main', 'long', 'short', 'one'][i % 4]}",
        marks=[VERSIONS] if i in FN_VERSIONS else [],
    )
    for i, (dtype, layout, width) in enumerate(
        (d, lay, w) for d in DTYPES for lay in ("channel_last", "channel_first") for w in (2, 3, 4)
    )
]


@pytest.mark.parametrize("dtype, layout, width, has_bias, activation, fp32_weight, size", FN_CASES)
def test_fn_matches_reference(cc, device, shapes, gen, dtype, layout, width, has_bias, activation, fp32_weight, size):
    shape = shapes[size]
    x = make_x(gen, shape, dtype, device, layout == "channel_last")
    wdtype = torch.float32 if fp32_weight else dtype
    weight = (torch.randn(shape[1], width, generator=gen) / width**0.5).to(device, wdtype)
    bias = torch.randn(shape[1], generator=gen).to(device, wdtype) if has_bias else None
    check_fn(cc, x, weight, bias, activation=activation, gen=gen)


@pytest.mark.parametrize(
    "dtype, layout, width, with_h0, activation",
    ids=case_id,
    argvalues=[
        versions(torch.bfloat16, "channel_last", 4, False, "silu"),
        (torch.float32, "channel_last", 3, True, None),
        (torch.float16, "channel_last", 2, False, None),
        (torch.float32, "channel_first", 4, False, "silu"),
        versions(torch.bfloat16, "channel_first", 3, True, "silu"),
        (torch.float32, "channel_last", 4, True, "silu"),
    ],
)
def test_seq_idx(cc, device, shapes, gen, dtype, layout, width, with_h0, activation):
    shape = shapes["main"]
    batch, dim, seqlen = shape
    x = make_x(gen, shape, dtype, device, layout == "channel_last")
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype)
    h0 = torch.randn(batch, dim, width - 1, generator=gen).to(device, dtype) if with_h0 else None
    seq_idx = make_seq_idx(batch, seqlen, width, device)
    y = check_fn(cc, x, weight, bias, seq_idx=seq_idx, h0=h0, activation=activation, gen=gen)
    assert (y.transpose(1, 2)[seq_idx < 0] == 0).all(), "padding positions must output exactly 0"


@pytest.mark.parametrize(
    "dtype, layout, width, size, preallocated",
    ids=case_id,
    argvalues=[
        (torch.float32, "channel_last", 4, "main", False),
        (torch.bfloat16, "channel_last", 4, "one", True),
        versions(torch.float16, "channel_last", 3, "short", True),
        versions(torch.float32, "channel_first", 4, "one", False),
        (torch.bfloat16, "channel_first", 2, "main", True),
        (torch.float32, "channel_last", 2, "long", False),
    ],
)
def test_initial_and_final_states(cc, device, shapes, gen, dtype, layout, width, size, preallocated):
    batch, dim, seqlen = shape = shapes[size]
    x = make_x(gen, shape, dtype, device, layout == "channel_last")
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    h0 = torch.randn(batch, width - 1, dim, generator=gen).to(device, dtype).transpose(1, 2)
    out = torch.full((batch, dim, width - 1), float("nan"), device=device, dtype=dtype) if preallocated else None
    check_fn(cc, x, weight, None, h0=h0, return_final_states=True, final_states_out=out, activation="silu", gen=gen)


def test_inference_calls_skip_autograd(cc, device, shapes, gen, monkeypatch):
    """With no gradient to track (under no_grad, or no input requiring one) the kernel runs without
    autograd.Function, whose bookkeeping is host time on every call of a frozen target; the outputs are the
    differentiable path's, to the bit, and a given final-states buffer is still the one returned."""
    batch, dim, seqlen = shape = shapes["short"]
    x = make_x(gen, shape, BF16, device, channel_last=True)
    weight = torch.randn(dim, 4, generator=gen).to(device, BF16).requires_grad_()
    h0 = torch.randn(batch, 3, dim, generator=gen).to(device, BF16).transpose(1, 2)
    applied = []
    apply = cc.function.CausalConv1dFunction.apply
    monkeypatch.setattr(cc.function.CausalConv1dFunction, "apply", lambda *a: applied.append(a) or apply(*a))
    y, fs = cc.causal_conv1d_fn(x, weight, None, None, h0, True, None, "silu")
    assert len(applied) == 1 and y.grad_fn is not None
    with torch.no_grad():
        y_no_grad, fs_no_grad = cc.causal_conv1d_fn(x, weight, None, None, h0, True, None, "silu")
    out = torch.full((batch, dim, 3), float("nan"), device=device, dtype=BF16)
    y_frozen, fs_frozen = cc.causal_conv1d_fn(x, weight.detach(), None, None, h0, True, out, "silu")
    assert len(applied) == 1, "an inference call went through autograd.Function"
    assert fs_frozen is out
    for got, got_fs in ((y_no_grad, fs_no_grad), (y_frozen, fs_frozen)):
        assert got.grad_fn is None and got.stride() == y.stride()
        assert torch.equal(got, y.detach()) and torch.equal(got_fs, fs.detach())


class _Launches:
    """Stands in for a forward kernel under the interpreter and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


# The forward kernel follows the layout of x: the row walk on channel-last x, the tile kernel on any other strides.
@pytest.mark.parametrize("kernel, layout", [("rows", "channel_last"), ("tile", "channel_first")])
@pytest.mark.parametrize("dtype, width, options", [(BF16, 4, "seq_idx"), (F32, 3, "states"), (F16, 2, "states")])
def test_forward_kernel_by_layout(cc, device, shapes, gen, monkeypatch, kernel, layout, dtype, width, options):
    if not CUDA:  # the interpreter launches the kernel itself; a GPU goes through `forward.autotuned_kernel`
        name = "causal_conv1d_fwd_kernel" if kernel == "rows" else "causal_conv1d_fwd_tile_kernel"
        launches = _Launches(getattr(cc.forward, name))
        monkeypatch.setattr(cc.forward, name, launches)
    batch, dim, seqlen = shape = shapes["main"]
    x = make_x(gen, shape, dtype, device, layout == "channel_last")
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype)
    h0 = torch.randn(batch, dim, width - 1, generator=gen).to(device, dtype)
    if options == "seq_idx":
        seq_idx = make_seq_idx(batch, seqlen, width, device)
        check_fn(cc, x, weight, bias, seq_idx=seq_idx, h0=h0, activation="silu", gen=gen)
    else:
        check_fn(cc, x, weight, bias, h0=h0, return_final_states=True, activation="silu", gen=gen)
    assert (kernel, x.element_size()) in cc.forward.autotuned_kernel.built if CUDA else launches.count == 1


class _NoLaunch:
    """Stands in for a kernel (or its autotuned wrapper) and writes nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@VERSIONS
def test_poisoned_outputs_show_unwritten_elements(cc, device, gen, monkeypatch):
    # The `cc` fixture's NaN-filled allocation reaches every output of every kernel: with kernels that write
    # nothing, each output (y, final states, every gradient, the update's y) comes back all NaN.
    for module, names in (
        (cc.forward, ("causal_conv1d_fwd_kernel", "causal_conv1d_fwd_tile_kernel")),
        (cc.backward, ("causal_conv1d_bwd_kernel", "causal_conv1d_bwd_tile_kernel")),
        (cc.update, ("causal_conv1d_update_kernel",)),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _NoLaunch())
    monkeypatch.setattr(cc.forward, "autotuned_kernel", lambda kind, elem_size: _NoLaunch())
    monkeypatch.setattr(cc.backward, "autotuned_kernel", lambda kind, elem_size: _NoLaunch())
    monkeypatch.setattr(cc.update, "_plans", {})
    batch, dim, seqlen, width = 2, 24, 9, 4
    for channel_last in (True, False):
        x = make_x(gen, (batch, dim, seqlen), F32, device, channel_last).requires_grad_()
        weight = torch.randn(dim, width, generator=gen).to(device).requires_grad_()
        bias = torch.randn(dim, generator=gen).to(device).requires_grad_()
        h0 = torch.randn(batch, dim, width - 1, generator=gen).to(device).requires_grad_()
        y, final_states = cc.causal_conv1d_fn(x, weight, bias, None, h0, True, None, "silu")
        grads = torch.autograd.grad(y.sum(), (x, weight, bias, h0))
        outputs = {"y": y, "final_states": final_states}
        outputs.update(zip(("dx", "dweight", "dbias", "dinitial_states"), grads, strict=True))
        for name, out in outputs.items():
            assert out.isnan().all(), f"{name} (channel_last={channel_last}): not every element is NaN"
    state = torch.randn(batch, dim, width, generator=gen).to(device)
    y = cc.causal_conv1d_update(torch.randn(batch, dim, generator=gen).to(device), state, weight.detach())
    assert y.isnan().all(), "update y: not every element is NaN"


@pytest.mark.parametrize("dtype, width", [(BF16, 4), (F32, 3)])
def test_each_row_config(cc, device, shapes, gen, monkeypatch, dtype, width):
    # The autotuner picks one config per shape and GPU: every other one must be right too (on a GPU each shipped
    # config in turn; under the interpreter its one small config), with initial and final states and packed
    # sequences (the halo rows of each program, the last program's final states).
    batch, dim, seqlen = shape = shapes["long"]
    x = make_x(gen, shape, dtype, device, True)
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    h0 = torch.randn(batch, dim, width - 1, generator=gen).to(device, dtype)
    seq_idx = make_seq_idx(batch, seqlen, width, device)
    tuner = cc.forward.autotuned_kernel("rows", x.element_size()) if CUDA else None
    for config in tuner.configs if CUDA else [None]:
        if CUDA:
            monkeypatch.setattr(tuner, "configs", [config])
            monkeypatch.setattr(tuner, "cache", {})
        check_fn(cc, x, weight, h0=h0, return_final_states=True, activation="silu", gen=gen)
        check_fn(cc, x, weight, seq_idx=seq_idx, h0=h0, activation="silu", gen=gen)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, interpreter
def test_silu_over_the_whole_float32_range(cc, device):
    # On a GPU the sigmoid comes from approximate PTX (kernels/utils.py, `sigmoid`): it must saturate cleanly
    # (silu(z) = z for large z, 0 for very negative z, never NaN) and keep float32 precision in between. Weight
    # (0, 0, 0, 1) makes the conv the identity, so y = silu(x) exactly in the reference.
    z = [0.0, 1e-30, 1e-3, 0.5, 1.0, 3.0, 10.0, 20.0, 60.0, 87.0, 89.0, 100.0, 1e4, 1e30, 3e38]
    values = torch.tensor(z + [-v for v in z], dtype=torch.float64)
    # (B, D, L) = (2, 3, 30), channel-last: every channel holds all the values along L.
    x = values.reshape(1, -1, 1).expand(2, -1, 3).to(device, torch.float32).contiguous().transpose(1, 2)
    weight = torch.tensor([0.0, 0.0, 0.0, 1.0], device=device).expand(3, 4).contiguous()
    y = cc.causal_conv1d_fn(x, weight, activation="silu").double().cpu()
    ref = cc.causal_conv1d_ref(x.double(), weight.double(), activation="silu").cpu()
    assert torch.isfinite(y).all(), f"non-finite silu at z = {x.cpu()[~torch.isfinite(y)].tolist()}"
    # Below ~1e-37 float32 has only subnormals, which the approximate instructions flush to 0.
    bad = (y - ref).abs() > 1e-5 * ref.abs() + 1e-36
    assert not bad.any(), f"silu off at z = {x.cpu()[bad].tolist()}: {y[bad].tolist()} vs {ref[bad].tolist()}"


@VERSIONS
def test_final_states_without_initial_states_short_input(cc, device, gen):
    # L < W-1: the final states are zero-padded on the left.
    x = make_x(gen, (2, 24, 1), torch.float32, device, True)
    weight = torch.randn(24, 4, generator=gen).to(device)
    check_fn(cc, x, weight, return_final_states=True, gen=gen)


@pytest.mark.parametrize("view", ["channel_last_slice", "strided"])
def test_non_contiguous_views(cc, device, shapes, gen, view):
    # A channel slice of a wider (B, L, 3D) activation keeps D contiguous with a row stride of 3D; a strided
    # channel-first view has neither dimension contiguous (causal-conv1d would copy it; the kernels take strides).
    batch, dim, seqlen = shapes["main"]
    if view == "channel_last_slice":
        wide = torch.randn(batch, seqlen, 3 * dim, generator=gen).to(device, BF16)
        x = wide[..., dim : 2 * dim].transpose(1, 2)
    else:
        x = torch.randn(batch, 2 * dim, 2 * seqlen, generator=gen).to(device, BF16)[:, ::2, ::2]
    assert not x.is_contiguous() and not x.transpose(1, 2).is_contiguous()
    weight = torch.randn(dim, 4, generator=gen).to(device, BF16)
    # A strided bias too (copied: the kernels read it with unit stride).
    bias = torch.randn(2 * dim, generator=gen).to(device, BF16)[::2]
    check_fn(cc, x, weight, bias, activation="silu", gen=gen)


def test_backward_is_deterministic(cc, device, shapes, gen):
    x = make_x(gen, shapes["main"], torch.bfloat16, device, True).requires_grad_()
    weight = torch.randn(shapes["main"][1], 4, generator=gen).to(device).requires_grad_()
    grads = []
    for _ in range(2):
        y = cc.causal_conv1d_fn(x, weight, activation="silu")
        grads.append(torch.autograd.grad(y.float().square().sum(), (x, weight)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


# ---------------------------------------------------------------------------------------------------------------
# An independent reference: torch.nn.functional.conv1d with groups=D (no code shared with causal_conv1d_ref)


def conv1d_reference(x, weight, bias=None, h0=None, activation=None, segments=None):
    """y and the final states in float64 from `F.conv1d(groups=D)` over [initial states, x].

    conv1d correlates: y[t] = sum_k w[k] * padded[t + k], padded = [h0 (W-1 columns, zeros without), x], so w[W-1]
    meets x[t]. segments: per batch row, the (start, stop) runs of packed sequences; each is convolved on its own
    from zeros (the first also from h0), and positions outside every run (padding) are 0."""
    x, weight = x.double(), weight.double()
    bias = bias.double() if bias is not None else None
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    head = h0.double() if h0 is not None else x.new_zeros(batch, dim, width - 1)

    def conv(padded):
        y = F.conv1d(padded, weight[:, None, :], bias, groups=dim)
        return F.silu(y) if activation else y

    if segments is None:
        y = conv(torch.cat([head, x], -1))
    else:
        y = x.new_zeros(batch, dim, seqlen)
        for b, runs in enumerate(segments):
            for start, stop in runs:
                before = head[b : b + 1] if start == 0 else x.new_zeros(1, dim, width - 1)
                y[b : b + 1, :, start:stop] = conv(torch.cat([before, x[b : b + 1, :, start:stop]], -1))
    return y, torch.cat([head, x], -1)[..., seqlen:]


# (B, D, L, W), layout, bias, activation, initial states: small odd shapes, L < W - 1 and L = 1 included.
CONV1D_CASES = [
    ((3, 7, 13, 4), "channel_last", True, "silu", True),
    ((2, 9, 3, 3), "channel_first", False, None, True),
    ((1, 5, 1, 2), "channel_last", True, None, False),
    ((2, 11, 2, 4), "channel_first", True, "silu", False),
    ((3, 13, 19, 2), "channel_first", False, "silu", True),
    ((1, 3, 29, 3), "channel_last", True, None, True),
]


@VERSIONS
@pytest.mark.parametrize("shape, layout, has_bias, activation, with_h0", CONV1D_CASES, ids=case_id)
def test_fn_matches_torch_conv1d(cc, device, gen, shape, layout, has_bias, activation, with_h0):
    """Forward, final states and the gradients of x, weight, bias and initial states (float32) against autograd
    through `F.conv1d(groups=D)` in float64 on the same values."""
    batch, dim, seqlen, width = shape
    x = make_x(gen, (batch, dim, seqlen), F32, device, layout == "channel_last")
    weight = torch.randn(dim, width, generator=gen).to(device)
    bias = torch.randn(dim, generator=gen).to(device) if has_bias else None
    h0 = torch.randn(batch, dim, width - 1, generator=gen).to(device) if with_h0 else None
    inputs = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias, h0)]
    y, fs = cc.causal_conv1d_fn(*inputs[:2], inputs[2], None, inputs[3], True, None, activation)
    references = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    y_ref, fs_ref = conv1d_reference(*references[:3], references[3], activation)
    assert_close(y, y_ref, F32, "y")
    assert torch.equal(fs.double(), fs_ref), "final states"
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device)
    dfs = torch.randn(fs.shape, generator=gen, dtype=torch.float64).to(device)
    ((y.double() * dy).sum() + (fs.double() * dfs).sum()).backward()
    ((y_ref * dy).sum() + (fs_ref * dfs).sum()).backward()
    for name, got, ref in zip(("dx", "dweight", "dbias", "dinitial_states"), inputs, references, strict=True):
        if got is not None:
            assert_close(got.grad, ref.grad, F32, name)


@VERSIONS
@pytest.mark.parametrize("layout", ["channel_last", "channel_first"])
def test_packed_sequences_match_torch_conv1d(cc, device, gen, layout):
    """seq_idx: each packed sequence convolved on its own by F.conv1d, padding positions 0; every gradient."""
    batch, dim, seqlen, width = 2, 7, 17, 4
    runs = [[(0, 2), (2, 9), (9, 14)], [(0, 6), (6, 7), (7, 15)]]  # then padding to the end
    seq_idx = torch.full((batch, seqlen), -1, dtype=torch.int32)
    for b, row in enumerate(runs):
        for i, (start, stop) in enumerate(row):
            seq_idx[b, start:stop] = i
    x = make_x(gen, (batch, dim, seqlen), F32, device, layout == "channel_last")
    weight = torch.randn(dim, width, generator=gen).to(device)
    bias = torch.randn(dim, generator=gen).to(device)
    h0 = torch.randn(batch, dim, width - 1, generator=gen).to(device)
    inputs = [t.detach().requires_grad_() for t in (x, weight, bias, h0)]
    y = cc.causal_conv1d_fn(*inputs[:3], seq_idx.to(device), inputs[3], False, None, "silu")
    references = [t.detach().double().requires_grad_() for t in inputs]
    y_ref, _ = conv1d_reference(*references, "silu", segments=runs)
    assert_close(y, y_ref, F32, "y")
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device)
    (y.double() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for name, got, ref in zip(("dx", "dweight", "dbias", "dinitial_states"), inputs, references, strict=True):
        assert_close(got.grad, ref.grad, F32, name)


@VERSIONS
@pytest.mark.parametrize("seqlen, width, extra", [(1, 4, 0), (3, 3, 2), (5, 2, 1)])
def test_update_matches_torch_conv1d(cc, device, gen, seqlen, width, extra):
    """causal_conv1d_update continues from a conv_state of the last S inputs: F.conv1d over [its last W-1, x]."""
    batch, dim = 3, 9
    state_len = width - 1 + extra
    x = torch.randn(batch, dim, seqlen, generator=gen).to(device)
    state = torch.randn(batch, dim, state_len, generator=gen).to(device)
    weight = torch.randn(dim, width, generator=gen).to(device)
    bias = torch.randn(dim, generator=gen).to(device)
    y_ref, _ = conv1d_reference(x, weight, bias, state[..., state_len - (width - 1) :], "silu")
    expected_state = torch.cat([state, x], -1)[..., -state_len:]
    y = cc.causal_conv1d_update(x, state, weight, bias, "silu")
    assert_close(y, y_ref, F32, "y")
    assert torch.equal(state, expected_state), "conv_state"


# ---------------------------------------------------------------------------------------------------------------
# causal_conv1d_update


UPDATE_CASES = [
    # dtype, width, x_dims, seqlen, extra state slots, circular, indices, bias, activation
    (torch.bfloat16, 4, 3, 1, 0, False, False, False, "silu"),  # the transformers decode call
    (torch.bfloat16, 4, 2, 1, 0, False, True, True, "silu"),
    (torch.float32, 4, 3, 3, 2, True, False, True, None),
    (torch.float16, 3, 3, 5, -1, False, False, True, "swish"),  # state_len == W-1, L > state_len
    (torch.float32, 2, 2, 1, 3, True, True, False, "silu"),
    (torch.bfloat16, 3, 3, 9, 1, True, True, True, None),  # wraps around the circular buffer
    (torch.float16, 2, 3, 2, 0, False, True, False, None),
    (torch.float32, 3, 2, 1, -1, True, False, False, "silu"),
]


@VERSIONS
@pytest.mark.parametrize(
    "dtype, width, x_dims, seqlen, extra, circular, indices, has_bias, activation", UPDATE_CASES, ids=case_id
)
def test_update_matches_reference(
    cc, device, update_shape, gen, dtype, width, x_dims, seqlen, extra, circular, indices, has_bias, activation
):
    batch, dim = update_shape
    state_len = width + extra
    n_cache = batch + 3 if indices else batch
    x = torch.randn(batch, dim, seqlen, generator=gen).to(device, dtype)
    if x_dims == 2:
        assert seqlen == 1
        x = x[..., 0]
    state = torch.randn(n_cache, dim, state_len, generator=gen).to(device, dtype)
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype) if has_bias else None
    cache_seqlens = torch.randint(0, 3 * state_len, (batch,), generator=gen, dtype=torch.int32).to(device)
    cache_seqlens = cache_seqlens if circular else None
    state_indices = None
    if indices:
        perm = torch.randperm(n_cache, generator=gen)[:batch].int()
        perm[1] = -1  # a padding row
        state_indices = perm.to(device)
    state_ref = state.double()
    before = state.clone()

    y = cc.causal_conv1d_update(x, state, weight, bias, activation, cache_seqlens, state_indices)
    y_ref = cc.causal_conv1d_update_ref(
        x.double(),
        state_ref,
        weight.double(),
        bias.double() if bias is not None else None,
        activation,
        cache_seqlens,
        state_indices,
    )
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, y_ref, dtype, "y")
    assert torch.equal(state, state_ref.to(dtype)), "conv_state"
    if indices:
        assert (y[1] == 0).all(), "a padding row outputs 0"
        touched = set(state_indices[state_indices >= 0].tolist())
        untouched = [r for r in range(n_cache) if r not in touched]
        assert untouched and torch.equal(state[untouched], before[untouched]), "rows not selected must not change"


def test_update_repeated_calls_reuse_the_plan(cc, device, update_shape, gen):
    # The second and later calls take the cached launch path; each must still match the reference.
    batch, dim = update_shape
    weight = torch.randn(dim, 4, generator=gen).to(device, torch.bfloat16)
    state = torch.randn(batch, dim, 4, generator=gen).to(device, torch.bfloat16)
    state_ref = state.double()
    for _ in range(3):
        x = torch.randn(batch, dim, 1, generator=gen).to(device, torch.bfloat16)
        y = cc.causal_conv1d_update(x, state, weight, None, "silu")
        y_ref = cc.causal_conv1d_update_ref(x.double(), state_ref, weight.double(), None, "silu")
        assert_close(y, y_ref, torch.bfloat16, "y")
        assert torch.equal(state, state_ref.to(torch.bfloat16))


@VERSIONS
def test_update_matches_fn_token_by_token(cc, device, gen):
    # Decoding token by token from the prefill's final states continues the prefill's output exactly.
    batch, dim, seqlen, width = 2, 24, 9, 4
    x = torch.randn(batch, dim, seqlen, generator=gen).to(device)
    weight = torch.randn(dim, width, generator=gen).to(device)
    y_full = cc.causal_conv1d_fn(x, weight, activation="silu")
    _, state = cc.causal_conv1d_fn(x[..., :4].contiguous(), weight, activation="silu", return_final_states=True)
    state = state.contiguous()
    for t in range(4, seqlen):
        y = cc.causal_conv1d_update(x[..., t], state, weight, None, "silu")
        torch.testing.assert_close(y, y_full[..., t], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# errors


def _fn_args(device, dtype=torch.float32, batch=2, dim=8, seqlen=5, width=4):
    x = torch.randn(batch, dim, seqlen, device=device, dtype=dtype)
    return x, torch.randn(dim, width, device=device)


FN_ERRORS = [
    ("weight of shape", lambda cc, x, w: cc.causal_conv1d_fn(x, w[:5])),
    ("2 <= W <= 4", lambda cc, x, w: cc.causal_conv1d_fn(x, torch.randn(8, 5, device=x.device))),
    ("activation", lambda cc, x, w: cc.causal_conv1d_fn(x, w, activation="relu")),
    ("seq_idx of shape", lambda cc, x, w: cc.causal_conv1d_fn(x, w, seq_idx=torch.zeros(2, 5, device=x.device))),
    (
        "seq_idx of shape",
        lambda cc, x, w: cc.causal_conv1d_fn(x, w, seq_idx=torch.zeros(2, 4, dtype=torch.int32, device=x.device)),
    ),
    (
        "return_final_states=False with seq_idx",
        lambda cc, x, w: cc.causal_conv1d_fn(
            x, w, seq_idx=torch.zeros(2, 5, dtype=torch.int32, device=x.device), return_final_states=True
        ),
    ),
    (
        "initial_states of shape",
        lambda cc, x, w: cc.causal_conv1d_fn(x, w, initial_states=torch.zeros(2, 8, 4, device=x.device)),
    ),
    (
        "initial_states of shape",
        lambda cc, x, w: cc.causal_conv1d_fn(
            x, w, initial_states=torch.zeros(2, 8, 3, device=x.device, dtype=torch.float16)
        ),
    ),
    (
        "final_states_out of shape",
        lambda cc, x, w: cc.causal_conv1d_fn(
            x, w, return_final_states=True, final_states_out=torch.zeros(2, 8, 4, device=x.device)
        ),
    ),
    ("x of shape", lambda cc, x, w: cc.causal_conv1d_fn(x[0], w)),
    ("x of dtype", lambda cc, x, w: cc.causal_conv1d_fn(x.double(), w)),
    ("bias of shape", lambda cc, x, w: cc.causal_conv1d_fn(x, w, torch.zeros(7, device=x.device))),
    ("weight on the device", lambda cc, x, w: cc.causal_conv1d_fn(x, w.to("meta"))),
    ("L >= 1", lambda cc, x, w: cc.causal_conv1d_fn(x[..., :0], w)),
]


@pytest.mark.parametrize("match, call", FN_ERRORS, ids=[f"{i}-{m}" for i, (m, _) in enumerate(FN_ERRORS)])
def test_fn_errors(cc, device, match, call):
    x, w = _fn_args(device)
    with pytest.raises(ValueError, match=match):
        call(cc, x, w)


def test_bad_activation_is_also_not_implemented_error(cc, device):
    # causal-conv1d raises NotImplementedError; code written against it keeps working.
    x, w = _fn_args(device)
    with pytest.raises(NotImplementedError):
        cc.causal_conv1d_fn(x, w, activation="gelu")
    with pytest.raises(NotImplementedError):
        cc.causal_conv1d_update(x[..., 0], torch.zeros(2, 8, 4, device=device), w, activation="gelu")


UPDATE_ERRORS = [
    ("weight of shape", lambda cc, x, s, w: cc.causal_conv1d_update(x, s, w[:3])),
    ("conv_state of shape", lambda cc, x, s, w: cc.causal_conv1d_update(x, s[..., :2], w)),
    ("conv_state with B = 2", lambda cc, x, s, w: cc.causal_conv1d_update(x, s[:1], w)),
    ("conv_state of the dtype", lambda cc, x, s, w: cc.causal_conv1d_update(x, s.half(), w)),
    (
        "cache_seqlens of shape",
        lambda cc, x, s, w: cc.causal_conv1d_update(
            x, s, w, cache_seqlens=torch.zeros(2, dtype=torch.int64, device=x.device)
        ),
    ),
    (
        "conv_state_indices of shape",
        lambda cc, x, s, w: cc.causal_conv1d_update(
            x, s, w, conv_state_indices=torch.zeros(3, dtype=torch.int32, device=x.device)
        ),
    ),
    ("x of shape", lambda cc, x, s, w: cc.causal_conv1d_update(x[0], s, w)),
    ("bias of shape", lambda cc, x, s, w: cc.causal_conv1d_update(x, s, w, torch.zeros(3, device=x.device))),
    ("conv_state on the device", lambda cc, x, s, w: cc.causal_conv1d_update(x, s.to("meta"), w)),
    ("unit stride", lambda cc, x, s, w: cc.causal_conv1d_update(x, s, w, torch.zeros(16, device=x.device)[::2])),
]


@pytest.mark.parametrize("match, call", UPDATE_ERRORS, ids=[f"{i}-{m}" for i, (m, _) in enumerate(UPDATE_ERRORS)])
def test_update_errors(cc, device, match, call):
    x = torch.randn(2, 8, device=device)
    state = torch.randn(2, 8, 4, device=device)
    weight = torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match=match):
        call(cc, x, state, weight)


def test_cpu_tensors_without_interpreter_raise(cc, monkeypatch):
    # Without CUDA and without TRITON_INTERPRET the kernels cannot run: a clear RuntimeError, and
    # triton_available_for says so first (the fast-path dispatcher falls back to the reference then).
    monkeypatch.setattr(cc.common, "INTERPRET", False)
    monkeypatch.setattr(cc.update, "INTERPRET", False)
    monkeypatch.setattr(cc, "INTERPRET", False)
    monkeypatch.setattr(cc.update, "_plans", {})
    x, w = _fn_args("cpu")
    assert not cc.triton_available_for(x)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        cc.causal_conv1d_fn(x, w)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        cc.causal_conv1d_update(x[..., 0], torch.zeros(2, 8, 4), w)


def test_triton_available_for(cc, device):
    assert cc.triton_available_for(torch.zeros(1, device=device))


# ---------------------------------------------------------------------------------------------------------------
# GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_update_under_cuda_graph(cc, gen):
    # The cached launch path takes the current stream at each call, so it can be captured and replayed.
    batch, dim = 64, 10240
    weight = torch.randn(dim, 4, generator=gen).cuda().bfloat16()
    state = torch.randn(batch, dim, 4, generator=gen).cuda().bfloat16()
    x = torch.randn(batch, dim, 1, generator=gen).cuda().bfloat16()
    cc.causal_conv1d_update(x, state.clone(), weight, None, "silu")  # compile + plan outside the capture
    state_ref = state.double()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = cc.causal_conv1d_update(x, state, weight, None, "silu")
    for _ in range(2):
        graph.replay()
        y_ref = cc.causal_conv1d_update_ref(x.double(), state_ref, weight.double(), None, "silu")
        torch.cuda.synchronize()
        assert_close(y, y_ref, torch.bfloat16, "y")
        assert torch.equal(state, state_ref.bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_transformers_prefill_layout(cc, gen):
    # Exactly what a Qwen3.5 GDN layer passes: channel-last bf16 view of (B, L, conv_dim), W=4, no bias, silu.
    mixed = torch.randn(2, 4096, 10240, generator=gen).cuda().bfloat16()
    weight = torch.randn(10240, 4, generator=gen).cuda().bfloat16()
    x = mixed.transpose(1, 2)
    y = cc.causal_conv1d_fn(x, weight, None, activation="silu")
    assert y.stride() == x.stride()
    assert_close(y, cc.causal_conv1d_ref(x.double(), weight.double(), activation="silu"), torch.bfloat16, "y")
