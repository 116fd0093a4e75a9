"""The kernels run under Triton's interpreter as Triton ships it, on every supported Triton release.

A user who sets TRITON_INTERPRET=1 gets Triton's own interpreter: the kernels must not need a patch of it (Triton
3.9's interpreter, for one, rejects a scalar comparison broadcast into a load mask unless the kernel makes it a
boolean; see `as_mask` in flashdraft/kernels/utils.py). Two guards: nothing in this test session patches Triton's
interpreter (so the other kernel tests run it stock too), and a fresh process, set up as a user would set it up,
runs every kernel against the float64 reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every kernel: the forward and backward of both layouts (row walk, tiles) with initial and final states and with
# packed sequences, and the update with a shifting and a circular state.
SCRIPT = """
import torch

from flashdraft.kernels import causal_conv1d as cc

assert cc.INTERPRET, "TRITON_INTERPRET=1 did not reach the kernels"
gen = torch.Generator().manual_seed(0)
randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)


def run(fn, x, w, b, seq_idx, h0, final, double):
    dtype = torch.float64 if double else torch.float32
    # x.to(dtype) keeps a channel-last x channel-last.
    inputs = [t.detach().to(dtype).requires_grad_() for t in (x, w, b, h0)]
    xi, wi, bi, hi = inputs
    out = fn(xi, wi, bi, seq_idx, hi, final, None, "silu")
    y, fs = out if final else (out, None)
    loss = (y.double() * dy).sum() + ((fs.double() * dfs).sum() if final else 0)
    loss.backward()
    return [y] + ([fs] if final else []) + [t.grad for t in inputs]


B, D, L, W = 2, 5, 11, 4
for channel_last in (True, False):
    for packed in (False, True):
        x = randn(B, L, D).transpose(1, 2) if channel_last else randn(B, D, L)
        w, b, h0 = randn(D, W), randn(D), randn(B, D, W - 1)
        seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1, 2, 2, 2]] * B, dtype=torch.int32) if packed else None
        dy, dfs = randn(B, D, L), randn(B, D, W - 1)
        got = run(cc.causal_conv1d_fn, x, w, b, seq_idx, h0, not packed, double=False)
        ref = run(cc.causal_conv1d_ref, x, w, b, seq_idx, h0, not packed, double=True)
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            what = f"channel_last={channel_last} packed={packed} output {i}"
            torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4, msg=lambda m, what=what: f"{what}: {m}")

for circular in (False, True):
    state = randn(B + 1, D, W + 1).float()
    state_ref = state.double()
    x, w, b = randn(B, D, 3).float(), randn(D, W).float(), randn(D).float()
    seqlens = torch.tensor([4, 1], dtype=torch.int32) if circular else None
    rows = torch.tensor([2, 0], dtype=torch.int32)
    y = cc.causal_conv1d_update(x, state, w, b, "silu", seqlens, rows)
    y_ref = cc.causal_conv1d_update_ref(x.double(), state_ref, w.double(), b.double(), "silu", seqlens, rows)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(state, state_ref.float()), "conv_state"
print("every kernel ran under the stock interpreter")
"""


@pytest.mark.versions
def test_kernels_run_under_the_stock_interpreter():
    """TRITON_INTERPRET=1 set before anything is imported, as a user sets it: Triton's own library is interpreted
    too, and nothing patches it."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


@pytest.mark.versions
def test_nothing_patches_tritons_interpreter():
    """No function of Triton's interpreter, language semantics or core comes from this project's code: a patch (one
    that relabels comparisons, say) would let the kernel tests pass where a user's TRITON_INTERPRET=1 run fails."""
    import triton.language.core
    import triton.language.semantic
    from triton.runtime import interpreter

    ours = [ROOT / "flashdraft", ROOT / "tests"]
    patched = []
    for module in (interpreter, triton.language.semantic, triton.language.core):
        owners = [module] + [v for v in vars(module).values() if isinstance(v, type)]
        for owner in owners:
            for name, value in vars(owner).items():
                code = getattr(getattr(value, "__func__", value), "__code__", None)
                if code is not None and any(Path(code.co_filename).resolve().is_relative_to(d) for d in ours):
                    patched.append(f"{owner.__name__}.{name} ({code.co_filename})")
    assert not patched, f"Triton is patched: {patched}"
