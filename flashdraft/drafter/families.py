"""The drafter families: one DFlash backbone, and what each family adds on top of it.

| family | architecture written (also read) | adds to the backbone | drafts from a block of B |
|---|---|---|---|
| dflash | DFlashDraftModel | nothing | B − 1: slot 0 holds the anchor, slots 1 … B − 1 draft |
| dspark | DSparkDraftModel (Qwen3DSparkModel) | a Markov head, a confidence head (`heads.py`) | B with `sample_from_anchor` (the anchor's slot drafts too, DeepSpec's convention), else B − 1 |

Every family shares the backbone's config fields (`config.py`); a family's own fields sit beside them in
`dflash_config` (flashdraft's checkpoint layout, also SpecForge's for DSpark), read like the others: `dflash_config`
first, then the top level (where DeepSpec's DSpark checkpoints keep them). `flashdraft.export` writes the layouts
the serving engines read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedConfig

from flashdraft.drafter.heads import MARKOV_KINDS, ConfidenceHead, MarkovHead


@dataclass(frozen=True)
class Family:
    name: str
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
FAMILIES = {
    "dflash": Family("dflash", "DFlashDraftModel"),
    "dspark": Family("dspark", "DSparkDraftModel", ("Qwen3DSparkModel",), DSPARK_FIELDS),
}
UNSUPPORTED = {"DFlash2DraftModel": "a DFlash2 drafter (DFlash2DraftModel), which flashdraft does not support yet"}


def family_of(config: PreTrainedConfig) -> str:
    """The family of a drafter config, from its `architectures` (a config without one is a DFlash drafter)."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in UNSUPPORTED:
            raise ValueError(UNSUPPORTED[name])
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
    if family_of(config) != "dspark":
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


def build_heads(config: PreTrainedConfig) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    """The heads of the config's family on the backbone (DSpark's), or (None, None)."""
    if family_of(config) != "dspark":
        return None, None
    rank = int(family_value(config, "markov_rank"))
    kind = family_value(config, "markov_head_type")
    markov = MarkovHead(config.vocab_size, config.hidden_size, rank, kind) if rank else None
    confidence = None
    if family_value(config, "enable_confidence_head"):
        with_markov = bool(family_value(config, "confidence_head_with_markov"))
        confidence = ConfidenceHead(config.hidden_size, rank if with_markov else 0)
    return markov, confidence


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
    config["dflash_config"] = {**backbone, **wanted}
    config.pop("auto_map", None)
    converted = type(drafter)(type(drafter.config).from_dict(config))
    result = converted.load_state_dict(drafter.state_dict(), strict=False)
    backbone_missing = [k for k in result.missing_keys if not k.startswith(("markov_head.", "confidence_head."))]
    if backbone_missing:
        raise ValueError(f"{where}: its backbone lacks {backbone_missing[:4]}")
    return converted.to(next(drafter.parameters()).dtype)


__all__ = [
    "DSPARK_FIELDS",
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
