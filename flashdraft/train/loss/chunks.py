"""What the chunked losses share: one chunk's logits through the frozen LM head, their compiled chunk math, and
their options read by name.

Every loss here walks the labelled rows in chunks so that a (rows, vocabulary) block of logits exists for one chunk
at a time; `chunk_logits` makes that block, `compiled` compiles a loss's per-chunk softmax arithmetic once. A loss
that wraps another (or its reference) takes the other's keyword options through `options_of`, so the two share one
list of names and defaults.
"""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import torch


@functools.cache
def has_fp32_out_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(..., out_dtype=float32)` exists for `dtype` on this device (CUDA bf16/fp16 today)."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """(c, D) x (V, D) → (c, V) logits in `compute_dtype`, the matmul in the head's dtype."""
    hidden = hidden.to(weight.dtype)
    if weight.dtype != compute_dtype and has_fp32_out_mm(weight.device.type, weight.dtype):
        # fp32 accumulate *and* fp32 output: no rounding of the logits to bf16 before the softmax.
        return torch.mm(hidden, weight.t(), out_dtype=compute_dtype)
    return torch.mm(hidden, weight.t()).to(compute_dtype)


@functools.cache
def compiled(chunk_fn):
    """`chunk_fn` under torch.compile; dynamic, because the last chunk has fewer rows (one graph serves every
    chunk size)."""
    return torch.compile(chunk_fn, dynamic=True)


def options_of(function, options: dict) -> SimpleNamespace:
    """`options` bound to `function`'s parameters with its defaults filled in (a name it does not take raises)."""
    bound = inspect.signature(function).bind_partial(**options)
    bound.apply_defaults()
    return SimpleNamespace(**bound.arguments)


__all__ = ["chunk_logits", "compiled", "has_fp32_out_mm", "options_of"]
