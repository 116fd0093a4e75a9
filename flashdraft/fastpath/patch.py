"""Point every Gated DeltaNet layer of a transformers model at flashdraft's device-aware backends.

Two generations of transformers look the four functions up in different places:
- 5.2-5.14: per layer, in instance attributes set at `__init__` from the module's import-time imports.
- 5.15+:    in the modeling module's globals, resolved once at import by `use_kernel_func_from_hub_with_fallback`
            (each an `nn.Module` instance when a `kernels` release that transformers accepts is installed). From
            5.25 the layer calls the module's `causal_conv1d_forward`, which looks up the two conv globals itself.
We patch exactly where the running version looks, so the import order and whether the pip `causal-conv1d`
is installed do not matter. The releases in between changed the cache accessors (5.16, 5.21), moved the
grouped-value repeat of q/k into the rule functions (5.23: fla takes the ungrouped heads natively) and renamed
the cache keyword (5.24); none of that changes where the four functions are looked up. Model families are recognised by their layer class, not by name lists: every
`*GatedDeltaNet` layer of qwen3_5, qwen3_5_moe and qwen3_next follows one of the two patterns.
"""

from __future__ import annotations

import sys

import torch

from flashdraft.fastpath.backends import (
    CALLS,
    CHUNK_RULE,
    CONV_FN,
    CONV_UPDATE,
    RECURRENT_RULE,
    gated_norm_forward,
    make_backends,
    torch_fallbacks,
)

INSTANCE, GLOBALS = "instance-attributes (transformers 5.2-5.14)", "module-globals (transformers 5.15+)"
_INSTANCE_ATTRS = {
    CONV_FN: "causal_conv1d_fn",
    CONV_UPDATE: "causal_conv1d_update",
    CHUNK_RULE: "chunk_gated_delta_rule",
    RECURRENT_RULE: "recurrent_gated_delta_rule",
}
_GLOBAL_NAMES = {
    CONV_FN: "causal_conv1d_fn",
    CONV_UPDATE: "causal_conv1d_update",
    CHUNK_RULE: "torch_chunk_gated_delta_rule",
    RECURRENT_RULE: "torch_recurrent_gated_delta_rule",
}
# The unpatched functions of each module, captured before our first patch (fallbacks are built from them).
_ORIGINAL_GLOBALS: dict[str, dict[str, object]] = {}


def transformers_checks_devices() -> bool:
    """Whether transformers sends inputs on a device that the package it chose at import does not support to its
    own torch reference (5.25+). Before, fla's kernels chosen at import crash on a CPU unless patched."""
    from transformers.integrations import hub_kernels

    return hasattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES")


def linear_attention_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, module) of every Gated DeltaNet layer, in layer order."""
    found = [(m.layer_idx, m) for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    return sorted(found, key=lambda pair: pair[0])


def generation_of(layer: torch.nn.Module) -> str:
    return INSTANCE if hasattr(layer, _INSTANCE_ATTRS[CHUNK_RULE]) else GLOBALS


def modeling_module(layer: torch.nn.Module):
    return sys.modules[type(layer).__module__]


def entry_points(layer: torch.nn.Module) -> dict[str, tuple[object, str]]:
    """op -> (owner, attribute name): where this layer looks each op up at call time."""
    if generation_of(layer) == INSTANCE:
        return {op: (layer, _INSTANCE_ATTRS[op]) for op in CALLS}
    module = modeling_module(layer)
    return {op: (module, _GLOBAL_NAMES[op]) for op in CALLS}


def _originals(module) -> dict[str, object]:
    if module.__name__ not in _ORIGINAL_GLOBALS:
        _ORIGINAL_GLOBALS[module.__name__] = {name: getattr(module, name, None) for name in _GLOBAL_NAMES.values()}
    return _ORIGINAL_GLOBALS[module.__name__]


class Unpatched:
    """The module as it was before flashdraft patched it (for finding its torch fallbacks): a process that patched a
    model once keeps the module patched, and the fallbacks must never be the patched calls themselves."""

    def __init__(self, module):
        self._module, self._saved = module, _originals(module)

    def __getattr__(self, name):
        return self._saved[name] if name in self._saved else getattr(self._module, name)


def patch_model(model: torch.nn.Module, conv_backend: str = "auto") -> str | None:
    """Patch every linear-attention layer of `model`; return its transformers generation (None: no such layers)."""
    layers = linear_attention_layers(model)
    if layers:
        # Before any of their kernels runs: the autotuning choices shipped for this GPU (a fresh machine's minute).
        from flashdraft.kernels import tuned

        tuned.apply(next(model.parameters()).device)
    backends_by_module: dict[str, dict] = {}
    generation = None
    for _, layer in layers:
        module = modeling_module(layer)
        if module.__name__ not in backends_by_module:
            backends_by_module[module.__name__] = make_backends(torch_fallbacks(Unpatched(module)), conv_backend)
        backends = backends_by_module[module.__name__]
        generation = generation_of(layer)
        for op, (owner, name) in entry_points(layer).items():
            setattr(owner, name, backends[op])
        # An instance attribute shadows the class's forward; the module, its weight and state-dict keys stay.
        layer.norm.forward = gated_norm_forward(layer.norm)
    return generation


def is_patched(model: torch.nn.Module) -> bool:
    """Whether every linear-attention layer of `model` already looks up flashdraft's backends (True without any)."""
    for _, layer in linear_attention_layers(model):
        if not getattr(layer.norm.__dict__.get("forward"), "__flashdraft_backend__", False):
            return False
        for owner, name in entry_points(layer).values():
            if not getattr(getattr(owner, name, None), "__flashdraft_backend__", False):
                return False
    return True


def unpatch_model(model: torch.nn.Module) -> None:
    """Undo `patch_model` (module globals restored; 5.2-5.14 layers get their import-time choice back)."""
    for _, layer in linear_attention_layers(model):
        layer.norm.__dict__.pop("forward", None)
        module = modeling_module(layer)
        saved = _originals(module)
        if generation_of(layer) == GLOBALS:
            for name, fn in saved.items():
                setattr(module, name, fn)
        else:
            layer.causal_conv1d_fn = getattr(module, "causal_conv1d_fn", None)
            layer.causal_conv1d_update = (
                getattr(module, "causal_conv1d_update", None) or module.torch_causal_conv1d_update
            )
            layer.chunk_gated_delta_rule = (
                getattr(module, "chunk_gated_delta_rule", None) or module.torch_chunk_gated_delta_rule
            )
            layer.recurrent_gated_delta_rule = (
                getattr(module, "fused_recurrent_gated_delta_rule", None) or module.torch_recurrent_gated_delta_rule
            )
