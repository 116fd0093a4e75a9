"""Device-aware implementations of the four calls a Gated DeltaNet layer makes.

transformers picks each implementation once, at import, and silently keeps the torch fallback when an import
fails (or, on a machine without a GPU, keeps an fla kernel that then crashes). The callables built here decide
per call instead: the fast kernel when the inputs are on a CUDA device it supports, the layer's own torch
reference otherwise — and they say which they used (and why) to an active probe (see probe.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashdraft.fastpath import record

CONV_FN, CONV_UPDATE, CHUNK_RULE, RECURRENT_RULE = CALLS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
)
# The layer's output norm is a module, not a looked-up function, but it is part of the layer's fast path too:
# transformers 5.2-5.14 used fla's fused kernel for it when fla imported; 5.15+ always runs the torch one.
GATED_NORM = "gated_rms_norm"
OPS = (*CALLS, GATED_NORM)

# Implementation names, as they appear in probe reports.
FLASHDRAFT_TRITON = "flashdraft-triton"
DAO_CUDA = "causal-conv1d-cuda"
FLA = "fla"
TORCH = "torch"

FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CONV_BACKENDS = ("auto", "flashdraft", "dao", "torch")


@functools.cache
def import_status(module: str) -> tuple[object | None, str]:
    """(module or None, reason) — the import is attempted once per process."""
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # any failure (ImportError, a broken build's NameError, ...) means "not usable"
        return None, f"{module} not importable ({type(exc).__name__}: {exc})"


def _fla_ops():
    mod, why = import_status("fla.ops.gated_delta_rule")
    return (mod.chunk_gated_delta_rule, mod.fused_recurrent_gated_delta_rule) if mod else (None, None), why


def _device_reason(*tensors: torch.Tensor) -> str:
    """Why the fast kernels cannot take these tensors, or '' if they can."""
    for t in tensors:
        if t is not None and t.device.type != "cuda":
            return f"fallback: no CUDA device (tensor on {t.device.type})"
    return ""


@functools.cache
def fla_chunk_backward_problem() -> str:
    """Why fla's gated chunk delta rule cannot be differentiated on this machine, or ''.

    fla 0.6 refuses (raises inside backward) the gated `chunk_bwd_dqkwg` on Hopper GPUs with Triton 3.4-3.7.0,
    which it found to give wrong gradients (fla issue #640), unless tilelang provides another backend. Forward
    passes are unaffected, so a frozen target keeps fla; only calls that need gradients fall back.
    """
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception:  # an older or broken fla: nothing known against it here
        return ""
    if (
        IS_NVIDIA_HOPPER
        and TRITON_ABOVE_3_4_0
        and not TRITON_ABOVE_3_7_1
        and importlib.util.find_spec("tilelang") is None
    ):
        return (
            "fallback: fla refuses the gated chunk backward on Hopper with Triton < 3.7.1 (fla #640); "
            "Triton >= 3.7.1 or tilelang lifts this"
        )
    return ""


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True)
class TorchFallbacks:
    """The torch reference functions of one modeling module (its own, so numerics match the unpatched model)."""

    conv_fn: Callable
    conv_update: Callable
    chunk_rule: Callable
    recurrent_rule: Callable


def hub_wrapped(fn):
    """The function behind the `kernels` package's wrapper, or `fn` itself.

    With a `kernels` release that transformers accepts installed, `use_kernel_forward_from_hub` turns each
    decorated function into an `nn.Module` instance whose forward calls the function (a closure cell `func`).
    """
    if isinstance(fn, torch.nn.Module):
        forward = type(fn).forward
        names, cells = forward.__code__.co_freevars, forward.__closure__ or ()
        if "func" in names:
            return cells[names.index("func")].cell_contents
    return fn


def _unwrap(fn):
    """The undecorated function: through the `kernels` wrapper, then every `functools.wraps` layer."""
    return inspect.unwrap(hub_wrapped(fn)) if fn is not None else None


def _is_decorated(fn) -> bool:
    return fn is not None and getattr(hub_wrapped(fn), "__wrapped__", None) is not None


def torch_fallbacks(module) -> TorchFallbacks:
    """Find the torch reference implementations in a modeling module of either transformers generation."""
    from flashdraft.kernels import causal_conv1d_ref, causal_conv1d_update_ref

    chunk = _unwrap(module.torch_chunk_gated_delta_rule)
    recurrent = _unwrap(module.torch_recurrent_gated_delta_rule)
    # 5.15+: the decorated functions wrap the torch code; 5.2-5.14 has no torch conv_fn (the layer calls nn.Conv1d).
    conv_fn = getattr(module, "causal_conv1d_fn", None)
    conv_fn = _unwrap(conv_fn) if _is_decorated(conv_fn) else None
    conv_update = getattr(module, "torch_causal_conv1d_update", None) or _unwrap(module.causal_conv1d_update)
    if conv_update is not None and not conv_update.__module__.startswith("transformers"):
        conv_update = None
    return TorchFallbacks(
        conv_fn=_reference_conv_fn(causal_conv1d_ref, conv_fn),
        conv_update=conv_update or _reference_conv_update(causal_conv1d_update_ref),
        chunk_rule=chunk,
        recurrent_rule=recurrent,
    )


def _reference_conv_fn(ref, transformers_fn=None):
    # transformers' own torch conv ignores seq_idx (packed sequences would mix); ours honours it.
    def conv_fn(x, weight, bias=None, activation=None, seq_idx=None, **_):
        if transformers_fn is not None and seq_idx is None:
            return transformers_fn(x, weight, bias, activation=activation)
        return ref(x, weight, bias, seq_idx=seq_idx, activation=activation)

    return conv_fn


def _reference_conv_update(ref):
    def conv_update(x, conv_state, weight, bias=None, activation=None, **_):
        return ref(x, conv_state, weight, bias, activation=activation)

    return conv_update


def _conv_kernels(conv_backend: str):
    """(impl name, causal_conv1d_fn, causal_conv1d_update, reason-if-unavailable) for a conv backend choice."""
    if conv_backend not in CONV_BACKENDS:
        raise ValueError(f"conv_backend must be one of {CONV_BACKENDS}, got {conv_backend!r}")
    if conv_backend == "torch":
        return TORCH, None, None, "fallback: conv_backend='torch' requested"
    if conv_backend == "dao":
        mod, why = import_status("causal_conv1d")
        if mod is None:
            return DAO_CUDA, None, None, f"fallback: {why}"
        return DAO_CUDA, mod.causal_conv1d_fn, mod.causal_conv1d_update, ""
    # auto / flashdraft: ours, which needs no build; how it compares with Dao's kernel: bench/RESULTS.md.
    from flashdraft import kernels

    return FLASHDRAFT_TRITON, kernels.causal_conv1d_fn, kernels.causal_conv1d_update, ""


def make_backends(fallbacks: TorchFallbacks, conv_backend: str = "auto") -> dict[str, Callable]:
    """The four device-aware callables, keyed by op name, with the union of both generations' signatures."""
    conv_name, fast_conv_fn, fast_conv_update, conv_missing = _conv_kernels(conv_backend)
    (fla_chunk, fla_recurrent), fla_missing = _fla_ops()
    fla_missing = f"fallback: {fla_missing}" if fla_missing else ""

    def conv_reason(x):
        if conv_missing:
            return conv_missing
        if conv_name == FLASHDRAFT_TRITON:
            from flashdraft.kernels.causal_conv1d import triton_available_for

            if not triton_available_for(x):
                return _device_reason(x) or "fallback: Triton unavailable for this tensor"
            return ""
        return _device_reason(x)

    def causal_conv1d_fn(x=None, weight=None, bias=None, activation=None, seq_idx=None, hidden_states=None, **_):
        x = hidden_states if x is None else x
        why = conv_reason(x)
        record.note(CONV_FN, TORCH if why else conv_name, why)
        if why:
            return fallbacks.conv_fn(x, weight, bias, activation=activation, seq_idx=seq_idx)
        return fast_conv_fn(x, weight, bias, seq_idx=seq_idx, activation=activation)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **_):
        why = conv_reason(x)
        record.note(CONV_UPDATE, TORCH if why else conv_name, why)
        if why:
            return fallbacks.conv_update(x, conv_state, weight, bias, activation)
        return fast_conv_update(x, conv_state, weight, bias, activation)

    def rule_reason(q):
        if fla_missing:
            return fla_missing
        why = _device_reason(q)
        if not why and q.dtype not in FLA_DTYPES:
            why = f"fallback: dtype {q.dtype} not supported by fla"
        return why

    def gated_delta_rule(name: str, fla_fn, torch_fn, backward_problem=None):
        """The device-aware call `name`: fla's `fla_fn` when it can take the inputs, else the layer's `torch_fn`
        (which takes no cu_seqlens). `backward_problem`: why fla's backward cannot run on this machine ('' if it
        can), asked only when the call needs gradients; None for a kernel without such a problem."""

        def rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=None,
            **_,
        ):
            why = rule_reason(q)
            if not why and backward_problem is not None and _needs_grad(q, k, v, g, beta, initial_state):
                why = backward_problem()
            record.note(name, TORCH if why else FLA, why)
            fn = torch_fn if why else fla_fn
            kwargs = {} if why else {"cu_seqlens": cu_seqlens}
            return fn(
                q,
                k,
                v,
                g=g,
                beta=beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )

        return rule

    backends = {
        CONV_FN: causal_conv1d_fn,
        CONV_UPDATE: causal_conv1d_update,
        CHUNK_RULE: gated_delta_rule(CHUNK_RULE, fla_chunk, fallbacks.chunk_rule, fla_chunk_backward_problem),
        RECURRENT_RULE: gated_delta_rule(RECURRENT_RULE, fla_recurrent, fallbacks.recurrent_rule),
    }
    for fn in backends.values():
        fn.__flashdraft_backend__ = True
    return backends


def gated_norm_forward(norm: torch.nn.Module):
    """A device-aware forward for a layer's gated RMSNorm (`norm(x) * weight * silu(gate)`), bound to `norm`."""
    mod, why = import_status("fla.modules")
    fused = getattr(mod, "FusedRMSNormGated", None)
    fla_norm = importlib.import_module("fla.modules.fused_norm_gate").rms_norm_gated if mod is not None else None
    missing = f"fallback: {why}" if why else ""
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    torch_forward = type(norm).forward if fused is None or not isinstance(norm, fused) else None

    def forward(hidden_states, gate):
        why = missing or _device_reason(hidden_states)
        if not why and hidden_states.dtype not in FLA_DTYPES:
            why = f"fallback: dtype {hidden_states.dtype} not supported by fla"
        record.note(GATED_NORM, TORCH if why else FLA, why)
        if not why:
            return fla_norm(hidden_states, gate, norm.weight, None, activation="silu", eps=eps)
        if torch_forward is not None:
            return torch_forward(norm, hidden_states, gate)
        return _torch_gated_rms_norm(hidden_states, gate, norm.weight, eps)

    forward.__flashdraft_backend__ = True
    return forward


def _torch_gated_rms_norm(x, gate, weight, eps):
    # Same arithmetic as transformers' Qwen3_5RMSNormGated (used when the layer was built with fla's module).
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * torch.nn.functional.silu(gate.float())).to(dtype)
