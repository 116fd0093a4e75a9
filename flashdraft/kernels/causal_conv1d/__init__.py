"""Causal depthwise conv1d in Triton: a drop-in for Dao-AILab causal-conv1d 1.7.0 that needs no compile step.

- `causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation)`
- `causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)`
- `causal_conv1d_ref`, `causal_conv1d_update_ref`: the plain-PyTorch references the tests compare against.

The kernels run on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before this package was
imported (Triton reads it when the kernels are decorated); otherwise the public functions raise RuntimeError and
`triton_available_for` says so beforehand.
"""

import torch

from flashdraft.kernels.causal_conv1d.reference import (
    UnsupportedActivationError,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)

try:
    import triton  # noqa: F401
except ImportError:  # Triton ships for Linux only; the references must stay importable (CPU fallback) elsewhere.
    INTERPRET = False
    CausalConv1dFunction = None

    def _no_triton(*args, **kwargs):
        raise RuntimeError("the causal_conv1d kernels need Triton, which is not installed on this platform")

    causal_conv1d_fn = causal_conv1d_update = _no_triton
else:
    from flashdraft.kernels.causal_conv1d.function import CausalConv1dFunction, causal_conv1d_fn
    from flashdraft.kernels.causal_conv1d.update import causal_conv1d_update
    from flashdraft.kernels.utils import INTERPRET


def triton_available_for(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `tensor`'s device: CUDA, or any device under TRITON_INTERPRET=1."""
    return CausalConv1dFunction is not None and (INTERPRET or tensor.is_cuda)


__all__ = [
    "CausalConv1dFunction",
    "UnsupportedActivationError",
    "causal_conv1d_fn",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "triton_available_for",
]
