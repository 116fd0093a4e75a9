"""Triton kernels, each beside its plain-PyTorch reference."""

from flashdraft.kernels.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

__all__ = ["causal_conv1d_fn", "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref"]
