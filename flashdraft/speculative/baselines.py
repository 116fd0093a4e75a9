"""Baselines decoded by the same loop as DFlash (`speculative_decode`), so timings and statistics compare.

    from flashdraft.speculative.baselines import autoregressive_generate, mtp_generate, prompt_lookup_generate
    ar = autoregressive_generate(target, input_ids, max_new_tokens=256)
    pl = prompt_lookup_generate(target, input_ids, max_new_tokens=256, block_size=16)
    mtp = mtp_generate(target, load_mtp(target, checkpoint_dir), input_ids, max_new_tokens=256, num_drafts=3)

Autoregressive: one token per cached target forward (tau = 1). Prompt lookup (Saxena 2023, as in
transformers' `prompt_lookup_num_tokens`): the drafts continue the latest n-gram of the text at its earliest
earlier occurrence in prompt + output, and are verified like DFlash's; with sampling, a deterministic proposal
is rejection-sampled against a one-hot q, which keeps the output distribution exactly the target's. MTP: the
target's own multi-token-prediction layer (`flashdraft.target.mtp`) drafts a chain of tokens, as SGLang's NEXTN
and vLLM's `mtp` method serve it, and the drafts are verified like DFlash's (rejection sampling at T > 0).
"""

from __future__ import annotations

import torch

from flashdraft.speculative import rollback
from flashdraft.speculative.engine.session import engine_decode
from flashdraft.speculative.generate import speculative_decode, use_engine
from flashdraft.speculative.result import GenerationResult
from flashdraft.speculative.sampling import sample, sampling_probs
from flashdraft.target.mtp import MTPHead, rotary_embedding


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


class MTPProposer:
    """Drafts a chain with the target's MTP layer (`flashdraft.target.mtp.MTPHead`), keeping the layer's own cache.

    The MTP layer at position p reads the embedding of token p + 1 and the target's final-normed hidden state at p,
    and predicts token p + 2. Each round first runs it over the positions the target verified since the last round
    (their hidden states come from the verification: `observe`); its output at the last of them gives draft 1.
    Draft j + 1 then reads the embedding of draft j and the layer's own output of step j, one position further on.
    Those chain steps go into the layer's cache too and are cropped away after the round, like the DFlash drafter's
    block: the next round recomputes those positions from the target's hidden states.
    """

    def __init__(
        self,
        head: MTPHead,
        target: torch.nn.Module,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ):
        self.head, self.target = head, target
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.sampling = (temperature, top_p, top_k)
        self.generator = generator
        # The loop hands over the output of layer i as hidden_states[i + 1]; transformers' last entry,
        # hidden_states[L], is the final norm's output (the LM head's input): what the MTP layer reads.
        self.feature_layers = [int(target.get_decoder().config.num_hidden_layers) - 1]
        self.cache = head.new_cache()
        self.cached = 0
        self.new_hidden: list[torch.Tensor] = []

    def observe(self, features: torch.Tensor) -> None:
        self.new_hidden.append(features)

    def _step(self, token_ids: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        embeds = self.embed(token_ids[None])
        positions = torch.arange(start, start + token_ids.shape[0], device=token_ids.device)[None]
        return self.head(embeds, hidden, rotary_embedding(self.target, embeds, positions), positions, self.cache)

    def propose(self, tokens: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = torch.cat(self.new_hidden, dim=1)
        self.new_hidden.clear()
        anchor = tokens.shape[0] - 1
        if self.cached + hidden.shape[1] != anchor:
            raise RuntimeError(f"MTP context covers {self.cached + hidden.shape[1]} tokens, expected {anchor}")
        # Positions cached .. anchor - 1 pair the target's hidden state at p with token p + 1.
        out = self._step(tokens[self.cached + 1 :], hidden, self.cached)[:, -1:]
        self.cached = anchor
        temperature, top_p, top_k = self.sampling
        drafts, probs = [], []
        for j in range(num_drafts):
            logits = self.lm_head(out[0, -1])
            if temperature <= 0:
                drafts.append(logits.argmax(dim=-1))
            else:
                probs.append(sampling_probs(logits, temperature, top_p, top_k))
                drafts.append(sample(probs[-1], self.generator))
            if j + 1 < num_drafts:
                out = self._step(drafts[-1].view(1), out, anchor + j)
        rollback.crop_kv(self.cache, anchor)
        return torch.stack(drafts), (torch.stack(probs) if probs else None)


def _decode(
    target,
    input_ids,
    max_new_tokens,
    on_engine: bool,
    engine_kwargs: dict,
    plain_proposer,
    num_drafts: int,
    max_deferred: int | None,
    **sampling,
) -> GenerationResult:
    """One decode on the engine (with `engine_kwargs`) or the plain loop (with `plain_proposer()`, built only there).

    sampling: temperature, top_p, top_k, stop_token_ids, generator and verify, which both take alike."""
    if on_engine:
        return engine_decode(target, input_ids, max_new_tokens, **engine_kwargs, **sampling)
    return speculative_decode(
        target,
        input_ids,
        plain_proposer(),
        max_new_tokens,
        num_drafts=num_drafts,
        max_deferred=max_deferred,
        **sampling,
    )


def autoregressive_generate(
    target: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, engine: bool | None = None, **sampling
) -> GenerationResult:
    """Plain cached decoding, one target forward per token, with the statistics fields of `generate`.

    engine, and sampling (temperature, top_p, top_k, stop_token_ids, generator): as in `generate` (by default the
    engine's captured decode step on a CUDA target it supports).
    """
    return _decode(target, input_ids, max_new_tokens, use_engine(target, engine), {}, lambda: None, 0, None, **sampling)


def prompt_lookup_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int = 16,
    ngram_max: int = 3,
    num_draft: int | None = None,
    max_deferred: int | None = None,
    engine: bool | None = None,
    **sampling,
) -> GenerationResult:
    """Prompt-lookup speculative decoding; `num_draft` drafts per round (default `block_size - 1`).

    engine, and sampling (temperature, top_p, top_k, stop_token_ids, generator, verify): as in `generate`; the
    engine verifies blocks of `num_draft + 1` tokens.
    """
    num_draft = block_size - 1 if num_draft is None else num_draft
    if num_draft < 0:
        raise ValueError(f"num_draft must be >= 0, got {num_draft}")
    on_engine = dict(lookup=PromptLookupProposer(ngram_max), block_size=num_draft + 1)
    return _decode(
        target,
        input_ids,
        max_new_tokens,
        use_engine(target, engine),
        on_engine,
        lambda: PromptLookupProposer(ngram_max),
        num_draft,
        max_deferred,
        **sampling,
    )


def mtp_generate(
    target: torch.nn.Module,
    head: MTPHead,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_drafts: int = 3,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    max_deferred: int | None = None,
    engine: bool | None = None,
    block_size: int = 16,
    verify: str = "block",
) -> GenerationResult:
    """Speculative decoding with the target's own MTP layer (`flashdraft.target.mtp.load_mtp`): `num_drafts`
    chained drafts per round (3: SGLang's documented `--speculative-num-steps` for Qwen3.5 and Qwen3-Next).

    engine, verify: as in `generate`. On the engine every verification is `block_size` tokens wide (static shapes;
    only the first num_drafts + 1 count), so that MTP shares DFlash's engine and graphs at the default of 16.
    """
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    sampling = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, generator=generator
    )
    on_engine = dict(mtp=head, num_drafts=num_drafts, block_size=max(block_size, num_drafts + 1))
    return _decode(
        target,
        input_ids,
        max_new_tokens,
        use_engine(target, engine, head),
        on_engine,
        lambda: MTPProposer(head, target, temperature, top_p, top_k, generator),
        num_drafts,
        max_deferred,
        verify=verify,
        **sampling,
    )
