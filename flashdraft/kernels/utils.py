"""Triton helpers shared by the kernels of this package, none specific to one kernel.

- `INTERPRET`: whether the kernels of this package run under Triton's interpreter (TRITON_INTERPRET=1 when they
  were decorated) rather than compiled.
- `sigmoid`, `reduce_sum`: @triton.jit replacements of `tl.sigmoid` and `tl.sum` (see below why).
- `as_mask`: a scalar condition made fit to combine with a block mask, under every Triton interpreter.

The kernels call only Triton builtins and functions of this package: the interpreter cannot call Triton's own @jit
library functions (tl.sigmoid, tl.sum, tl.zeros, ...) when triton was first imported without TRITON_INTERPRET, as
happens when another module imported it before this package.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add(a, b):
    return a + b


# Triton reads TRITON_INTERPRET when `@triton.jit` runs, i.e. when this module is imported: the kernels of this
# package are then interpreted (and run on CPU tensors) instead of compiled.
INTERPRET = not isinstance(add, triton.runtime.JITFunction)
# Compiled kernels take SiLU's sigmoid from approximate PTX instructions (the interpreter runs no PTX).
_FAST_SIGMOID = tl.constexpr(not INTERPRET)


@triton.jit
def sigmoid(z):
    """1 / (1 + exp(-z)) in float32. Compiled, 4 instructions where `tl.exp` and `/` compile to 12 with their range
    checks: the same ex2.approx that tl.exp uses and rcp.approx (1 ulp), both flushing subnormals, which changes
    nothing here (the denominator is >= 1; exp(-z) below 2^-126 only meets 1 + exp(-z) = 1). The instruction count
    matters because a kernel that applies SiLU to every element it streams (the channel-last conv forward) can be
    bound by its instructions rather than by memory."""
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
def reduce_sum(x, axis: tl.constexpr):
    """The sum of x along `axis` (`tl.sum`)."""
    return tl.reduce(x, axis, add)


@triton.jit
def as_mask(cond):
    """`cond`, a scalar condition, as one that can be combined (`&`) with a block mask.

    Compiled, this is `cond` itself: `select(cond, true, false)` folds to `cond` when the kernel is canonicalised,
    so the generated code is that of `mask & cond`. Under the interpreter of Triton 3.9 a comparison keeps the type
    of its operands (int32 for `t < L`), and broadcasting it to a block then makes an int32 array, which `tl.load`
    and `tl.store` reject as a mask ("mask has unsupported dtype"); the select makes it a boolean again.
    """
    return tl.where(cond, True, False)
