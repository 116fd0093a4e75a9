"""The target's MTP layer over a static cache, one captured step per round: the engine's MTP drafter.

    runner = MTPRunner(head, target_engine, num_drafts=3)   # head: flashdraft.target.mtp.load_mtp(...)
    runner.capture()                                        # CUDA graph of `draft` (before the cache fills)
    runner.prefill(prompt_ids, first_token)                 # after engine.prefill: the prompt's positions
    runner.draft()                                          # runner.drafts (k,), runner.logits (k, V)
    runner.note_verified(accepted, bonus)                   # after engine.verify / commit: the verified positions

Same arithmetic as `flashdraft.speculative.baselines.MTPProposer` (tests compare them): at position p the layer
reads the embedding of token p + 1 and the target's final-normed hidden state at p (the engine's `verify_hidden`),
and its output at the last verified position gives draft 1; draft j + 1 reads the embedding of draft j and the
layer's own output of step j, one position further on. Static shapes: each draft runs the layer over all
`block_size` rows of the pending buffers (the verified block's positions, of which only `pending` are valid), then
`num_drafts - 1` one-token chain steps. Keys and values go into the cache at their positions; rows past the valid
ones and the chain's own positions are masked from every query that must not see them and overwritten by the next
round.

Sampling (`temperature` > 0): each draft is drawn inside the step as argmax(log q + Gumbel noise), with the
noise drawn from the caller's generator before the step runs — an exact draw from q, the distribution that
rejection sampling then checks against (`probs`), with no random state inside the graph.
"""

from __future__ import annotations

import torch

from flashdraft.speculative.engine import ops
from flashdraft.speculative.engine.graphs import Step, capture_all
from flashdraft.speculative.engine.mixers import attention
from flashdraft.speculative.engine.target_runner import TargetEngine
from flashdraft.speculative.sampling import draw_gumbel_, gumbel_pick, validate_sampling


class MTPRunner:
    """Drafts chains of `num_drafts` tokens with the target's MTP layer for the target `engine` runs."""

    def __init__(
        self,
        head: torch.nn.Module,
        engine: TargetEngine,
        num_drafts: int,
        sampling: tuple[float, float, int] = (0.0, 1.0, 0),
        generator: torch.Generator | None = None,
    ):
        if not 1 <= num_drafts < engine.block_size:
            raise ValueError(f"num_drafts must be in [1, {engine.block_size - 1}] for this engine, got {num_drafts}")
        validate_sampling(*sampling)
        first = next(head.parameters())
        self.device, self.dtype = first.device, first.dtype
        if self.device != engine.device or self.dtype != engine.dtype:
            raise ValueError(f"MTP head on {self.device} in {self.dtype}, target on {engine.device} in {engine.dtype}")
        self.head, self.engine, self.num_drafts = head, engine, num_drafts
        self.sampling, self.generator = sampling, generator
        self.layer = head.layers[0]
        self.embed = engine.inner.embed_tokens
        self.norms = {id(m): ops.Norm(m) for m in head.modules() if "RMSNorm" in type(m).__name__}
        bs = engine.block_size
        # Positions reach the target's cached length + a block (pending rows) + the chain.
        self.slots = ops.attention_slots(engine.slots + bs + num_drafts)
        attn = self.layer.self_attn
        shape = (attn.k_proj.out_features // attn.head_dim, self.slots, attn.head_dim)
        self.kv = (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )
        self.cos, self.sin = ops.rope_table(engine.inner.rotary_emb, self.slots, self.dtype, self.device)
        self.slot_index = torch.arange(self.slots, device=self.device)
        self.block_index = torch.arange(bs, device=self.device)
        vocab = engine.lm_head.out_features
        # Positions whose keys/values are final; verified positions waiting in the pending buffers.
        self.context = torch.zeros((), dtype=torch.long, device=self.device)
        self.pending = torch.zeros((), dtype=torch.long, device=self.device)
        self.pending_hidden = torch.zeros(bs, engine.verify_hidden.shape[-1], dtype=self.dtype, device=self.device)
        self.pending_ids = torch.zeros(bs, dtype=torch.long, device=self.device)
        # The token the next verification starts from (the last one emitted), as DrafterRunner.block_ids[:1].
        self.block_ids = torch.zeros(1, dtype=torch.long, device=self.device)
        self.logits = torch.zeros(num_drafts, vocab, dtype=self.dtype, device=self.device)
        self.drafts = torch.zeros(num_drafts, dtype=torch.long, device=self.device)
        sampled = sampling[0] > 0
        # q of each draft, as the rejection sampling reads it (float64 for a float64 head, as sampling_probs gives).
        probs_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.probs = torch.zeros(num_drafts, vocab, dtype=probs_dtype, device=self.device) if sampled else None
        self.noise = torch.zeros(num_drafts, vocab, dtype=torch.float32, device=self.device) if sampled else None
        self.step = Step(self._draft, "mtp")

    def capture(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA MTP head, this one is on {self.device}")
        with torch.inference_mode():
            self.pending.fill_(1)  # the warm-up runs really draft: from one (dummy) pending position
            capture_all([self.step])
            self.context.zero_()
            self.pending.zero_()

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, first: torch.Tensor | int) -> None:
        """After `engine.prefill(prompt)`: run the layer over positions 0 .. P - 2 (tokens 1 .. P - 1 with the
        prompt's hidden states) and leave position P - 1 (with the first generated token) pending."""
        hidden, length = self.engine.prompt_hidden, prompt.shape[0]
        prompt = prompt.to(self.device)
        first = torch.as_tensor(first, device=self.device).view(1)
        if length > 1:
            positions = torch.arange(length - 1, device=self.device)
            self._layer(prompt[1:], hidden[:-1], positions, None)
        self.context.fill_(length - 1)
        self.pending.fill_(1)
        self.pending_hidden[:1].copy_(hidden[-1:])
        self.pending_ids[:1].copy_(first)
        self.block_ids.copy_(first)

    @torch.inference_mode()
    def draft(self) -> None:
        """Add the pending positions, then draft the chain after `block_ids[0]`: `drafts`, `logits` (and `probs`)."""
        if self.noise is not None:
            draw_gumbel_(self.noise, self.generator)
        self.step()

    @torch.inference_mode()
    def note_verified(self, accepted: torch.Tensor, bonus: torch.Tensor) -> None:
        """After a verification that accepted `accepted` drafts and emitted `bonus` (0-d device tensors): its first
        accepted + 1 positions become pending, each with the token after it."""
        engine = self.engine
        self.pending.copy_(accepted + 1)
        self.pending_hidden.copy_(engine.verify_hidden)
        following = torch.roll(engine.verify_ids, -1)
        self.pending_ids.copy_(torch.where(self.block_index == accepted, bonus, following))
        self.block_ids.copy_(bonus.view(1))

    def _norm(self, module, x):
        return self.norms[id(module)](x)

    def _layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, visible) -> torch.Tensor:
        """The MTP layer over tokens `ids` (T,) with hidden states (T, D) at `positions`: outputs (T, D)."""
        head, layer = self.head, self.layer
        embeds = self.embed(ids)
        normed = [self._norm(head.pre_fc_norm_embedding, embeds), self._norm(head.pre_fc_norm_hidden, hidden)]
        x = head.fc(torch.cat(normed, dim=-1))
        cos, sin = self.cos[positions], self.sin[positions]
        h = self._norm(layer.input_layernorm, x)
        x = x + attention(layer.self_attn, h, positions, cos, sin, self.kv, visible, self._norm)
        x = x + layer.mlp(self._norm(layer.post_attention_layernorm, x))
        return self._norm(head.norm, x)

    def _pick(self, j: int, logits: torch.Tensor) -> torch.Tensor:
        self.logits[j].copy_(logits)
        token, probs = gumbel_pick(logits, self.sampling, None if self.noise is None else self.noise[j])
        if probs is not None:
            self.probs[j].copy_(probs)
        return token

    def _draft(self) -> None:
        positions = self.context + self.block_index
        out = self._layer(self.pending_ids, self.pending_hidden, positions, self.slot_index[None] <= positions[:, None])
        last = out.index_select(0, (self.pending - 1).clamp(min=0).view(1))  # pending >= 1 whenever it counts
        anchor = self.context + self.pending  # the position of the first chain step
        for j in range(self.num_drafts):
            token = self._pick(j, self.engine.lm_head(last)[0])
            self.drafts[j : j + 1].copy_(token)
            if j + 1 < self.num_drafts:
                position = (anchor + j).view(1)
                last = self._layer(token, last, position, self.slot_index[None] <= position[:, None])
        self.context.copy_(anchor)
        self.pending.zero_()
