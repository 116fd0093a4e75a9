"""FP8 linear layers for a frozen target (`target.precision: fp8`): weights quantized once, activations per row.

    converted = convert_linears(model.model.layers)     # nn.Linear -> FP8Linear in place; the names converted
    y = linear(x)                                       # ≈ x @ W.T: one FP8 GEMM, a scale per row of x and of W

Each row of the activation (a token) and each row of the weight (an output channel) gets its own scale, amax / 448,
so that its largest element lands on float8_e4m3fn's largest finite value; the GEMM multiplies the FP8 values,
accumulates in float32 and applies both scales to the bf16 output.

Why torch's scaled matmul rather than torchao's float8 inference config: the GEMM is the same one (torchao's row-wise
config calls `torch._scaled_mm` with these scales); what is left to write is a per-row amax and a cast. torchao would
add a dependency tied to each torch release, and its tensor-subclass weights change what state dicts, FSDP and
torch.compile see, where an `FP8Linear` is a plain module the per-layer probe can check (`fastpath.probe`).

Left in bf16: the embedding and the LM head (the drafter reads them: its input embedding and its loss), every norm,
and the linears whose output is a gate rather than a hidden state — the Gated DeltaNet decay and β projections and an
MoE router — which Qwen's own FP8 checkpoints also keep in bf16: their errors would compound through the recurrence
or the routing, for GEMMs too small to gain. A linear whose sizes are not multiples of 16 (the GEMM's tile) stays too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Last names of linears kept in bf16 (see the module docstring): Qwen3.5's decay (a) and β (b) projections, the
# fused `in_proj_ba` of transformers before 5.25 and of Qwen3-Next, an MoE router and its shared-expert gate.
KEEP_BF16 = frozenset({"in_proj_a", "in_proj_b", "in_proj_ba", "gate", "shared_expert_gate"})
# The oldest compute capability with FP8 tensor cores (Ada: 8.9; Hopper: 9.0).
MIN_CAPABILITY = (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (float8_e4m3fn (M, K), float32 (M, 1) scales) with x ≈ q * scale, row by row.

    An all-zero row gets a tiny scale rather than zero, so that it quantizes to zeros and not NaN.
    """
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class FP8Linear(nn.Module):
    """A frozen `nn.Linear` computed as an FP8 GEMM (see the module docstring). The output has the input's dtype.

    `weight` (out, in) float8_e4m3fn and `weight_scale` (1, out) float32 replace the bf16 weight; the parameter keeps
    its name and element count, so FLOP counts and module paths do not change. `fast_accum`: Hopper's faster FP8
    accumulation (what torchao's inference configs use); `bench.feature_error` measures both.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fast_accum: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_rows(weight.detach())
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale.reshape(1, -1))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.fast_accum = fast_accum

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, fast_accum: bool = True) -> FP8Linear:
        return cls(linear.weight, linear.bias, fast_accum=fast_accum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes from the tensors, not from int attributes: compiled (`target.compile`), every FP8 linear then
        # shares one dynamic-shape graph instead of one per (in, out) pair.
        rows = x.reshape(-1, x.shape[-1])
        q, scale = quantize_rows(rows.contiguous())  # the GEMM takes its first operand row-major
        out = torch._scaled_mm(
            q,
            self.weight.t(),  # (in, out), column-major: the layout the GEMM wants
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype,
            use_fast_accum=self.fast_accum,
        )
        return out.reshape(*x.shape[:-1], self.weight.shape[0])

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) float32: the weight the GEMM really multiplies."""
        return self.weight.float() * self.weight_scale.t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def convertible(name: str, module: nn.Module) -> bool:
    """Whether the linear at `name` runs in FP8 (see the module docstring for those that do not)."""
    return (
        type(module) is nn.Linear
        and name.rsplit(".", 1)[-1] not in KEEP_BF16
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_linears(root: nn.Module, *, fast_accum: bool = True) -> list[str]:
    """Replace, in place, every convertible `nn.Linear` under `root` by an `FP8Linear`; returns their names.

    Each bf16 weight is freed as soon as its FP8 copy exists (nothing else holds it), so converting a loaded target
    needs one layer's worth of extra memory, not a second model.
    """
    converted = []
    for name, module in list(root.named_modules()):
        if not convertible(name, module):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, FP8Linear.from_linear(module, fast_accum=fast_accum))
        converted.append(name)
    return converted


def fp8_linears(root: nn.Module) -> list[tuple[str, FP8Linear]]:
    return [(name, m) for name, m in root.named_modules() if isinstance(m, FP8Linear)]


# ---- the probe's proof (fastpath.probe runs these hooks) -----------------------------------------------------------

# An FP8 linear's bf16 output against the float32 product of its own FP8 operands: bf16 rounding (2^-9) and the
# GEMM's faster accumulation stay well inside this; a wrong scale or layout is off by O(1).
TOLERANCE = 2e-2


@dataclass
class FP8Use:
    """What the probe saw of a model's FP8 linears."""

    converted: int
    proven: int = 0
    """Called during the probe, and equal to the float32 product of their own FP8 operands (within TOLERANCE)."""
    max_error: float = 0.0
    """Largest relative error (Frobenius) of one linear's output against that product."""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.proven == self.converted and not self.failures

    def summary(self) -> str:
        if self.ok:
            return (
                f"all {self.converted} FP8 linears ran row-scaled FP8 GEMMs (largest error against their float32 "
                f"reference {self.max_error:.1e})"
            )
        unproven = self.converted - self.proven
        return f"{unproven} of {self.converted} FP8 linears unproven: " + "; ".join(self.failures[:4])

    @classmethod
    def from_errors(cls, linears: list[tuple[str, FP8Linear]], errors: dict[str, float]) -> FP8Use:
        """`errors`: what `check_output` recorded for each linear name during the probe."""
        use = cls(converted=len(linears))
        for name, _ in linears:
            if name not in errors:
                use.failures.append(f"{name}: not called by the probe")
            elif not errors[name] <= TOLERANCE:
                use.failures.append(f"{name}: error {errors[name]:.2e} against its float32 reference")
            else:
                use.proven += 1
        use.max_error = max(errors.values(), default=0.0)
        return use


def check_output(errors: dict[str, float], name: str, module: FP8Linear, args, output) -> None:
    """Forward hook: the output against the float32 product of the module's own FP8 operands; the largest relative
    error over the calls is kept in errors[name] (NaN counts as infinite)."""
    rows = args[0].reshape(-1, module.in_features)
    q, scale = quantize_rows(rows)
    reference = (q.float() * scale) @ module.dequantized_weight().t()
    if module.bias is not None:
        reference = reference + module.bias.float()
    got = output.reshape(-1, module.out_features).float()
    error = ((got - reference).norm() / reference.norm().clamp(min=1e-30)).item()
    errors[name] = max(errors.get(name, 0.0), error if error == error else float("inf"))


def unsupported_reason(device: torch.device) -> str | None:
    """Why `device` cannot run FP8 GEMMs, or None when it has FP8 tensor cores (compute capability 8.9+)."""
    if device.type != "cuda":
        return (
            f"the {device.type} device has no FP8 matrix multiplication (an NVIDIA GPU of compute capability 8.9+ has)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores (they start at 8.9: Ada, Hopper)"
    return None


__all__ = [
    "FP8",
    "FP8Linear",
    "FP8Use",
    "check_output",
    "KEEP_BF16",
    "convert_linears",
    "convertible",
    "fp8_linears",
    "quantize_rows",
    "unsupported_reason",
]
