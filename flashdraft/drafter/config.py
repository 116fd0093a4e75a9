"""The drafter's configuration: a transformers `Qwen3Config` carrying the DFlash fields.

A DFlash drafter is a stack of plain Qwen3 decoder layers whatever the target, so its config *is* a `Qwen3Config`
(`model_type: "qwen3"`), plus the fields the reference `dflash` package, SGLang and vLLM read:

- `block_size` (top level): tokens drafted per forward, the anchor included;
- `num_target_layers`: number of layers of the target the drafter was trained against;
- `dflash_config: {mask_token_id, target_layer_ids}`: the token that fills the block after the anchor, and the
  target layers whose hidden states form the context features (layer i is `output_hidden_states[i + 1]`);
- `layer_types` / `sliding_window` (standard Qwen3 fields): `"sliding_attention"` layers are causal within
  `sliding_window`, `"full_attention"` layers see the whole context and the whole block.

Reading follows the reference: a DFlash field is looked up in `dflash_config` first, then at the top level.
Drafter families (DSpark) keep their own fields beside these (`families.py`).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig, Qwen3Config

from flashdraft.drafter.families import (
    BLOCK_SIZE_IN_DFLASH_CONFIG,
    FAMILIES,
    FAMILY_LAYER_DEFAULTS,
    family_config_fields,
    validate_family,
)

ARCHITECTURE = FAMILIES["dflash"].architecture
# The reference `dflash` package's class: what `AutoModel` resolves for a DFlash drafter (no other family has one).
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
LAYER_TYPES = ("full_attention", "sliding_attention")

# rope_parameters keys that describe how the *target* applies RoPE and must not reach the drafter: its layers
# rotate the whole head (no partial rotary) over 1-D positions (no multimodal sections).
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def draft_value(config: PreTrainedConfig, name: str, default: Any = None) -> Any:
    """A DFlash field of `config`: `dflash_config[name]` if present, else the attribute `name`, else `default`."""
    dflash = getattr(config, "dflash_config", None) or {}
    if name in dflash:
        return dflash[name]
    return getattr(config, name, default)


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Default target layers to read features from: evenly spread between layer 1 and layer L-3.

    `round(1 + i * (L - 4) / (n - 1))` for i in 0..n-1 (27B, L=64, n=5: [1, 16, 31, 46, 61]); a single feature
    layer is the middle one, L // 2. Python's round (half to even) is what the reference uses.
    """
    if num_features < 1:
        raise ValueError(f"the number of target feature layers must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


def target_text_config(target_config: PreTrainedConfig) -> PreTrainedConfig:
    """The text (decoder) config of a target; multimodal configs such as Qwen3.5's hold it in `text_config`."""
    if getattr(target_config, "text_config", None) is not None:
        return target_config.get_text_config(decoder=True)
    return target_config


def _drafter_rope(text: PreTrainedConfig) -> dict:
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(text, "rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    for key in _TARGET_ONLY_ROPE_KEYS:
        rope.pop(key, None)
    return rope


def draft_config_from_target(
    target_config: PreTrainedConfig,
    *,
    num_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
    family: str = "dflash",
    family_fields: dict[str, Any] | None = None,
    **overrides: Any,
) -> Qwen3Config:
    """A validated drafter config of `family` (its fields: `family_fields` over the family's defaults) sized from
    the target's text config.

    Sizes (hidden, heads, kv heads, head_dim, intermediate, rms eps, rope theta, vocab, max positions) come from
    the target; `overrides` replaces any `Qwen3Config` field. For hybrid targets the head sizes are those of the
    target's full-attention layers. The drafter never inherits the target's partial rotary, multimodal RoPE or
    attention output gate: reference drafters are plain Qwen3 layers. Targets without a dense MLP size (MoE-only
    such as Qwen3.5-MoE) get `intermediate_size = 3 * hidden_size` unless overridden.
    """
    text = target_text_config(target_config)
    num_target_layers = int(text.num_hidden_layers)
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(num_target_layers, num_layers)
    hidden_size = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    fields: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden_size // heads),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 3 * hidden_size),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_parameters=_drafter_rope(text),
        vocab_size=int(text.vocab_size),
        max_position_embeddings=int(text.max_position_embeddings),
        initializer_range=float(getattr(text, "initializer_range", 0.02)),
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
    )
    _check_override_names(overrides)
    fields.update(_family_layer_defaults(family, num_layers, overrides))
    fields.update(overrides)
    fields["num_hidden_layers"] = num_layers
    layer_types = fields.get("layer_types")
    if fields.get("sliding_window") is not None:
        if layer_types is None or "sliding_attention" not in layer_types:
            raise ValueError(
                f"sliding_window={fields['sliding_window']} is set but no layer uses it: pass layer_types with "
                f"'sliding_attention' entries (one per drafter layer, {num_layers} in all)"
            )
        # Qwen3Config drops sliding_window unless use_sliding_window is set.
        fields["use_sliding_window"] = True
    elif layer_types is None:
        fields["layer_types"] = ["full_attention"] * num_layers
    extra = family_config_fields(family, family_fields)
    # The published DFlash2 layout keeps block_size in dflash_config only; the others at the top level.
    where = "dflash_config" if family in BLOCK_SIZE_IN_DFLASH_CONFIG else "top"
    block = {"block_size": block_size}
    try:
        config = Qwen3Config(
            **fields,
            **(block if where == "top" else {}),
            num_target_layers=num_target_layers,
            dflash_config={
                **(block if where != "top" else {}),
                "mask_token_id": mask_token_id,
                "target_layer_ids": list(target_layer_ids),
                **extra,
            },
            architectures=[FAMILIES[family].architecture],
            **({"auto_map": dict(AUTO_MAP)} if family == "dflash" else {}),
        )
    except StrictDataclassError as err:  # transformers' own field checks; re-raised as the ValueError callers catch
        raise ValueError(f"invalid drafter config: {err.__cause__ or err}") from err
    validate_draft_config(config)
    return config


def _family_layer_defaults(family: str, num_layers: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The family's layer fields (`FAMILY_LAYER_DEFAULTS`) that `overrides` leave open: a window comes with sliding
    layers, unless the caller chose the layers or the window."""
    defaults = dict(FAMILY_LAYER_DEFAULTS.get(family, {}))
    if "sliding_window" in defaults:
        window = defaults.pop("sliding_window")
        if "layer_types" not in overrides and "sliding_window" not in overrides:
            defaults.update(layer_types=["sliding_attention"] * num_layers, sliding_window=window)
    return {k: v for k, v in defaults.items() if k not in overrides}


# Read by the drafter (model.py) though Qwen3Config does not declare them, and legacy RoPE keys Qwen3Config converts.
_EXTRA_OVERRIDES = ("is_causal", "output_multiplier", "final_logit_softcapping", "rope_theta", "rope_scaling")


def _check_override_names(overrides: dict[str, Any]) -> None:
    """Qwen3Config stores any keyword silently, so a misspelt override would be ignored: refuse it instead."""
    import difflib

    known = set(Qwen3Config().to_dict()) | set(_EXTRA_OVERRIDES)
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else "see transformers.Qwen3Config for the fields"
            raise ValueError(f"drafter.overrides.{name}: not a Qwen3Config field of the drafter ({hint})")


def validate_draft_config(config: PreTrainedConfig) -> None:
    """Raise a ValueError naming the field and the fix when `config` cannot describe a working drafter."""
    block_size = draft_value(config, "block_size")
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"block_size must be an integer >= 2 (the anchor plus at least one drafted token), got {block_size!r}"
        )
    num_target_layers = draft_value(config, "num_target_layers")
    if not isinstance(num_target_layers, int) or num_target_layers < 1:
        raise ValueError(f"num_target_layers must be a positive integer, got {num_target_layers!r}")
    ids = draft_value(config, "target_layer_ids")
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"dflash_config.target_layer_ids must be a non-empty list of integers, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"dflash_config.target_layer_ids {list(ids)} has {bad} outside [0, {num_target_layers}) "
            f"(num_target_layers={num_target_layers})"
        )
    if any(a >= b for a, b in pairwise(ids)):
        raise ValueError(
            f"dflash_config.target_layer_ids must be unique and sorted ascending, got {list(ids)}; "
            "with few target layers pass target_layer_ids explicitly (or use fewer drafter layers)"
        )
    vocab_size = config.vocab_size
    mask_token_id = draft_value(config, "mask_token_id")
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"dflash_config.mask_token_id must be a token id in [0, vocab_size={vocab_size}), got {mask_token_id!r}"
        )
    layer_types = list(config.layer_types or [])
    if len(layer_types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(
            f"layer_types must list one of {LAYER_TYPES} per drafter layer "
            f"(num_hidden_layers={config.num_hidden_layers}), got {layer_types}"
        )
    validate_family(config)
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
