"""The one loader of a target: the bundled one, a local directory or a hub id, whole or frozen for training.

    model = load_causal_lm("Qwen/Qwen3.5-27B", dtype=torch.bfloat16, device="cuda")  # the whole model, for decoding
    target = load_frozen_target(cfg.target, layer_ids=[1, 16, 31], device="cuda")    # frozen and truncated, training
    tokenizer = load_tokenizer("bundled")

Every load reads from a local directory or the hub cache (nothing is downloaded unless HF_HUB_OFFLINE=0:
flashdraft.hub), safetensors only (`check_checkpoint`), with no Hub kernels swapped in (`NO_HUB_KERNELS`), on the
device and dtype flashdraft.devices resolves, and runs the linear-attention layers on flashdraft's device-aware fast
path. A frozen target keeps only the layers up to the last captured one; the layers after it are never read.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from flashdraft import bundled, fastpath
from flashdraft.config import TargetConfig
from flashdraft.devices import resolve_device, resolve_dtype
from flashdraft.drafter.config import build_target_layer_ids, target_text_config
from flashdraft.hub import NO_HUB_KERNELS, check_checkpoint, resolve_model_dir
from flashdraft.target.capture import FrozenTarget, _truncate_config, _validate_layer_ids

logger = logging.getLogger(__name__)
Spec = str | os.PathLike


def target_directory(spec: Spec, *, trust_remote_code: bool = False, local_files_only: bool | None = None) -> Path:
    """The local directory of target `spec` — `bundled.BUNDLED`, a directory, or a hub id in the hub cache (fetched
    only when HF_HUB_OFFLINE=0 or `local_files_only=False`) — checked to hold a config.json and safetensors."""
    if str(spec) == bundled.BUNDLED:
        directory = bundled.target_dir()
    else:
        directory = resolve_model_dir(
            spec, what="target", local_files_only=local_files_only, trust_remote_code=trust_remote_code
        )
    check_checkpoint(directory)
    return directory


def load_tokenizer(spec: Spec, *, trust_remote_code: bool = False):
    """The tokenizer of target `spec` (the bundled target's own for `bundled.BUNDLED`)."""
    from transformers import AutoTokenizer

    if str(spec) == bundled.BUNDLED:
        return bundled.load_tokenizer()
    directory = target_directory(spec, trust_remote_code=trust_remote_code)
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)


def load_causal_lm(
    spec: Spec,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    strict: bool = False,
    local_files_only: bool | None = None,
):
    """The whole causal LM of `spec` (see `target_directory`) on `device` ("auto": flashdraft.devices), in `dtype`
    ("auto": bf16 on a GPU, float32 on the CPU), in eval mode, its linear-attention layers on the device-aware
    fast path and probed; with `strict`, a layer that falls back to torch raises `fastpath.FastPathError`."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    directory = target_directory(spec, trust_remote_code=trust_remote_code, local_files_only=local_files_only)
    # Its load report speaks (a missing weight is a random one); a 13 MB bundled load needs no progress bar.
    with _quiet_transformers(log=True, bars=str(spec) != bundled.BUNDLED):
        model = _from_pretrained(directory, dtype, device, trust_remote_code, attn_implementation)
    fastpath.enable(model, strict=strict)
    return model.eval()


def load_frozen_target(
    cfg: TargetConfig | Spec,
    *,
    layer_ids: Sequence[int] | None = None,
    num_features: int = 5,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = None,
    final_hidden: bool = False,
    strict: bool | None = None,
    local_files_only: bool | None = None,
) -> FrozenTarget:
    """The frozen training target of `cfg`, the config's target section (target.path, trust_remote_code,
    attn_implementation; dtype unless `dtype` is given) or a bare target.path, capturing `layer_ids` (None: `num_features` layers spread over it, the 27B's [1, 16, 31, 46,
    61] for 5). Only the layers up to the last captured one are built and read from disk; `final_hidden` keeps every
    layer and the final norm (`FrozenTarget.capture(..., final=True)`). `strict` (default: on CUDA) makes a
    linear-attention layer that falls back to torch an error. Not yet `configure`d: the caller may shard it first.
    """
    from transformers import AutoConfig

    cfg = cfg if isinstance(cfg, TargetConfig) else TargetConfig(path=os.fspath(cfg))
    device = resolve_device(device)
    dtype = resolve_dtype(cfg.dtype if dtype is None else dtype, device)
    trust = cfg.trust_remote_code
    directory = target_directory(cfg.path, trust_remote_code=trust, local_files_only=local_files_only)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust)
    text_config = target_text_config(config)
    full_config = copy.deepcopy(text_config)
    num_layers = int(text_config.num_hidden_layers)
    ids = _validate_layer_ids(
        layer_ids if layer_ids is not None else build_target_layer_ids(num_layers, num_features), num_layers
    )
    # Build only the layers up to the last captured one: the others' weights stay on disk.
    _truncate_config(text_config, num_layers if final_hidden else max(ids) + 1)
    # The checkpoint's later layers are now "unexpected keys" by design, so transformers' load report is silenced
    # and checked here instead: a missing key would be a randomly initialised weight.
    with _quiet_transformers(log=False, bars=True):
        model, info = _from_pretrained(directory, dtype, device, trust, cfg.attn_implementation, config=config)
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        raise ValueError(
            f"target {directory} does not fit its config: missing weights {missing[:8]}, "
            f"mismatched shapes {mismatched[:8]}"
        )
    skipped = len(info.get("unexpected_keys") or [])
    if skipped:
        logger.info("target %s: %d checkpoint tensors of dropped layers not loaded", cfg.path, skipped)
    target = FrozenTarget(model, ids, config=full_config, strict=strict, final_hidden=final_hidden)
    target.name_or_path = str(cfg.path)
    return target


def _from_pretrained(directory: Path, dtype, device: torch.device, trust_remote_code: bool, attention, config=None):
    """The one `from_pretrained` of a target: safetensors only, no Hub kernels, straight onto `device` when
    `accelerate` is there (transformers' device_map), else loaded then moved. With `config` (a truncated one),
    also the loading info, whose unexpected keys are the dropped layers'."""
    from transformers import AutoModelForCausalLM

    placement = {"device_map": {"": device}} if device.type != "cpu" and _has_accelerate() else {}
    extra = {"attn_implementation": attention} if attention is not None else {}
    if config is not None:
        extra.update(config=config, output_loading_info=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=dtype,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
        **placement,
        **extra,
        **NO_HUB_KERNELS,
    )
    if config is not None:
        return loaded[0].to(device), loaded[1]
    return loaded.to(device)


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


@contextlib.contextmanager
def _quiet_transformers(*, log: bool, bars: bool) -> Iterator[None]:
    """transformers' logging lowered to errors (unless `log`) and its progress bars hidden (unless `bars`) for the
    duration of a load."""
    from transformers.utils import logging as hf_logging

    level, shown = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if not log:
        hf_logging.set_verbosity_error()
    if not bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if shown:
            hf_logging.enable_progress_bar()
