"""Load a target: the bundled one, a local directory or a hub id.

    model = load_model("Qwen/Qwen3.5-27B", dtype=torch.bfloat16, device="cuda")   # the whole model, for decoding
    target = build_target(cfg.target, layer_ids=None, device=device, dtype=dtype)  # frozen, for training
    target = load_target("Qwen/Qwen3.5-27B")                      # bf16 on the GPU, fast path proven

A frozen target keeps only the layers up to the last captured one; the layers after it are never loaded.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Sequence

import torch

from flashdraft import bundled, fastpath
from flashdraft.config import TargetConfig
from flashdraft.drafter.config import build_target_layer_ids, target_text_config
from flashdraft.hub import NO_HUB_KERNELS, check_checkpoint, resolve_model_dir
from flashdraft.target.capture import FrozenTarget, _truncate_config, _validate_layer_ids

logger = logging.getLogger(__name__)


def load_model(
    spec: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
):
    """The whole causal LM of `spec` — `bundled.BUNDLED`, a local directory or a hub id (read from the cache
    unless HF_HUB_OFFLINE=0; safetensors only) — on `device`, in eval mode, its linear-attention layers on the
    device-aware fast path (unprobed for the bundled target; `fastpath.enable(model, strict=True)` proves it)."""
    if str(spec) == bundled.BUNDLED:
        return bundled.build_target(dtype=dtype, device=device).eval()
    from transformers import AutoModelForCausalLM

    directory = resolve_model_dir(spec, what="target", trust_remote_code=trust_remote_code)
    check_checkpoint(directory)
    attention = {"attn_implementation": attn_implementation} if attn_implementation is not None else {}
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code, **attention, **NO_HUB_KERNELS
    ).to(device)
    fastpath.enable(model, strict=False)
    return model.eval()


def build_target(
    cfg: TargetConfig,
    *,
    layer_ids: Sequence[int] | None,
    device: str | torch.device,
    dtype: torch.dtype,
    num_features: int = 5,
    final_hidden: bool = False,
) -> FrozenTarget:
    """The frozen target of `cfg` (`target.path`: the bundled target, a directory or a hub id), capturing
    `layer_ids` (None: `num_features` layers spread over it); `final_hidden` keeps its last layers and final norm
    (`FrozenTarget.capture(..., final=True)`). Not yet `configure`d: the caller may shard it first."""
    if cfg.path == bundled.BUNDLED:
        model = bundled.build_target(dtype=dtype, device=device)
        ids = layer_ids or build_target_layer_ids(model.config.num_hidden_layers, num_features)
        return FrozenTarget.from_model(model, ids, final_hidden=final_hidden)
    return load_target(
        cfg.path,
        target_layer_ids=layer_ids,
        num_features=num_features,
        dtype=dtype,
        device=device,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
        final_hidden=final_hidden,
    )


def load_target(
    path_or_id: str | os.PathLike,
    *,
    target_layer_ids: Sequence[int] | None = None,
    num_features: int = 5,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    local_files_only: bool | None = None,
    attn_implementation: str = "sdpa",
    strict: bool | None = None,
    final_hidden: bool = False,
) -> FrozenTarget:
    """Load a frozen target from a local directory or a hub id; safetensors only.

    Args:
        target_layer_ids: layers to capture; default `build_target_layer_ids(L, num_features)` (27B: [1,16,31,46,61]).
            Layers after the last one are never loaded.
        dtype: default bf16 on CUDA, fp32 on CPU.
        device: default "cuda" when available, else "cpu". Weights load straight onto it.
        trust_remote_code: run the checkpoint's own modeling code; off unless asked.
        local_files_only: see `resolve_local_files_only` (default: no downloads unless HF_HUB_OFFLINE=0).
        strict: raise `fastpath.FastPathError` when a linear-attention layer falls back (default: on CUDA).
        final_hidden: load every layer and keep the final norm, for `capture(..., final=True)`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    directory = resolve_model_dir(path_or_id, local_files_only=local_files_only, trust_remote_code=trust_remote_code)
    check_checkpoint(directory)

    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    text_config = target_text_config(config)
    full_config = copy.deepcopy(text_config)
    num_layers = int(text_config.num_hidden_layers)
    ids = _validate_layer_ids(
        target_layer_ids if target_layer_ids is not None else build_target_layer_ids(num_layers, num_features),
        num_layers,
    )
    # Build only the layers up to the last captured one: the others' weights stay on disk.
    _truncate_config(text_config, num_layers if final_hidden else max(ids) + 1)
    # The checkpoint's later layers are now "unexpected keys" by design, so transformers' load report is silenced
    # and checked here instead: a missing key would be a randomly initialised weight.
    # Loading straight onto the GPU needs `accelerate` (transformers' device_map); without it, load then move.
    placement = {"device_map": {"": device}} if device.type != "cpu" and _has_accelerate() else {}
    with _quiet_transformers():
        model, info = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            dtype=dtype,
            **placement,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            output_loading_info=True,
            **NO_HUB_KERNELS,
        )
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        raise ValueError(
            f"target {directory} does not fit its config: missing weights {missing[:8]}, "
            f"mismatched shapes {mismatched[:8]}"
        )
    logger.info(
        "target %s: %d checkpoint tensors of dropped layers not loaded",
        path_or_id,
        len(info.get("unexpected_keys") or []),
    )
    model.to(device)
    target = FrozenTarget(model, ids, config=full_config, strict=strict, final_hidden=final_hidden)
    target.name_or_path = str(path_or_id)
    return target


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Lower transformers' logging to errors for the duration of a load."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
