"""The drafter families: one DFlash backbone, and what each family adds on top of it.

| family | architecture written (also read) | adds to the backbone | drafts from a block of B |
|---|---|---|---|
| dflash | DFlashDraftModel | nothing | B − 1: slot 0 holds the anchor, slots 1 … B − 1 draft |
| dspark | DSparkDraftModel (Qwen3DSparkModel) | a Markov head, a confidence head (`heads.py`) | B with `sample_from_anchor` (the anchor's slot drafts too, DeepSpec's convention), else B − 1 |
| dflash2 | DFlash2DraftModel | a dynamic convolution around each sublayer (`conv.py`), a candidate selector (`selector.py`) | B − 1 |

Every family shares the backbone's config fields (`config.py`); a family's own fields sit beside them in
`dflash_config` (flashdraft's checkpoint layout, also SpecForge's for DSpark), read like the others: `dflash_config`
first, then the top level (where DeepSpec's DSpark checkpoints keep them). `flashdraft.export` writes the layouts
the serving engines read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedConfig

from flashdraft.drafter.conv import GroupedDynamicConv
from flashdraft.drafter.heads import MARKOV_KINDS, ConfidenceHead, MarkovHead
from flashdraft.drafter.selector import CandidateSelector


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    """How reports name it."""
    architecture: str
    """The `architectures` entry flashdraft writes."""
    also_reads: tuple[str, ...] = ()
    """Other `architectures` entries of checkpoints of this family (other trainers' layouts)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The family's own config fields and their defaults."""


DSPARK_FIELDS = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "sample_from_anchor": True,
}
# The published DFlash2 checkpoints' values.
DFLASH2_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
FAMILIES = {
    "dflash": Family("dflash", "DFlash", "DFlashDraftModel"),
    "dspark": Family("dspark", "DSpark", "DSparkDraftModel", ("Qwen3DSparkModel",), DSPARK_FIELDS),
    "dflash2": Family("dflash2", "DFlash2", "DFlash2DraftModel", (), DFLASH2_FIELDS),
}
# Qwen3 fields a new drafter of the family gets unless the caller sets them: the published DFlash2 drafters' layers
# are all sliding (window 2048) and see their whole block both ways (a sliding layer is causal without `is_causal`).
FAMILY_LAYER_DEFAULTS = {"dflash2": {"sliding_window": 2048, "is_causal": False}}
# Families whose checkpoints keep block_size in dflash_config alone (the published DFlash2 configs have none at the
# top level).
BLOCK_SIZE_IN_DFLASH_CONFIG = ("dflash2",)
# Parameter names (prefixes, or a layer's own modules) that a family adds to the backbone.
_FAMILY_PARAMETERS = ("markov_head.", "confidence_head.", "candidate_selector.", ".attention_conv.", ".mlp_conv.")


def family_of(config: PreTrainedConfig) -> str:
    """The family of a drafter config, from its `architectures` (a config without one is a DFlash drafter)."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        for family in FAMILIES.values():
            if name == family.architecture or name in family.also_reads:
                return family.name
    return "dflash"


def family_value(config: PreTrainedConfig, name: str) -> Any:
    """A family field of `config` (`dflash_config` first, then the top level), else the family's default."""
    family = FAMILIES[family_of(config)]
    dflash = getattr(config, "dflash_config", None) or {}
    if name in dflash:
        return dflash[name]
    return getattr(config, name, family.fields.get(name))


def draft_offset(config: PreTrainedConfig) -> int:
    """1 when the anchor's own slot drafts (slot k drafts the token at p + k + 1), 0 for DFlash's slots."""
    return int(family_of(config) == "dspark" and bool(family_value(config, "sample_from_anchor")))


def family_config_fields(family: str, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `dflash_config` entries of a new drafter of `family`: its fields' defaults updated by `values`."""
    if family not in FAMILIES:
        raise ValueError(f"drafter family {family!r}: must be one of {', '.join(FAMILIES)}")
    fields = dict(FAMILIES[family].fields)
    unknown = sorted(set(values or {}) - set(fields))
    if unknown:
        raise ValueError(f"drafter family {family} has no field {', '.join(unknown)} (its fields: {sorted(fields)})")
    fields.update(values or {})
    return fields


def validate_family(config: PreTrainedConfig) -> None:
    """Raise a ValueError naming the field when a family field cannot describe a working drafter."""
    family = family_of(config)
    if family == "dflash2":
        _validate_dflash2(config)
    if family != "dspark":
        return
    rank = family_value(config, "markov_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"markov_rank must be an integer >= 0 (0: no Markov head), got {rank!r}")
    kind = family_value(config, "markov_head_type")
    if rank and kind not in MARKOV_KINDS:
        raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_KINDS)}, got {kind!r}")
    for name in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        if not isinstance(family_value(config, name), bool):
            raise ValueError(f"{name} must be true or false, got {family_value(config, name)!r}")
    if family_value(config, "enable_confidence_head") and family_value(config, "confidence_head_with_markov"):
        if not rank:
            raise ValueError(
                "confidence_head_with_markov needs the Markov head's embedding: set markov_rank > 0, or "
                "confidence_head_with_markov false"
            )


def _validate_dflash2(config: PreTrainedConfig) -> None:
    for name in DFLASH2_FIELDS:
        value = family_value(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dflash_config.{name} must be an integer >= 1, got {value!r}")
    group, taps = family_value(config, "conv_group_size"), family_value(config, "conv_kernel_size")
    if config.hidden_size % group:
        raise ValueError(f"dflash_config.conv_group_size {group} must divide hidden_size {config.hidden_size}")
    if taps > family_value(config, "block_size"):
        raise ValueError(
            f"dflash_config.conv_kernel_size {taps} must be <= block_size {family_value(config, 'block_size')} "
            "(a tap never reaches past its block)"
        )
    if family_value(config, "selector_top_k") > config.vocab_size:
        raise ValueError(
            f"dflash_config.selector_top_k {family_value(config, 'selector_top_k')} must be <= vocab_size "
            f"{config.vocab_size}"
        )


def build_convs(config: PreTrainedConfig) -> tuple[GroupedDynamicConv | None, GroupedDynamicConv | None]:
    """A drafter layer's convolutions around its attention and its MLP (DFlash2's), or (None, None)."""
    if family_of(config) != "dflash2":
        return None, None
    sizes = (
        config.hidden_size,
        int(family_value(config, "conv_kernel_size")),
        int(family_value(config, "conv_group_size")),
        int(family_value(config, "block_size")),
    )
    return GroupedDynamicConv(*sizes), GroupedDynamicConv(*sizes)


def build_heads(
    config: PreTrainedConfig,
) -> tuple[MarkovHead | None, ConfidenceHead | None, CandidateSelector | None]:
    """The heads of the config's family on the backbone: DSpark's Markov and confidence heads, DFlash2's selector."""
    if family_of(config) == "dflash2":
        rank, top_k = int(family_value(config, "selector_rank")), int(family_value(config, "selector_top_k"))
        std = float(getattr(config, "initializer_range", 0.02) or 0.02)
        return None, None, CandidateSelector(config.vocab_size, config.hidden_size, rank, top_k, std)
    if family_of(config) != "dspark":
        return None, None, None
    rank = int(family_value(config, "markov_rank"))
    kind = family_value(config, "markov_head_type")
    markov = MarkovHead(config.vocab_size, config.hidden_size, rank, kind) if rank else None
    confidence = None
    if family_value(config, "enable_confidence_head"):
        with_markov = bool(family_value(config, "confidence_head_with_markov"))
        confidence = ConfidenceHead(config.hidden_size, rank if with_markov else 0)
    return markov, confidence, None


def is_family_parameter(name: str) -> bool:
    """Whether a parameter belongs to what a family adds to the backbone (its heads, DFlash2's convolutions)."""
    return any(name.startswith(p) if not p.startswith(".") else p in name for p in _FAMILY_PARAMETERS)


def with_family(drafter, family: str, fields: dict[str, Any] | None, where: str = "the drafter"):
    """`drafter` as a drafter of `family` with `fields`: itself when it is one already (a ValueError names a field
    that differs); else a new drafter of that family holding its backbone, the heads of the new family freshly
    initialised (the old family's heads dropped)."""
    wanted = family_config_fields(family, fields)
    if drafter.family == family:
        differ = [
            f"{k} {family_value(drafter.config, k)!r} (asked: {v!r})"
            for k, v in wanted.items()
            if family_value(drafter.config, k) != v
        ]
        if differ:
            raise ValueError(f"{where} is a {family} drafter with other fields: {'; '.join(differ)}")
        return drafter
    config = drafter.config.to_dict()
    config["architectures"] = [FAMILIES[family].architecture]
    backbone = {k: v for k, v in config["dflash_config"].items() if k in ("mask_token_id", "target_layer_ids")}
    block = {"block_size": family_value(drafter.config, "block_size")}
    config.pop("block_size", None)
    if family in BLOCK_SIZE_IN_DFLASH_CONFIG:
        backbone.update(block)
    else:
        config.update(block)
    config["dflash_config"] = {**backbone, **wanted}
    config.pop("auto_map", None)
    converted = type(drafter)(type(drafter.config).from_dict(config))
    result = converted.load_state_dict(drafter.state_dict(), strict=False)
    backbone_missing = [k for k in result.missing_keys if not is_family_parameter(k)]
    if backbone_missing:
        raise ValueError(f"{where}: its backbone lacks {backbone_missing[:4]}")
    return converted.to(next(drafter.parameters()).dtype)


__all__ = [
    "BLOCK_SIZE_IN_DFLASH_CONFIG",
    "DFLASH2_FIELDS",
    "DSPARK_FIELDS",
    "FAMILY_LAYER_DEFAULTS",
    "build_convs",
    "is_family_parameter",
    "with_family",
    "build_heads",
    "FAMILIES",
    "Family",
    "draft_offset",
    "family_config_fields",
    "family_of",
    "family_value",
    "validate_family",
]
