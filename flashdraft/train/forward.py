"""One micro-batch through the frozen target, the drafter and the loss: the forward pass that a training step runs
on every micro-batch (loop.train_step) and the held-out evaluation runs on its rows (evaluation.py).

    drafting = Drafting.of(cfg, s)                                     # the run's target, drafter and objective
    denominator = drafting.normaliser(batch)                           # Σ w (or the labelled blocks) of a step
    loss, stats = drafting.loss(micro, denominator)                    # capture, blocks, mask, drafter, loss
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from flashdraft.config import RunConfig
from flashdraft.devices import autocast
from flashdraft.train.blocks import before_labels
from flashdraft.train.compile import compile_enabled
from flashdraft.train.dataloader import MicroBatch
from flashdraft.train.loss import LossStats, Objective, dflash_loss
from flashdraft.train.loss.dflash2 import DFlash2Weights, dflash2_loss
from flashdraft.train.loss.dspark import DSparkWeights, dspark_loss
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
    dspark: DSparkWeights | None = None  # a DSpark drafter's loss weights (None: the DFlash loss)
    dflash2: DFlash2Weights | None = None  # a DFlash2 drafter's loss weights and absent-label rule

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
            DSparkWeights(**asdict(cfg.recipe.dspark)) if cfg.drafter.family == "dspark" else None,
            DFlash2Weights(**asdict(cfg.recipe.dflash2)) if cfg.drafter.family == "dflash2" else None,
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
        # The target's own distributions (its final hidden states) for recipe.labels = target and DSpark's loss.
        final = self.soft_labels or self.dspark is not None
        if self.features is not None:
            features = self.features.batch(micro.indices, micro.input_ids.shape[1], final=final)
        else:
            features = self.target.capture(micro.input_ids, micro.attention_mask, final=final)
        if final:
            features, states = features
            teacher_hidden = before_labels(states, blocks)
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
        if self.dspark is not None:
            loss, stats = self._dspark_loss(micro, hidden, teacher_hidden, denominator)
            mark("loss")
            return loss, stats
        common = dict(
            block_size=blocks.block_size,
            denominator=denominator,
            objective=self.objective,
            teacher_hidden=teacher_hidden,
            compile_chunks=self.compile_loss,
        )
        head, labels, weights = self.target.lm_head_weight, blocks.labels, blocks.weights
        if self.dflash2 is not None:  # the selector reads the true token before each drafted one
            prev = before_labels(micro.input_ids, blocks)
            selector = self.drafter.candidate_selector
            loss, stats = dflash2_loss(
                hidden, head, labels, weights, prev, selector, loss_weights=self.dflash2, offset=blocks.offset, **common
            )
        else:
            loss, stats = dflash_loss(hidden, head, labels, weights, **common)
        mark("loss")
        return loss, stats

    def _dspark_loss(self, micro: MicroBatch, hidden, teacher_hidden, denominator) -> tuple[torch.Tensor, LossStats]:
        """DSpark's loss (train/loss/dspark.py): its heads read the true token before each drafted one."""
        blocks, drafter = micro.blocks, self.drafter
        prev = before_labels(micro.input_ids, blocks)  # (B, Q): the anchor, then the labels, block by block
        shape = (hidden.shape[0], -1, blocks.block_size)
        markov = confidence = w2 = None
        with autocast(self.device):
            if drafter.markov_head is not None:
                # The chain starts at a block's first drafting slot, as drafting walks it: with offset 0 the anchor
                # slot drafts nothing and must not feed the rnn's state.
                start = 1 - blocks.offset
                blocked = drafter.markov_head.block_features(
                    prev.view(shape)[..., start:], hidden.view(*shape, hidden.shape[-1])[..., start:, :]
                )
                blocked = F.pad(blocked, (0, 0, start, 0))
                markov, w2 = blocked.flatten(1, 2), drafter.markov_head.markov_w2.weight
            if drafter.confidence_head is not None:
                confidence = drafter.confidence_logits(hidden, prev)
        return dspark_loss(
            hidden,
            self.target.lm_head_weight,
            teacher_hidden,
            blocks.labels,
            blocks.weights,
            block_size=blocks.block_size,
            markov=markov,
            markov_w2=w2,
            confidence_logits=confidence,
            loss_weights=self.dspark,
            objective=self.objective,
            offset=blocks.offset,
            denominator=denominator,
            compile_chunks=self.compile_loss,
        )
