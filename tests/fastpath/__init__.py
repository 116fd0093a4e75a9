"""Tests of flashdraft.fastpath, and what they share with the spec tests and the generation checks: the torch
reference of whichever transformers generation is installed, and what it bound at import."""

from __future__ import annotations

import inspect
import sys

import torch
import transformers

from flashdraft.fastpath.backends import CHUNK_RULE, CONV_FN, CONV_UPDATE, FLA, RECURRENT_RULE, hub_wrapped
from flashdraft.fastpath.patch import (
    GLOBALS,
    INSTANCE,
    entry_points,
    linear_attention_layers,
    transformers_checks_devices,
)
from flashdraft.fastpath.probe import describe


def expected_generation() -> str:
    """Layer attributes up to transformers 5.14, module globals from 5.15 (see flashdraft/fastpath/patch.py)."""
    return INSTANCE if int(transformers.__version__.split(".")[1]) <= 14 else GLOBALS


def _torch_functions(layer, module) -> dict[str, object]:
    """op -> transformers' own torch reference, as the layer looks it up."""
    if expected_generation() == INSTANCE:  # conv None: the layer runs its nn.Conv1d
        return {
            CONV_FN: None,
            CONV_UPDATE: module.torch_causal_conv1d_update,
            CHUNK_RULE: module.torch_chunk_gated_delta_rule,
            RECURRENT_RULE: module.torch_recurrent_gated_delta_rule,
        }
    return {op: inspect.unwrap(hub_wrapped(getattr(owner, name))) for op, (owner, name) in entry_points(layer).items()}


@torch.no_grad()
def torch_reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits with transformers' own torch functions (undecorated) where the layers look their kernels up.

    Call it on an unpatched model (after `fastpath.disable`): the lookups are put back as they were.
    """
    saved = []
    try:
        for _, layer in linear_attention_layers(model):
            module = sys.modules[type(layer).__module__]
            for op, fn in _torch_functions(layer, module).items():
                owner, name = entry_points(layer)[op]
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, fn)
        return model(ids).logits
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def crashes_unpatched_on_cpu(model) -> bool:
    """Whether an unpatched forward of `model` crashes on a CPU: transformers bound fla's chunk rule at import and
    does not check devices itself (5.15-5.24; 5.15 and 5.16 only when `fla.ops` was imported before them)."""
    _, layer = linear_attention_layers(model)[0]
    owner, name = entry_points(layer)[CHUNK_RULE]
    return describe(getattr(owner, name))[0] == FLA and not transformers_checks_devices()
