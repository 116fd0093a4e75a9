"""Fixtures of the kernel tests: device, device-sized shapes, seeded inputs, NaN-poisoned outputs.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1, which Triton reads when a kernel is decorated, i.e.
when `flashdraft.kernels` is imported. The tests therefore import a private copy of the package with the variable
set, then put the environment, sys.modules and `flashdraft.kernels` back as they were: the rest of the test session
(the fast-path tests expect a CPU to fall back to torch) and Triton itself keep their normal, compiled mode.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# (B, D, L) by name; the same names (and tests) on both devices, small under the (slow) interpreter.
SHAPES = {
    "cpu": {"main": (2, 37, 21), "long": (1, 20, 500), "short": (3, 9, 5), "one": (2, 24, 1)},
    "cuda": {"main": (2, 10240, 4096), "long": (1, 1000, 8191), "short": (3, 37, 5), "one": (4, 10240, 1)},
}
# (B, D) of the update tests.
UPDATE_SHAPES = {"cpu": (3, 37), "cuda": (64, 10240)}


def _import_kernels():
    if CUDA:
        return importlib.import_module("flashdraft.kernels.causal_conv1d")
    ours = lambda name: name == "flashdraft.kernels" or name.startswith("flashdraft.kernels.")
    # Triton itself stays in its normal mode (imported first, without the variable): only our kernels are
    # interpreted, and they call no @jit function of Triton's library (see flashdraft/kernels/utils.py). Nor is
    # Triton patched: the kernels run under its stock interpreter (test_stock_interpreter.py checks it).
    import triton.language  # noqa: F401

    import flashdraft

    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
    saved_attr = flashdraft.__dict__.get("kernels")
    saved_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module("flashdraft.kernels.causal_conv1d")
    finally:
        if saved_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        if saved_attr is None:
            flashdraft.__dict__.pop("kernels", None)
        else:
            flashdraft.kernels = saved_attr


KERNELS = _import_kernels()


# The modules that allocate kernel outputs, each through `common.empty_like_output` (looked up at every call).
ALLOCATING_MODULES = ("forward", "backward", "function", "update")


@pytest.fixture
def cc(monkeypatch):
    """The `flashdraft.kernels.causal_conv1d` package under test, every kernel output allocated NaN-filled: an
    element a kernel fails to write then shows as NaN (the tests require finite outputs)."""
    allocate = KERNELS.common.empty_like_output

    def nan_filled(*args, **kwargs):
        return allocate(*args, **kwargs).fill_(float("nan"))

    for name in ALLOCATING_MODULES:
        module = getattr(KERNELS, name)
        assert module.common is KERNELS.common, f"{name}.py allocates its outputs some other way"
        assert not hasattr(module, "empty_like_output"), f"{name}.py binds its own empty_like_output"
    monkeypatch.setattr(KERNELS.common, "empty_like_output", nan_filled)
    return KERNELS


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def shapes() -> dict[str, tuple[int, int, int]]:
    return SHAPES[DEVICE]


@pytest.fixture
def update_shape() -> tuple[int, int]:
    return UPDATE_SHAPES[DEVICE]


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded by the test id: fresh inputs per test, the same on every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
