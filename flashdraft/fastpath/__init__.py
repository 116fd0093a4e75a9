"""Make every linear-attention layer of a hybrid target use the fast kernels — and prove it, per layer.

    from flashdraft import fastpath
    report = fastpath.enable(model)          # raises FastPathError naming the layers that fell back
    print(report)                            # a table: layer x {conv fn, conv update, chunk rule, recurrent rule}

`strict=False` (CPU runs, tests) returns the report instead of raising; on a CPU every call reports
"fallback: no CUDA device" and runs transformers' own torch reference, which is correct.
"""

from __future__ import annotations

import torch

from flashdraft.fastpath.probe import FastPathReport, probe


class FastPathError(RuntimeError):
    """Some linear-attention layer did not run a fast kernel; the message names the layers and why."""

    def __init__(self, report: FastPathReport):
        super().__init__(report.failure_message())
        self.report = report


def enable(
    model: torch.nn.Module, strict: bool = True, conv_backend: str = "auto", run_probe: bool = True
) -> FastPathReport:
    """Patch `model`'s Gated DeltaNet layers to the device-aware fast backends and probe them.

    conv_backend: "auto" / "flashdraft" (our Triton kernel), "dao" (pip causal-conv1d), "torch".
    With `strict`, raise FastPathError if any call of any layer did not use a fast kernel.
    """
    from flashdraft.fastpath.patch import patch_model

    generation = patch_model(model, conv_backend)
    if not run_probe:
        return FastPathReport("", generation, "", "", "", [])
    report = probe(model)
    if strict and not report.ok:
        raise FastPathError(report)
    return report


def ensure(model: torch.nn.Module) -> None:
    """Make `model` runnable on its device: patch its linear-attention layers unless they already are.

    What every public entry point that takes a user's model calls (generation, the baselines, evaluation, target
    capture, the engine). Without it, transformers 5.15-5.24 keep fla's kernels chosen at import, which crash on a
    CPU. Idempotent and cheap once patched (no probe); an earlier `enable` (its conv backend) is kept.
    """
    from flashdraft.fastpath.patch import is_patched, patch_model

    if not is_patched(model):
        patch_model(model)


def disable(model: torch.nn.Module) -> None:
    """Restore what transformers chose at import."""
    from flashdraft.fastpath.patch import unpatch_model

    unpatch_model(model)


__all__ = ["FastPathError", "FastPathReport", "disable", "enable", "ensure", "probe"]
