"""DSpark's sequential heads on the DFlash backbone: a Markov head and a confidence head (arXiv 2607.05147).

The backbone drafts every position of a block in one pass; its logits U_k at block position k cannot see which
token was drafted at k − 1. The Markov head adds a low-rank logit bias that depends on that token,

    logits_k = U_k + W2 · m_k,    m_k = features(x_{k−1}, h_k)    (W1: vocabulary → rank, W2: rank → vocabulary)

so the drafted block is a left-to-right chain: cheap (one embedding row and one rank × vocabulary product per
position), and the drafts stay consistent with each other. In training x_{k−1} is the true previous token (teacher
forcing); when drafting it is the token just drafted, the anchor for the first position. The variants of the
reference (DeepSpec's `markov_head.py`):

- vanilla: m_k = W1[x_{k−1}];
- gated: m_k = σ(G [h_k ; W1[x_{k−1}]]) ⊙ W1[x_{k−1}];
- rnn: z_k = [s_{k−1} ; W1[x_{k−1}] ; h_k], (g, c, o) = J z_k, s_k = σ(g) ⊙ s_{k−1} + (1 − σ(g)) ⊙ tanh(c),
  m_k = tanh(o), with s_0 = 0 at the start of every block.

The confidence head predicts the probability that position k is accepted given that the positions before it
were: c_k = σ(w · [h_k ; W1[x_{k−1}]] + b) (or from h_k alone), trained against the acceptance rate
1 − ½‖q_k − p_k‖₁ of the drafter's distribution q against the target's p.

Parameter names are the reference checkpoints' (`markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`,
`markov_head.gate_proj.*`, `markov_head.joint_proj.*`, `confidence_head.proj.*`); they are initialised by the
drafter's own `post_init` (normal, std `initializer_range`; biases zero), as in the reference.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_KINDS = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """The logit bias of the previous token (see the module docstring): `features` then `bias`."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in MARKOV_KINDS:
            raise ValueError(f"markov_head_type {kind!r}: must be one of {', '.join(MARKOV_KINDS)}")
        if rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {rank}")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def embed(self, prev: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """W1[prev] in the dtype of `like` (the backbone's hidden states)."""
        return self.markov_w1(prev).to(like.dtype)

    def step(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Features m (..., rank) of one position from its previous token (...) and hidden state (..., D), and
        the recurrent state after it (rnn; None otherwise). `state` None: the start of a block."""
        e = self.embed(prev, hidden)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e, None
        if state is None:
            state = hidden.new_zeros(*hidden.shape[:-1], self.rank)
        gate, candidate, out = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
        keep = torch.sigmoid(gate)
        state = keep * state + (1 - keep) * torch.tanh(candidate)
        return torch.tanh(out), state

    def block_features(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Features of whole blocks at once, teacher-forced: prev (..., K) and hidden (..., K, D) -> (..., K, rank).
        The rnn runs along the K positions of each block, from a zero state."""
        if self.kind != "rnn":
            return self.step(prev, hidden)[0]
        state, out = None, []
        for k in range(prev.shape[-1]):
            m, state = self.step(prev[..., k], hidden[..., k, :], state)
            out.append(m)
        return torch.stack(out, dim=-2)

    def bias(self, features: torch.Tensor) -> torch.Tensor:
        """The logit bias W2 · m: (..., rank) -> (..., V)."""
        return self.markov_w2(features)

    def block_bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases of whole blocks: prev (..., K), hidden (..., K, D) -> (..., K, V)."""
        return self.bias(self.block_features(prev, hidden)).to(hidden.dtype)

    def walk(self, base: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor, pick) -> tuple:
        """Left-to-right drafting of K positions: logits_k = base_k (K, V) + the bias of x_{k−1} (the token `first`,
        then each pick) and h_k (K, D); x_k = pick(k, logits_k). Returns (drafts (K,), logits (K, V))."""
        drafts, rows, prev, state = [], [], first, None
        for k in range(base.shape[0]):
            features, state = self.step(prev, hidden[k], state)
            rows.append(base[k] + self.bias(features).to(base.dtype))
            prev = pick(k, rows[-1])
            drafts.append(prev)
        return torch.stack(drafts), torch.stack(rows)


class ConfidenceHead(nn.Module):
    """The logit of c_k, the predicted probability that block position k is accepted after its predecessors."""

    def __init__(self, hidden_size: int, markov_rank: int = 0):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """(..., D) hidden states (and (..., rank) W1[x_{k−1}] when it reads the Markov embedding) -> (...,) logits,
        computed in float32 (the reference's choice: a probability near 0 or 1 must not round away)."""
        x = hidden if prev_embedding is None else torch.cat([hidden, prev_embedding.to(hidden.dtype)], dim=-1)
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float())[..., 0]


__all__ = ["MARKOV_KINDS", "ConfidenceHead", "MarkovHead"]
