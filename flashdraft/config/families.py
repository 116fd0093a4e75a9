"""The config sections of the drafter families besides DFlash: `drafter.dspark` (its heads) and `recipe.dspark`
(its loss), read only when `drafter.family` names that family. What each family is: flashdraft/drafter/families.py.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILY_CHOICES: dict[str, tuple[str, ...]] = {
    "drafter.family": ("dflash", "dspark"),
    "drafter.dspark.markov_head_type": ("vanilla", "gated", "rnn"),
}


@dataclass(kw_only=True)
class DSparkHeads:
    """DSpark's heads on the DFlash backbone (DSpark, arXiv 2607.05147; the names are its checkpoints')."""

    markov_rank: int = 256
    """Rank r of the Markov head's logit bias W2·W1[previous token] (W1: vocabulary x r, W2: r x vocabulary);
    0: no Markov head (the drafts stay independent, as DFlash's)."""
    markov_head_type: str = "vanilla"
    """vanilla (the bias of the previous token alone; what vLLM and SGLang serve) | gated (gated by the position's
    hidden state) | rnn (a small recurrent state over the block)."""
    enable_confidence_head: bool = True
    """A confidence head predicting each draft's acceptance (reported by flashdraft eval; a serving engine can cut
    the verified block where it drops)."""
    confidence_head_with_markov: bool = True
    """The confidence head reads the Markov head's embedding of the previous token beside the hidden state."""
    sample_from_anchor: bool = True
    """The anchor's own block slot drafts too (DeepSpec's convention: a block of B gives B drafts); false: DFlash's
    slots (B − 1 drafts), e.g. to keep a DFlash backbone's slots when starting from one (drafter.init_from)."""


@dataclass(kw_only=True)
class DSparkLoss:
    """The weights of DSpark's loss terms (the reference's defaults): ce·CE(label) + distance·‖q − p‖₁ +
    confidence·BCE(c, acceptance), q the drafter's Markov-corrected distribution, p the target's there."""

    ce: float = 0.1
    """Cross-entropy of the data's token."""
    distance: float = 0.9
    """L1 distance between the drafter's and the target's next-token distributions (twice the total variation:
    1 − acceptance probability, doubled)."""
    confidence: float = 1.0
    """Binary cross-entropy of the confidence head against each position's acceptance probability."""


def family_checks(cfg) -> list[tuple[str, bool, str]]:
    """(dotted field, ok, why) of the family sections' values that a type cannot express."""
    heads, loss = cfg.drafter.dspark, cfg.recipe.dspark
    dspark = cfg.drafter.family == "dspark"
    words = {"drafter.family": cfg.drafter.family, "drafter.dspark.markov_head_type": heads.markov_head_type}
    return [
        *(
            (name, value in FAMILY_CHOICES[name], f"must be {', '.join(FAMILY_CHOICES[name])}")
            for name, value in words.items()
        ),
        ("drafter.dspark.markov_rank", heads.markov_rank >= 0, "must be >= 0 (0: no Markov head)"),
        (
            "drafter.dspark.confidence_head_with_markov",
            not (heads.enable_confidence_head and heads.confidence_head_with_markov and heads.markov_rank == 0),
            "needs the Markov head's embedding: set drafter.dspark.markov_rank > 0 or this to false",
        ),
        ("recipe.dspark.ce", loss.ce >= 0, "must be >= 0"),
        ("recipe.dspark.distance", loss.distance >= 0, "must be >= 0"),
        ("recipe.dspark.confidence", loss.confidence >= 0, "must be >= 0"),
        ("recipe.dspark.ce", loss.ce + loss.distance > 0, "and recipe.dspark.distance cannot both be 0"),
        (
            "recipe.labels",
            not (dspark and cfg.recipe.labels == "target"),
            "is DFlash's option: DSpark always learns the target's distribution (recipe.dspark.distance)",
        ),
        ("recipe.loss", not (dspark and cfg.recipe.loss == "lk"), "must be ce with drafter.family = dspark"),
        (
            "recipe.reveal",
            not (dspark and cfg.recipe.reveal > 0),
            "must be 0 with drafter.family = dspark (its Markov head chains the drafts of one pass)",
        ),
    ]


__all__ = ["FAMILY_CHOICES", "DSparkHeads", "DSparkLoss", "family_checks"]
