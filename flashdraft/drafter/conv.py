"""DFlash2's two-tap grouped dynamic convolution around each sublayer of a drafter layer (z-lab's inference code).

Inside the residual branch of every attention and MLP sublayer, the normed input u goes through a short causal
convolution before the sublayer, and the sublayer's output through another after it:

    u' = conv_pre(u);  y = sublayer(u');  x = x + conv_post(y)

Both kernels come from one grouped projection of u, the sublayer's normed input (so the correction applied after
the sublayer is predicted from its input). With K taps, G channels per group and side s (0 pre, 1 post):

    D = kernel_projection(u) viewed as (2, K, H / G)                   (row-major: s, then tap, then group)
    y[t, c] = Σ_o (base_kernel[s, o, c] + D[t, s, o, c // G]) · z[t − o, c]

z is u (pre) or the sublayer's output (post); the dynamic part is that of the position t being written and is
shared by the G channels of a group, the base kernel is per channel. The convolution is causal and never crosses a
block: a tap reaching before block position 0 reads zeros (the anchor sees only itself, position 1 the anchor).
Packed training blocks are told apart by their position modulo the block size (the reference's trainers do the
same); a query shorter than a block, or not a whole number of blocks, is one block (a truncated decode block).

The context stream (the target's features, keys and values only) is never convolved. At initialisation tap 0 is
1, the other taps 0 and the projection 0: each convolution is the identity, so a new DFlash2 backbone computes
what the DFlash backbone with the same weights does. `reference_conv` writes the formula element by element.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class GroupedDynamicConv(nn.Module):
    """The pre and post convolutions of one sublayer (the module docstring). Checkpoint names: `base_kernel`
    (2, K, H) and `kernel_projection.weight` (2·K·H/G, H)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity (see the module docstring); marked initialised so that the drafter's `post_init` keeps it."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1
            self.kernel_projection.weight.zero_()
        for param in (self.base_kernel, self.kernel_projection.weight):
            param._is_hf_initialized = True

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., Q, H) normed sublayer input -> (the pre-convolved input, the post side's dynamic kernel)."""
        dynamic = self.kernel_projection(u).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(u, 0, dynamic[..., 0, :, :]), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output (..., Q, H) post-convolved with `prepare`'s dynamic kernel."""
        return self._convolve(y, 1, dynamic)

    def forward(self, sublayer: Callable[[torch.Tensor], torch.Tensor], u: torch.Tensor) -> torch.Tensor:
        """conv_post(sublayer(conv_pre(u)))."""
        pre, dynamic = self.prepare(u)
        return self.finish(sublayer(pre), dynamic)

    def _convolve(self, z: torch.Tensor, side: int, dynamic: torch.Tensor) -> torch.Tensor:
        q_len, hidden = z.shape[-2:]
        block = self.block_size if q_len % self.block_size == 0 else q_len
        if self.kernel_size > block:
            raise ValueError(f"conv_kernel_size {self.kernel_size} reaches past a block of {block} positions")
        blocks = z.view(*z.shape[:-2], q_len // block, block, hidden)
        out = z * self.base_kernel[side, 0].to(z.dtype)
        out = out + _grouped(z, dynamic[..., 0, :], self.group_size)
        for tap in range(1, self.kernel_size):
            # Position t reads t − tap of its own block; the first `tap` positions of every block read zeros.
            shifted = nn.functional.pad(blocks[..., : block - tap, :], (0, 0, tap, 0)).view_as(z)
            out = out + shifted * self.base_kernel[side, tap].to(z.dtype)
            out = out + _grouped(shifted, dynamic[..., tap, :], self.group_size)
        return out


def _grouped(z: torch.Tensor, per_group: torch.Tensor, group_size: int) -> torch.Tensor:
    """z (..., H) times a (..., H / G) factor shared by each group of G contiguous channels."""
    return (z.unflatten(-1, (-1, group_size)) * per_group[..., None].to(z.dtype)).flatten(-2)


def around(conv: GroupedDynamicConv | None, sublayer: Callable[[torch.Tensor], torch.Tensor], u: torch.Tensor):
    """`sublayer(u)`, wrapped in `conv` when the layer has one (DFlash2's layers do, DFlash's do not)."""
    return sublayer(u) if conv is None else conv(sublayer, u)


def reference_conv(
    conv: GroupedDynamicConv, sublayer: Callable[[torch.Tensor], torch.Tensor], u: torch.Tensor, block: int
) -> torch.Tensor:
    """`conv(sublayer, u)` of (B, Q, H) blocks of `block` positions, written from the formula one output element at a
    time in float64 (slow: for tests on small shapes)."""
    u = u.double()
    base = conv.base_kernel.double()
    weight = conv.kernel_projection.weight.double()
    k_taps, group = conv.kernel_size, conv.group_size
    batch, q_len, hidden = u.shape
    # D[b, t, s, o, g] from the flat projection row s·K·ng + o·ng + g.
    flat = torch.einsum("bth,jh->btj", u, weight)

    def side(z, s):
        rows = []
        for b in range(batch):
            for t in range(q_len):
                values = []
                for c in range(hidden):
                    total = z.new_zeros(())
                    for o in range(k_taps):
                        if t % block - o < 0:
                            continue
                        d = flat[b, t, s * k_taps * conv.groups + o * conv.groups + c // group]
                        total = total + (base[s, o, c] + d) * z[b, t - o, c]
                    values.append(total)
                rows.append(torch.stack(values))
        return torch.stack(rows).view(batch, q_len, hidden)

    return side(sublayer(side(u, 0)), 1)


__all__ = ["GroupedDynamicConv", "around", "reference_conv"]
