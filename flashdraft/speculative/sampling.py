"""Sampling distributions and the speculative rejection step.

`sampling_probs` turns logits into the distribution a sampler draws from (temperature, then top-k, then
top-p). Speculative sampling is lossless with respect to exactly that distribution: `rejection_sample` accepts
a drafted token x with probability min(1, p(x)/q(x)), on the first rejection draws from normalize(max(0, p−q)),
and after a fully accepted block draws the bonus token from p. Every emitted token is then distributed as p
(Leviathan et al. 2023, Chen et al. 2023), whatever the draft distribution q.
"""

from __future__ import annotations

import torch


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def validate_request(input_ids: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, top_k: int):
    """What both decoding loops (the plain one and the engine) accept: one non-empty prompt, sane settings."""
    validate_sampling(temperature, top_p, top_k)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding runs batch 1; got input_ids of shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution sampled at `temperature` > 0 after top-k and top-p filtering: `[..., V]` -> `[..., V]`.

    Computed in float32 at least (float64 logits stay float64). Top-k keeps the k largest logits; top-p then
    keeps the smallest prefix of the sorted distribution whose mass reaches `top_p` (the token that crosses it
    included), and renormalises.
    """
    if temperature <= 0:
        raise ValueError(f"sampling_probs needs temperature > 0, got {temperature}; use argmax for greedy")
    validate_sampling(temperature, top_p, top_k)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype) / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass strictly above it is still below top_p.
        keep_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of `probs` (`[..., V]` -> `[...]`, long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Argmax at temperature 0, otherwise a draw from `sampling_probs` (`[..., V]` -> `[...]`)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    return sample(sampling_probs(logits, temperature, top_p, top_k), generator)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Verify drafted tokens against the target's distributions; return (accepted drafts, next token).

    draft_tokens: `[n]` drafted tokens. draft_probs: `[n, V]` the distributions they were drawn from, or None
    for a deterministic proposer (prompt lookup: q is one-hot on the drafted token). target_probs: `[n + 1, V]`,
    row i is the target's distribution for the position of draft i (row n: after the last draft).
    The returned token is the correction at the first rejected position, or the bonus token after n accepts.
    """
    accepted, token = rejection_sample_tensors(draft_tokens, draft_probs, target_probs, generator)
    accepted, token = torch.stack([accepted, token]).tolist()
    return accepted, token


def rejection_sample_tensors(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` without leaving the device: (accepted drafts, next token) as 0-d long tensors.

    Draws the same random numbers in the same order (n uniforms, then one token), so both give the same result
    with the same generator state.
    """
    n = draft_tokens.shape[0]
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs needs n + 1 = {n + 1} rows for {n} drafts, got {target_probs.shape[0]}")
    rows = torch.arange(n, device=draft_tokens.device)
    p = target_probs[rows, draft_tokens]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, draft_tokens].to(p.dtype)
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)
    # u < p/q, written without the division (q > 0 for every drawn token).
    accepted = (u * q < p).to(torch.int64).cumprod(0).sum()
    row = target_probs.index_select(0, accepted.view(1))[0]
    if n == 0:
        return accepted, sample(row, generator)
    # The residual normalize(max(0, p - q)) at the first rejection (its row is unused after n accepts).
    at = accepted.clamp(max=n - 1).view(1)
    if draft_probs is None:
        q_row = torch.zeros_like(row).scatter_(0, draft_tokens.index_select(0, at), 1.0)
    else:
        q_row = draft_probs.index_select(0, at)[0].to(row.dtype)
    residual = (row - q_row).clamp_min_(0)
    total = residual.sum()
    # total == 0 means p == q at this position, where rejection has probability 0; only rounding gets here.
    use_target = (accepted == n) | (total <= 0)
    dist = torch.where(use_target, row, residual / torch.where(total > 0, total, torch.ones_like(total)))
    return accepted, sample(dist, generator)
