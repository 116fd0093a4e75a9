"""Baselines decoded by the same loop as DFlash (`speculative_decode`), so timings and statistics compare.

    from flashdraft.speculative.baselines import autoregressive_generate, prompt_lookup_generate
    ar = autoregressive_generate(target, input_ids, max_new_tokens=256)
    pl = prompt_lookup_generate(target, input_ids, max_new_tokens=256, block_size=16)

Autoregressive: one token per cached target forward (tau = 1). Prompt lookup (Saxena 2023, as in
transformers' `prompt_lookup_num_tokens`): the drafts continue the latest n-gram of the text at its earliest
earlier occurrence in prompt + output, and are verified like DFlash's; with sampling, a deterministic proposal
is rejection-sampled against a one-hot q, which keeps the output distribution exactly the target's.
"""

from __future__ import annotations

import torch

from flashdraft.speculative.engine.session import engine_decode
from flashdraft.speculative.generate import speculative_decode, use_engine
from flashdraft.speculative.result import GenerationResult


class PromptLookupProposer:
    """Drafts by matching the last `ngram_max` .. `ngram_min` tokens earlier in the sequence."""

    feature_layers = None

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={ngram_min}, ngram_max={ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def observe(self, features: torch.Tensor) -> None:
        pass

    def propose(self, tokens: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor | None, None]:
        length = tokens.shape[0]
        for size in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            # Windows starting at 0 .. length - size - 1: every earlier occurrence with at least one token after it.
            windows = tokens[:-1].unfold(0, size, 1)
            hits = (windows == tokens[length - size :]).all(dim=1).nonzero()
            if hits.numel():
                begin = int(hits[0, 0]) + size
                return tokens[begin : begin + num_drafts], None
        return None, None


def autoregressive_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    engine: bool | None = None,
) -> GenerationResult:
    """Plain cached decoding, one target forward per token, with the statistics fields of `generate`.

    engine: as in `generate` (by default the engine's captured decode step on a CUDA target it supports).
    """
    if use_engine(target, engine):
        return engine_decode(
            target,
            input_ids,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            generator=generator,
        )
    return speculative_decode(
        target,
        input_ids,
        None,
        max_new_tokens,
        num_drafts=0,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=stop_token_ids,
        generator=generator,
    )


def prompt_lookup_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int = 16,
    ngram_max: int = 3,
    num_draft: int | None = None,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    max_deferred: int | None = None,
    engine: bool | None = None,
) -> GenerationResult:
    """Prompt-lookup speculative decoding; `num_draft` drafts per round (default `block_size - 1`).

    engine: as in `generate`; the engine verifies blocks of `num_draft + 1` tokens.
    """
    num_draft = block_size - 1 if num_draft is None else num_draft
    if num_draft < 0:
        raise ValueError(f"num_draft must be >= 0, got {num_draft}")
    if use_engine(target, engine):
        return engine_decode(
            target,
            input_ids,
            max_new_tokens,
            lookup=PromptLookupProposer(ngram_max),
            block_size=num_draft + 1,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            generator=generator,
        )
    return speculative_decode(
        target,
        input_ids,
        PromptLookupProposer(ngram_max),
        max_new_tokens,
        num_drafts=num_draft,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=stop_token_ids,
        generator=generator,
        max_deferred=max_deferred,
    )
