"""MFU's numerator and denominator: the FLOPs of a training step (the cost model) and the dense bf16 peak of the
GPU it runs on.

    flops = step_flops(s, seq_tokens, labelled)      # one step of a training Setup `s`
    peak = device_peak(torch.device("cuda"))         # None on the CPU and on a GPU missing from the table
    mfu = flops / seconds / peak.flops if peak else None

The GPU is recognised by its name (`torch.cuda.get_device_name`), compute capability and streaming multiprocessor
count, all three; a GPU that matches no row (a newer model, a MIG slice with fewer SMs) has no known peak, and MFU is
then reported as unknown rather than against another GPU's rate. `train.peak_tflops` gives the figure by hand.

Which figure each row holds:
- The vendor's datasheet rate of dense BF16 Tensor Core math (FP32 accumulate; half the 2:4-sparsity rate where
  that is the figure printed, as the row's source says). This is the usual MFU denominator, and it is the one used
  for every GPU but the H200.
- The H200 (SXM): the rate a large bf16 matmul reached on this project's H200 (`measured_tflops` of its row), not
  the datasheet's. The H200 MFU figures of the benchmarks (docs/benchmarks.md) and the training-speed goals are
  against that rate, and keeping it keeps them comparable. On the other GPUs MFU is against an upper bound no
  matmul reaches, so it reads lower than an H200's for the same efficiency; give `train.peak_tflops` a matmul rate
  measured there for like-for-like figures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    label: str
    name: str
    """Regular expression searched in `torch.cuda.get_device_name()` (case-insensitive)."""
    capability: tuple[int, int]
    sms: int | None
    """Streaming multiprocessors of the full GPU; None where one name covers several counts."""
    datasheet_tflops: float
    """Dense BF16 Tensor Core TFLOP/s of the vendor's datasheet."""
    source: str
    measured_tflops: float | None = None
    """A bf16 matmul's rate measured in this project; used instead of the datasheet figure (see the module)."""

    @property
    def tflops(self) -> float:
        return self.measured_tflops or self.datasheet_tflops


# Rows that one name could share come first (PCIe and NVL before SXM); a name pattern alone never decides: the
# capability and SM count must agree too.
# fmt: off
GPUS = (
    GPU("H100 PCIe", r"\bH100\b.*\bPCIe\b", (9, 0), 114, 756.0, "NVIDIA H100 datasheet (1,513 with sparsity)"),
    GPU("H100 NVL", r"\bH100\b.*\bNVL\b", (9, 0), 132, 835.5, "NVIDIA H100 datasheet (1,671 with sparsity)"),
    GPU("H100 SXM", r"\bH100\b", (9, 0), 132, 989.5, "NVIDIA H100 datasheet (1,979 with sparsity)"),
    GPU("H200 NVL", r"\bH200\b.*\bNVL\b", (9, 0), 132, 835.5, "NVIDIA H200 datasheet (1,671 with sparsity)"),
    GPU("H200", r"\bH200\b", (9, 0), 132, 989.5, "NVIDIA H200 datasheet (1,979 with sparsity)", measured_tflops=790.0),
    GPU("H800", r"\bH800\b", (9, 0), 132, 989.5, "NVIDIA H800 SXM5 datasheet (1,979 with sparsity)"),
    GPU("H20", r"\bH20\b", (9, 0), 78, 148.0, "NVIDIA H20 datasheet"),
    GPU("GH200", r"\bGH200\b", (9, 0), 132, 989.5, "NVIDIA GH200 datasheet (1,979 with sparsity)"),
    GPU("B200", r"\bB200\b", (10, 0), 148, 2250.0, "NVIDIA HGX B200 datasheet (36 PFLOPS per 8 GPUs with sparsity)"),
    GPU("B100", r"\bB100\b", (10, 0), None, 1750.0, "NVIDIA HGX B100 datasheet (28 PFLOPS per 8 GPUs with sparsity)"),
    GPU("GB200", r"\bGB200\b", (10, 0), None, 2500.0,
        "NVIDIA GB200 NVL72 datasheet (10 PFLOPS per superchip of 2 GPUs with sparsity)"),
    GPU("A100", r"\bA100\b", (8, 0), 108, 312.0, "NVIDIA A100 datasheet (624 with sparsity)"),
    GPU("A800", r"\bA800\b", (8, 0), 108, 312.0, "NVIDIA A800 datasheet (624 with sparsity)"),
    GPU("A30", r"\bA30\b", (8, 0), 56, 165.0, "NVIDIA A30 datasheet (330 with sparsity)"),
    GPU("A40", r"\bA40\b", (8, 6), 84, 149.7, "NVIDIA A40 datasheet (299.4 with sparsity)"),
    GPU("A10", r"\bA10\b", (8, 6), 72, 125.0, "NVIDIA A10 datasheet (250 with sparsity)"),
    GPU("L40S", r"\bL40S\b", (8, 9), 142, 362.05, "NVIDIA L40S datasheet (733 with sparsity)"),
    GPU("L40", r"\bL40\b", (8, 9), 142, 181.05, "NVIDIA L40 datasheet (362.1 with sparsity)"),
    GPU("L4", r"\bL4\b", (8, 9), 58, 121.0, "NVIDIA L4 datasheet (242 with sparsity)"),
    GPU("RTX 4090", r"\bRTX 4090\b", (8, 9), 128, 165.2,
        "NVIDIA Ada GPU architecture whitepaper (330.4 with sparsity)"),
)
# fmt: on


@dataclass(frozen=True)
class Peak:
    flops: float
    """FLOP/s of one device."""
    source: str
    """Where the figure comes from, for the start-up line."""


def find_gpu(name: str, capability: tuple[int, int], sms: int) -> GPU | None:
    """The table's row of a GPU reported as `name` with this capability and SM count, or None."""
    for gpu in GPUS:
        if (
            re.search(gpu.name, name, re.IGNORECASE)
            and tuple(capability) == gpu.capability
            and (gpu.sms is None or sms == gpu.sms)
        ):
            return gpu
    return None


def device_peak(device: torch.device, override_tflops: float | None = None) -> Peak | None:
    """Dense bf16 FLOP/s of `device` (one GPU): `override_tflops` when given, else the table's; None on a CPU or
    an unknown GPU."""
    if device.type != "cuda":
        return None
    if override_tflops is not None:
        return Peak(override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (train.peak_tflops)")
    props = torch.cuda.get_device_properties(device)
    gpu = find_gpu(props.name, (props.major, props.minor), props.multi_processor_count)
    if gpu is None:
        return None
    if gpu.measured_tflops:
        basis = f"a bf16 matmul measured on an {gpu.label}; datasheet {gpu.datasheet_tflops:g}"
    else:
        basis = f"dense bf16, {gpu.source}"
    return Peak(gpu.tflops * 1e12, f"{gpu.tflops:g} TFLOP/s of the {gpu.label} ({basis})")


def describe(device: torch.device, peak: Peak | None) -> str | None:
    """One start-up line saying what MFU is measured against on a GPU (None on a CPU: no MFU there)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if peak is None:
        return (
            f"MFU: unknown on {name} (not in flashdraft's table of GPUs); set train.peak_tflops to its dense "
            "bf16 TFLOP/s to report it"
        )
    return f"MFU against {peak.source} ({name})"


def step_flops(s, seq_tokens: int, labelled: int) -> float:
    """FLOPs of a training step of `s` (a `Setup`, or anything with its `.target` and `.drafter`), attention
    excluded: 2 x params for the target forward over the sequence tokens (up to the last captured layer, or all of
    them when the target's own distributions are read), 6 x params for the drafter's forward and backward (fc over
    the sequence tokens, the rest over the block positions), 4 x vocab x width for the LM-head loss (its forward and
    input gradient) over the labelled positions, and there 2 x vocab x width more for the target's distribution
    where it is read. A Markov head's rank r costs 6 x vocab x r per labelled position (its bias, the bias's
    gradients to the features and to W2); its embedding W1 is a lookup, not counted."""
    target_params = sum(
        p.numel() for n, p in s.target.model.named_parameters() if "embed" not in n and "lm_head" not in n
    )
    fc_params = s.drafter.fc.weight.numel()  # fc runs over the context tokens, every other weight over the blocks
    markov = getattr(s.drafter, "markov_head", None)
    markov_params = 0 if markov is None else sum(p.numel() for p in (markov.markov_w1.weight, markov.markov_w2.weight))
    drafter_params = sum(p.numel() for p in s.drafter.parameters()) - fc_params - markov_params
    vocab, width = s.target.lm_head_weight.shape
    drafts = getattr(s.drafter, "num_drafts", s.drafter.block_size - 1)
    blocks_tokens = labelled * s.drafter.block_size / max(1, drafts)
    teacher = 2 * vocab * width * labelled if getattr(s.target, "final_hidden", False) else 0
    return (
        2 * target_params * seq_tokens
        + 6 * drafter_params * blocks_tokens
        + 6 * fc_params * seq_tokens
        + 4 * vocab * width * labelled
        + teacher
        + (0 if markov is None else 6 * vocab * markov.rank * labelled)
    )
