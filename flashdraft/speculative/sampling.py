"""Sampling distributions and the speculative verification step.

`sampling_probs` turns logits into the distribution a sampler draws from (temperature, then top-k, then
top-p). Speculative sampling is lossless with respect to exactly that distribution, whatever the draft
distribution q. `rejection_sample` verifies a block of drafts in one of two ways:

- token: each draft x is accepted with probability min(1, p(x)/q(x)) until the first rejection, which draws from
  normalize(max(0, p - q)); after a fully accepted block the bonus token comes from p (Leviathan et al. 2023,
  Chen et al. 2023).
- block: the block's drafts are judged together (block verification, Sun et al. 2024). A running weight
  w_i = min(1, w_{i-1} p(x_i)/q(x_i)) lets a later draft make up for an earlier unlikely one; the number of
  accepted drafts is the last i whose uniform falls below h_i (h_n = w_n; before it, h_i = r_i / (r_i + 1 - w_i)
  with r_i = sum over x of max(0, w_i p_{i+1}(x) - q_{i+1}(x))), and the next token is drawn from
  normalize(max(0, w_i p - q)) at that position. It emits the target's distribution too, and (Sun et al. show)
  no fewer tokens per round on average than token-by-token verification of the same drafts.

At temperature 0 neither runs: a greedy round keeps the drafts that equal the target's argmax.
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


def draw_gumbel_(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill `noise` with Gumbel(0, 1) draws, in place: argmax(log q + noise) is an exact draw from q. Drawn before a
    captured step, so that the step itself holds no random state (`gumbel_pick`)."""
    return noise.uniform_(generator=generator).log_().neg_().log_().neg_()


def gumbel_draw(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A draw from each row of `probs` (`[..., V]` -> `[...]`) made with pre-drawn Gumbel `noise` of the same shape
    (`draw_gumbel_`): a token of probability 0 is never drawn."""
    return (probs.log() + noise).argmax(dim=-1)


def gumbel_pick(logits: torch.Tensor, sampling: tuple[float, float, int], noise: torch.Tensor | None):
    """One token from `logits` (V,): the argmax when `noise` is None (greedy), else a draw from
    `sampling_probs(logits, *sampling)` made with the pre-drawn `noise` (V,). Returns (token (1,), q or None).
    Device operations only: it runs inside CUDA graphs."""
    if noise is None:
        return logits.argmax(dim=-1, keepdim=True), None
    probs = sampling_probs(logits, *sampling)
    return gumbel_draw(probs, noise).unsqueeze(-1), probs


VERIFY_METHODS = ("block", "token")


def validate_verify(verify: str) -> str:
    if verify not in VERIFY_METHODS:
        raise ValueError(f"verify must be one of {list(VERIFY_METHODS)}, got {verify!r}")
    return verify


def rejection_sample(*args, **kwargs) -> tuple[int, int]:
    """Verify drafted tokens against the target's distributions: (accepted drafts, next token) as ints. Takes
    `rejection_sample_tensors`'s arguments and reads its result on the host."""
    accepted, token = torch.stack(rejection_sample_tensors(*args, **kwargs)).tolist()
    return accepted, token


def rejection_sample_tensors(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    verify: str = "block",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafted tokens against the target's distributions without leaving the device: (accepted drafts, next
    token) as 0-d long tensors (`rejection_sample` reads them on the host).

    draft_tokens: `[n]` drafted tokens. draft_probs: `[n, V]`, row i the distribution draft i was drawn from
    (given the drafts before it), or None for a deterministic proposer (prompt lookup: q is one-hot on the drafted
    token). target_probs: `[n + 1, V]`, row i is the target's distribution for the position of draft i (row n:
    after the last draft). verify: block or token (the module's docstring). The returned token is the correction
    after the accepted drafts, or the bonus token after n accepts.

    Both functions draw the same random numbers in the same order (n uniforms, then one token), so they give the
    same result with the same generator state.
    """
    validate_verify(verify)
    n = draft_tokens.shape[0]
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs needs n + 1 = {n + 1} rows for {n} drafts, got {target_probs.shape[0]}")
    u = torch.rand(n, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=u.device), sample(target_probs[0], generator)
    accepted, correction = verify_drafts(draft_tokens, draft_probs, target_probs, u, verify)
    return accepted, sample(correction, generator)


def verify_drafts(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    verify: str = "block",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance of `rejection_sample_tensors` with its `uniforms` `[n]` (n >= 1) drawn before: (accepted
    drafts as a 0-d long tensor, the distribution `[V]` of the token after them). Device operations only: a captured
    round runs it (the correction then drawn with pre-drawn noise: `gumbel_draw`)."""
    n = draft_tokens.shape[0]
    draft_rows = _draft_rows(draft_tokens, draft_probs, target_probs)
    if verify == "token":
        rows = torch.arange(n, device=draft_tokens.device)
        p, q = target_probs[rows, draft_tokens], draft_rows[rows, draft_tokens]
        # u < p/q, written without the division (q > 0 for every drawn token).
        accepted = (uniforms * q < p).to(torch.int64).cumprod(0).sum()
        weights = torch.ones(n + 1, dtype=target_probs.dtype, device=uniforms.device)
    else:
        stop, weights = block_acceptance(draft_tokens, draft_rows, target_probs)
        counts = torch.arange(1, n + 1, device=uniforms.device)
        accepted = torch.where(uniforms < stop, counts, torch.zeros_like(counts)).max()
    return accepted, correction_distribution(accepted, weights, draft_rows, target_probs)


def _draft_rows(draft_tokens, draft_probs, target_probs) -> torch.Tensor:
    """`[n, V]` draft distributions in the target's dtype; one-hot rows for a deterministic proposer."""
    if draft_probs is None:
        rows = torch.zeros(
            draft_tokens.shape[0], target_probs.shape[-1], dtype=target_probs.dtype, device=target_probs.device
        )
        return rows.scatter_(1, draft_tokens.view(-1, 1), 1.0)
    return draft_probs.to(target_probs.dtype)


def block_acceptance(
    draft_tokens: torch.Tensor, draft_rows: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's pass probabilities h `[n]` (h_i: the test of the first i drafts passes; a round keeps
    the longest prefix whose test passes) and running weights w `[n + 1]` (w_0 = 1), as in the module's docstring."""
    n = draft_tokens.shape[0]
    rows = torch.arange(n, device=draft_tokens.device)
    ratio = torch.log(target_probs[rows, draft_tokens]) - torch.log(draft_rows[rows, draft_tokens])
    # w_i = min(1, w_{i-1} p_i / q_i) in logs is a running sum clamped at 0: log w_i = S_i - max_{j <= i} S_j.
    running = torch.cat([ratio.new_zeros(1), ratio.cumsum(0)])
    weights = torch.exp(running - running.cummax(0).values)
    inner = weights[1:n]
    r = (inner[:, None] * target_probs[1:n] - draft_rows[1:n]).clamp_min(0).sum(-1)
    denominator = r + 1 - inner
    # denominator == 0 only when w_i = 1 and the next rows are equal: nothing is lost by stopping there.
    stop = torch.where(denominator > 0, r / denominator.clamp_min(torch.finfo(r.dtype).tiny), torch.ones_like(r))
    return torch.cat([stop, weights[n:]]), weights


def correction_distribution(
    accepted: torch.Tensor, weights: torch.Tensor, draft_rows: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    """The distribution of the token after `accepted` drafts: normalize(max(0, w p - q)) at that position, or the
    target's row after a full block. Token-by-token verification is the case w = 1."""
    n = draft_rows.shape[0]
    row = target_probs.index_select(0, accepted.view(1))[0]
    at = accepted.clamp(max=n - 1).view(1)
    residual = (weights.index_select(0, accepted.view(1)) * row - draft_rows.index_select(0, at)[0]).clamp_min_(0)
    total = residual.sum()
    # total == 0 means nothing is left to correct at this position (p == q with w = 1): only rounding gets here.
    use_target = (accepted == n) | (total <= 0)
    return torch.where(use_target, row, residual / torch.where(total > 0, total, torch.ones_like(total)))
