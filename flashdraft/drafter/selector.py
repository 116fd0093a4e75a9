"""DFlash2's candidate selector: which of each position's top-k tokens the drafted path goes through (z-lab's
inference code).

The backbone drafts every position of a block in one pass; its logits U_t (the target's LM head on the final-normed
hidden state h_t) cannot see the token drafted at t − 1. The selector keeps the k best tokens C_t = topk(U_t) of each
position and rescores them given the previous token a:

    S_t(a, b) = U_t(b) + Σ_r A[a, r] · (W_h h_t)[r] · B[b, r]            b ∈ C_t

with A (`predecessor_codebook`, V × r), B (`successor_codebook`, V × r) and W_h (`hidden_projection`, r × H). The
path is walked left to right from the anchor: x_t is the argmax of S_t(x_{t−1}, ·) over C_t, or (sampling) a draw
from q_t = softmax(S_t(x_{t−1}, ·) / T) restricted to C_t. Only the k × r products depend on the path. The proposal
is supported on C_t alone, so `walk` hands out full-vocabulary rows that are −inf outside C_t: a distribution made
from such a row is the one the draft was drawn from, which is what lossless verification must read.

In training a = the true previous token (teacher forcing; the anchor first), as DSpark's Markov head.

Initialisation (NeMo Automodel's): B = 0, A ~ N(0, std) and W_h the drafter's default normal init, so S = U at the
start and a new DFlash2 drafter drafts what its backbone alone would. `reference_scores` writes S element by element.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CandidateSelector(nn.Module):
    """Scores and walks the top-k candidates of each block position (see the module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, std: float = 0.02):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k must be in [1, vocab_size={vocab_size}], got {top_k}")
        self.top_k, self.rank = top_k, rank
        # Bare parameters: the published checkpoints name them without `.weight`.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_codebooks(std)

    def reset_codebooks(self, std: float) -> None:
        """A ~ N(0, std), B = 0 (S = U); marked initialised so that the drafter's `post_init` keeps them."""
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, std)
            self.successor_codebook.zero_()
        for param in (self.predecessor_codebook, self.successor_codebook):
            param._is_hf_initialized = True

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(U at C, C): the top-k logits of each row (..., V), largest first, and their token ids, (..., k) each."""
        return torch.topk(logits, self.top_k, dim=-1, sorted=True)

    def pair_scores(self, hidden: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """⟨A[prev] ⊙ W_h h, B[c]⟩ for hidden (..., H), prev (...) and candidates (..., k) -> (..., k)."""
        query = self.predecessor_codebook[prev].to(hidden.dtype) * self.hidden_projection(hidden)
        successors = self.successor_codebook[candidates].to(hidden.dtype)
        return torch.einsum("...r,...kr->...k", query, successors)

    def scores(self, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor) -> tuple:
        """Teacher-forced S of whole blocks: logits (..., V), hidden (..., H), prev (...) -> (S (..., k), C (..., k))."""
        values, ids = self.candidates(logits)
        return values + self.pair_scores(hidden, prev, ids).to(values.dtype), ids

    def walk(self, base: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor, pick) -> tuple:
        """Left-to-right drafting of the positions of base (n, V) logits and hidden (n, H), from the token `first`:
        x_t = pick(t, row_t) with row_t = S_t(x_{t−1}, ·) on C_t and −inf elsewhere. Returns (drafts (n,), rows
        (n, V)). Device operations only (CUDA-graph safe)."""
        values, ids = self.candidates(base)
        query = self.hidden_projection(hidden)
        successors = self.successor_codebook[ids].to(hidden.dtype)  # (n, k, r)
        blank = torch.full_like(base, float("-inf"))
        drafts, rows, prev = [], [], first
        for t in range(base.shape[0]):
            # An embedding lookup, not codebook[prev]: indexing with a 0-d tensor reads it on the host (.item()),
            # which a CUDA graph's capture refuses.
            predecessor = F.embedding(prev, self.predecessor_codebook).to(hidden.dtype)
            pair = successors[t] @ (predecessor * query[t])
            rows.append(blank[t].scatter(0, ids[t], values[t] + pair.to(values.dtype)))
            prev = pick(t, rows[-1])
            drafts.append(prev)
        return torch.stack(drafts), torch.stack(rows)


def reference_scores(
    selector: CandidateSelector, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`selector.scores` of logits (n, V), hidden (n, H), prev (n,) written from the formula in float64, one score at
    a time: the candidates by sorting, then U(b) + Σ_r A[a, r] (Σ_h W_h[r, h] h[h]) B[b, r]."""
    a_book, b_book = selector.predecessor_codebook.double(), selector.successor_codebook.double()
    w = selector.hidden_projection.weight.double()
    logits, hidden = logits.double(), hidden.double()
    all_scores, all_ids = [], []
    for t in range(logits.shape[0]):
        order = sorted(range(logits.shape[1]), key=lambda v: -float(logits[t, v].detach()))[: selector.top_k]
        projected = [sum(w[r, i] * hidden[t, i] for i in range(hidden.shape[1])) for r in range(selector.rank)]
        row = []
        for b in order:
            pair = sum(a_book[prev[t], r] * projected[r] * b_book[b, r] for r in range(selector.rank))
            row.append(logits[t, b] + pair)
        all_scores.append(torch.stack(row))
        all_ids.append(torch.tensor(order))
    return torch.stack(all_scores), torch.stack(all_ids)


__all__ = ["CandidateSelector", "reference_scores"]
