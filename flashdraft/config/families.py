"""The config sections of the drafter families besides DFlash: `drafter.dspark` (its heads) and `recipe.dspark`
(its loss), `drafter.dflash2` (its convolutions and selector) and `recipe.dflash2` (its loss), read only when
`drafter.family` names that family. What each family is: flashdraft/drafter/families.py.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILY_CHOICES: dict[str, tuple[str, ...]] = {
    "drafter.family": ("dflash", "dspark", "dflash2"),
    "drafter.dspark.markov_head_type": ("vanilla", "gated", "rnn"),
    "recipe.dflash2.absent": ("drop", "inject"),
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


@dataclass(kw_only=True)
class DFlash2Parts:
    """DFlash2's parts on the DFlash backbone (z-lab's DFlash2; the defaults are its published drafters')."""

    conv_kernel_size: int = 2
    """Taps of the dynamic convolution around each sublayer: position t reads t, t − 1, … of its own block."""
    conv_group_size: int = 16
    """Channels sharing one dynamic kernel coefficient (must divide the hidden size)."""
    selector_rank: int = 256
    """Rank r of the selector's pair score ⟨A[previous] ⊙ W_h h, B[candidate]⟩ (A, B: vocabulary x r)."""
    selector_top_k: int = 16
    """Candidates per position: the backbone's top-k tokens, among which the selector walks the drafted path."""


@dataclass(kw_only=True)
class DFlash2Loss:
    """DFlash2's loss, a reconstruction (z-lab has not published its trainer): base·(the DFlash loss of the backbone's
    logits, recipe.loss and its weighting) + selector·(cross-entropy over the top-k candidates of the selector's
    scores given the true previous token, with the same position weights)."""

    base: float = 1.0
    """Weight of the backbone's own loss (the DFlash loss over the whole vocabulary)."""
    selector: float = 1.0
    """Weight of the selector's cross-entropy over the candidates (NeMo's and speculators' default: 1)."""
    absent: str = "drop"
    """A label outside the backbone's top-k: drop (the position adds no selector loss, NeMo's) | inject (it replaces
    the last candidate and is learned there, speculators')."""


def family_checks(cfg) -> list[tuple[str, bool, str]]:
    """(dotted field, ok, why) of the family sections' values that a type cannot express."""
    heads, loss = cfg.drafter.dspark, cfg.recipe.dspark
    dspark = cfg.drafter.family == "dspark"
    words = {
        "drafter.family": cfg.drafter.family,
        "drafter.dspark.markov_head_type": heads.markov_head_type,
        "recipe.dflash2.absent": cfg.recipe.dflash2.absent,
    }
    return [
        *(
            (name, value in FAMILY_CHOICES[name], f"must be {', '.join(FAMILY_CHOICES[name])}")
            for name, value in words.items()
        ),
        ("drafter.dspark.markov_rank", heads.markov_rank >= 0, "must be >= 0 (0: no Markov head)"),
        (
            "drafter.freeze_backbone",
            not cfg.drafter.freeze_backbone or bool(cfg.drafter.init_from),
            "needs drafter.init_from (a new backbone frozen would never learn)",
        ),
        (
            "drafter.freeze_backbone",
            not cfg.drafter.freeze_backbone or cfg.drafter.family != "dflash",
            "needs drafter.family dspark or dflash2 (a DFlash drafter is its backbone: nothing would train)",
        ),
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
        *dflash2_checks(cfg),
    ]


def dflash2_checks(cfg) -> list[tuple[str, bool, str]]:
    parts, loss = cfg.drafter.dflash2, cfg.recipe.dflash2
    dflash2 = cfg.drafter.family == "dflash2"
    return [
        *((f"drafter.dflash2.{name}", getattr(parts, name) >= 1, "must be >= 1") for name in vars(parts)),
        (
            "drafter.dflash2.conv_kernel_size",
            parts.conv_kernel_size <= cfg.drafter.block_size,
            f"must be <= drafter.block_size ({cfg.drafter.block_size}): a tap never reaches past its block",
        ),
        ("recipe.dflash2.base", loss.base >= 0, "must be >= 0"),
        ("recipe.dflash2.selector", loss.selector >= 0, "must be >= 0"),
        ("recipe.dflash2.base", loss.base + loss.selector > 0, "and recipe.dflash2.selector cannot both be 0"),
        (
            "recipe.reveal",
            not (dflash2 and cfg.recipe.reveal > 0),
            "must be 0 with drafter.family = dflash2 (its selector chains the drafts of one pass)",
        ),
    ]


__all__ = ["FAMILY_CHOICES", "DFlash2Loss", "DFlash2Parts", "DSparkHeads", "DSparkLoss", "family_checks"]
