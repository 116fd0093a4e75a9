"""One micro-batch through the frozen target, the drafter and the loss: the forward pass that a training step runs
on every micro-batch (loop.train_step) and the held-out evaluation runs on its rows (evaluation.py).

    drafting = Drafting.of(cfg, s)                                     # the run's target, drafter and objective
    denominator = drafting.normaliser(batch)                           # Σ w (or the labelled blocks) of a step
    loss, stats = drafting.loss(micro, denominator)                    # capture, blocks, mask, drafter, loss
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashdraft.config import RunConfig
from flashdraft.devices import autocast
from flashdraft.train.blocks import before_labels
from flashdraft.train.compile import compile_enabled
from flashdraft.train.dataloader import MicroBatch
from flashdraft.train.loss import LossStats, Objective, dflash_loss
from flashdraft.train.masks import attention_kind, drafter_mask


def no_mark(phase: str) -> None:
    """The `mark` of a step nobody times."""


@dataclass(frozen=True)
class Drafting:
    """What drafting a micro-batch takes: the frozen target (features, embedding, LM head), the drafter, the
    objective, and how they run (the attention kind, whether the loss's softmax math is compiled)."""

    target: object  # FrozenTarget, HeadTarget, or anything with their `capture`, `embed` and `lm_head_weight`
    drafter: torch.nn.Module
    device: torch.device
    objective: Objective
    attention: str
    soft_labels: bool  # recipe.labels: target, the target's own distribution before each label
    compile_loss: bool
    features: object | None = None  # an offline FeatureStore: read instead of running the target

    @classmethod
    def of(cls, cfg: RunConfig, s) -> Drafting:
        """The drafting of a run's Setup `s`. The loss's softmax math is compiled with the drafter: a run too short
        for one compile pays for neither."""
        return cls(
            s.target,
            s.drafter,
            s.device,
            Objective.from_recipe(cfg.recipe),
            attention_kind(cfg.train.attention, s.device),
            cfg.recipe.labels == "target",
            compile_enabled(cfg.train.compile, s.device),
            s.features,
        )

    def eager(self, target, drafter: torch.nn.Module) -> Drafting:
        """The same with another target and drafter, run eagerly (SDPA with a dense mask, the loss not compiled),
        no feature store: what an evaluation runs, its shapes unlike any step's."""
        return replace(self, target=target, drafter=drafter, attention="sdpa", compile_loss=False, features=None)

    def normaliser(self, batch: list[MicroBatch]) -> torch.Tensor:
        """This rank's share of the loss's denominator over `batch` (sum it over the ranks for a global step)."""
        return sum(self.objective.normaliser(m.blocks.labels, m.blocks.weights, m.blocks.block_size) for m in batch)

    def loss(self, micro: MicroBatch, denominator: torch.Tensor, mark=no_mark) -> tuple[torch.Tensor, LossStats]:
        """(loss, stats) of one micro-batch, its loss divided by `denominator`. `mark(phase)` is called as each
        phase has been queued: "target", "drafter_fwd", "loss"."""
        blocks, teacher_hidden = micro.blocks, None
        if self.soft_labels:
            features, final = self.target.capture(micro.input_ids, micro.attention_mask, final=True)
            teacher_hidden = before_labels(final, blocks)
        elif self.features is not None:
            features = self.features.batch(micro.indices, micro.input_ids.shape[1])
        else:
            features = self.target.capture(micro.input_ids, micro.attention_mask)
        # Static shapes: the drafter sees data.max_length positions in every micro-batch (the target still runs on
        # the real width; its features are padded after).
        features = micro.pad(features)
        mark("target")
        with autocast(self.device):
            hidden = self.drafter(
                position_ids=blocks.position_ids,
                attention_mask=drafter_mask(blocks, self.drafter.config, self.attention),
                noise_embedding=self.target.embed(blocks.block_ids),
                target_hidden=features,
            )
        mark("drafter_fwd")
        loss, stats = dflash_loss(
            hidden,
            self.target.lm_head_weight,
            blocks.labels,
            blocks.weights,
            block_size=blocks.block_size,
            denominator=denominator,
            objective=self.objective,
            teacher_hidden=teacher_hidden,
            compile_chunks=self.compile_loss,
        )
        mark("loss")
        return loss, stats
