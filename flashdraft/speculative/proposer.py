"""What proposes a round's drafts: the `Proposer` protocol the decoding loop (`flashdraft.speculative.generate`)
verifies against, and `DFlashProposer`, a drafter of any family drafting a block in one pass or several.

    proposer = DFlashProposer(drafter, target, block_size=16)
    proposer.observe(features)                       # context features of the tokens the target has seen
    drafts, probs = proposer.propose(tokens, 15)     # probs: the distributions sampled drafts were drawn from
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch
from transformers import DynamicCache

from flashdraft.speculative import rollback
from flashdraft.speculative.sampling import sample, sampling_probs


class Proposer(Protocol):
    """Proposes draft tokens; the decoding loop verifies them."""

    # Target layers whose hidden states the proposer consumes (`observe`); None: it needs none.
    feature_layers: list[int] | None

    def observe(self, features: torch.Tensor) -> None:
        """Context features `(1, t, n * D)` of the next t tokens that went through the target."""

    def propose(self, tokens: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to `num_drafts` tokens to follow `tokens` (1-D, all tokens so far) and the distributions they were
        drawn from (`(k, V)`), or None if proposed deterministically."""


class DFlashProposer:
    """Drafts a block with a DFlash drafter, keeping the drafter's own cache of context keys and values.

    refine: draft the block in several passes. Each entry is how many drafts are fixed after a pass (ascending):
    (3,) keeps the first 3 drafts of the first pass, writes them into the block in place of their MASKs and drafts
    the rest again, now conditioned on them; (1, 3, 7) takes four passes. A drafter learns to use such tokens from
    `recipe.reveal`. Each pass is one more drafter forward over the block only (the context is cached).

    A drafter of any family (`flashdraft.drafter.families`): a DSpark drafter's anchor slot drafts too, and its
    Markov head chains the drafts of a pass left to right, each drawn from q given the drafts before it; a DFlash2
    drafter's selector walks its candidates the same way, q then supported on each position's candidates alone. The
    returned distributions are those q, which is what verification must check against to stay exact.

    With a confidence head (DSpark's), `propose` also leaves `confidence`: c_k = sigmoid(`confidence_logits`) of each
    draft given the token before it (the anchor, then the drafts), which the loop only reports.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        target: torch.nn.Module,
        block_size: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        refine: tuple[int, ...] = (),
    ):
        self.drafter, self.block_size = drafter, block_size
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.sampling = (temperature, top_p, top_k)
        self.generator = generator
        self.refine = validate_refine(refine, block_size)
        self.feature_layers = list(drafter.target_layer_ids)
        self.mask_token_id = int(drafter.mask_token_id)
        self.start = 1 - drafter.draft_offset  # the block slot of the first draft
        self.dtype = next(drafter.parameters()).dtype
        # Context K/V are per-position projections of features, so a cache of them is exact; only the block's
        # K/V (appended by each draft) are cropped away again.
        self.cache = DynamicCache()
        self.cached = 0
        self.new_features: list[torch.Tensor] = []
        self.predicts_acceptance = getattr(drafter, "confidence_head", None) is not None
        self.confidence: torch.Tensor | None = None  # (k,) of the last proposal, with a confidence head

    def observe(self, features: torch.Tensor) -> None:
        self.new_features.append(features.to(self.dtype))

    def propose(self, tokens: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        context = torch.cat(self.new_features, dim=1)
        self.new_features.clear()
        anchor = tokens.shape[0] - 1
        if self.cached + context.shape[1] != anchor:
            raise RuntimeError(f"drafter context covers {self.cached + context.shape[1]} tokens, expected {anchor}")
        # Always draft the full trained block, even when fewer drafts are wanted near max_new_tokens.
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=tokens.device)
        block[0, 0] = tokens[-1]
        temperature = self.sampling[0]
        drafts, probs, confidence, fixed = [], [], [], 0
        for keep in (*[k for k in self.refine if k < num_drafts], num_drafts):
            positions = torch.arange(anchor - context.shape[1], anchor + self.block_size, device=tokens.device)[None]
            hidden = self.drafter(
                position_ids=positions,
                noise_embedding=self.embed(block).to(self.dtype),
                target_hidden=context,
                past_key_values=self.cache,
                use_cache=True,
            )
            rollback.crop_kv(self.cache, anchor)
            self.cached, context = anchor, context[:, :0]  # later passes: the context is all in the cache
            # Draft d (the token d + 1 after the anchor) comes from block slot d + 1 - offset.
            slots = hidden[0, self.start + fixed : self.start + keep]
            if getattr(self.drafter, "chains", False):  # left to right, each after the token drafted before it
                pass_drafts, pass_probs = self._walk(slots, block[0, fixed])
                drafts.append(pass_drafts)
                probs += pass_probs
            elif temperature <= 0:
                drafts.append(self.drafter.compute_logits(slots, self.lm_head).argmax(dim=-1))
            else:
                probs.append(sampling_probs(self.drafter.compute_logits(slots, self.lm_head), *self.sampling))
                drafts.append(sample(probs[-1], self.generator))
            if self.predicts_acceptance:
                # Each draft after the token before it: the anchor (or the last fixed draft), then this pass's drafts.
                prev = torch.cat([block[0, fixed : fixed + 1], drafts[-1][:-1]])
                confidence.append(torch.sigmoid(self.drafter.confidence_logits(slots, prev)))
            if keep < num_drafts:
                block[0, 1 + fixed : 1 + keep] = drafts[-1]
            fixed = keep
        self.confidence = torch.cat(confidence) if confidence else None
        return torch.cat(drafts), torch.cat(probs) if probs else None

    @torch.inference_mode()
    def rehearse(self) -> None:
        """One drafting pass over a stand-in context of one token, the proposer's state untouched: what a round's
        drafting costs, for `verify_length.RoundCost.measure` (a chained head's walk left out)."""
        device = self.lm_head.weight.device
        block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        context = torch.zeros(1, 1, self.drafter.fc.in_features, dtype=self.dtype, device=device)
        hidden = self.drafter(
            position_ids=torch.arange(1 + self.block_size, device=device)[None],
            noise_embedding=self.embed(block).to(self.dtype),
            target_hidden=context,
        )
        self.drafter.compute_logits(hidden[0, self.start :], self.lm_head)

    def _walk(self, slots: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The drafts of `slots` after the token `first`, chained through the drafter's Markov head or selector; when
        sampling, each drawn from q given the drafts before it, which is what verification must read."""
        probs = []

        def pick(k: int, logits: torch.Tensor) -> torch.Tensor:
            if self.sampling[0] <= 0:
                return logits.argmax()
            probs.append(sampling_probs(logits, *self.sampling)[None])
            return sample(probs[-1], self.generator)[0]

        drafts, _ = self.drafter.walk(slots, self.lm_head, first, pick)
        return drafts, probs


def validate_refine(refine, block_size: int) -> tuple[int, ...]:
    """`DFlashProposer`'s refine schedule, checked: ascending counts of fixed drafts in 1 … block_size − 2."""
    refine = tuple(int(k) for k in refine)
    if any(b <= a for a, b in itertools.pairwise(refine)) or any(not 1 <= k <= block_size - 2 for k in refine):
        raise ValueError(
            f"refine {list(refine)}: counts of drafts fixed after each pass must ascend within 1 … {block_size - 2}"
        )
    return refine
