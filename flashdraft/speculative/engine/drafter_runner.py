"""The DFlash drafter over a static cache of context keys/values, one captured step per block.

    runner = DrafterRunner(drafter, target_engine)   # shares the engine's embedding, LM head and feature buffer
    runner.capture()                                 # CUDA graph of `draft` (before the cache fills)
    runner.prefill()                                 # context K/V of the engine's prompt
    runner.block_ids[0] = last token; runner.draft() # runner.logits (bs - 1, V), runner.drafts (bs - 1,)
    runner.pending.fill_(k + 1)                      # the next draft first adds features of the k + 1 verified tokens
    runner.refine = (1, 3, 7)                        # greedy drafts in four passes (the plain loop's `refine`)

Same arithmetic as `DFlashDraftModel.forward` with a cache (tests compare them): context features go through
`fc` + `hidden_norm` once, their keys/values are cached per layer; the block `[last token, MASK...]` attends to
the cached context and to itself. Static shapes: each draft writes the K/V of all rows of the engine's feature
buffer (one per verified token) at slots `context ..`, of which only `pending` are valid; the block's own K/V go
into the slots right after the valid context, where its positions are — rows past the context are masked and
overwritten later.

The step picks the drafts: greedily, or, when sampling (a runner bakes its sampling settings into its step), each
drawn from its q with Gumbel noise drawn before the step (`draw_noise`, `sampling.gumbel_draw`), q kept in `probs`
for verification. A drafter with a Markov head (DSpark) or a selector (DFlash2) picks them left to right
(`DFlashDraftModel.walk`), each given the drafts before it. Its anchor slot drafts too: a block of bs then gives bs
drafts, and the engine verifies bs + 1 tokens. A drafter with a confidence head also fills `confidence`
in the step: c_k = sigmoid(`confidence_logits`) of each draft given the token before it (the plain loop's
`DFlashProposer.confidence`), only reported, read by the host with the round's tokens.
"""

from __future__ import annotations

import torch

from flashdraft.drafter.attention import _rotate
from flashdraft.drafter.conv import around
from flashdraft.speculative.engine import ops
from flashdraft.speculative.engine.graphs import Step, capture_all, capture_or_warn
from flashdraft.speculative.engine.target_runner import TargetEngine
from flashdraft.speculative.sampling import draw_gumbel_, gumbel_draw, gumbel_pick, sampling_probs, validate_sampling


class DrafterRunner:
    """Drafts blocks of `engine.block_size` tokens for the target `engine` runs (see the module docstring)."""

    def __init__(
        self,
        drafter: torch.nn.Module,
        engine: TargetEngine,
        sampling: tuple[float, float, int] = (0.0, 1.0, 0),
        generator: torch.Generator | None = None,
    ):
        if list(drafter.target_layer_ids) != engine.feature_layers:
            raise ValueError(
                f"drafter reads target layers {list(drafter.target_layer_ids)}, the engine keeps {engine.feature_layers}"
            )
        validate_sampling(*sampling)
        self.drafter, self.engine = drafter, engine
        self.embed = engine.inner.embed_tokens
        first = next(drafter.parameters())
        self.device, self.dtype = first.device, first.dtype
        if self.device != engine.device:
            raise ValueError(f"drafter on {self.device}, target on {engine.device}")
        # The engine verifies the anchor and every draft; a block one shorter when the anchor's slot drafts too.
        self.offset = drafter.draft_offset
        self.num_drafts = engine.block_size - 1
        bs = self.block_size = engine.block_size - self.offset
        if bs < 1:
            raise ValueError(f"the engine verifies {engine.block_size} tokens: no room for a block")
        self.slots = ops.attention_slots(engine.slots + bs)
        self.layers = list(drafter.layers)
        self.norms = {id(m): ops.Norm(m) for m in drafter.modules() if "RMSNorm" in type(m).__name__}
        self.kv = []
        for layer in self.layers:
            attn = layer.self_attn
            shape = (attn.k_proj.out_features // attn.head_dim, self.slots, attn.head_dim)
            self.kv.append(
                (
                    torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device),
                )
            )
        self.cos, self.sin = ops.rope_table(drafter.rotary_emb, self.slots, self.dtype, self.device)
        self.slot_index = torch.arange(self.slots, device=self.device)
        self.block_index = torch.arange(max(bs, engine.block_size), device=self.device)
        vocab = engine.lm_head.out_features
        # Tokens whose features are in the cache; verified tokens whose features wait in engine.features.
        self.context = torch.zeros((), dtype=torch.long, device=self.device)
        self.pending = torch.zeros((), dtype=torch.long, device=self.device)
        self.block_ids = torch.full((bs,), int(drafter.mask_token_id), dtype=torch.long, device=self.device)
        self.logits = torch.zeros(self.num_drafts, vocab, dtype=self.dtype, device=self.device)
        self.drafts = torch.zeros(self.num_drafts, dtype=torch.long, device=self.device)
        # When sampling, the drafts are drawn inside the step (a chained head's each given the one before it): their
        # q, and the Gumbel noise of their draws, drawn before the step.
        self.chained = getattr(drafter, "chains", False)
        self.sampling, self.generator = sampling, generator
        sampled = sampling[0] > 0
        probs_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.probs = torch.zeros(self.num_drafts, vocab, dtype=probs_dtype, device=self.device) if sampled else None
        self.noise = torch.zeros(self.num_drafts, vocab, device=self.device) if sampled else None
        # A confidence head's predicted acceptance of each draft (float32, as the head computes it).
        confident = getattr(drafter, "confidence_head", None) is not None
        self.confidence = torch.zeros(self.num_drafts, device=self.device) if confident else None
        self.mask_token_id = int(drafter.mask_token_id)
        self.refine: tuple[int, ...] = ()
        self.step = Step(self._draft, "draft")
        self.prefill_steps: dict[int, Step] = {}  # by the engine's padded prefill width (see `prefill`)

    def capture(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA drafter, this one is on {self.device}")
        with torch.inference_mode():
            capture_all([self.step])
            self.context.zero_()
            self.pending.zero_()

    @torch.inference_mode()
    def prefill(self, features: torch.Tensor | None = None) -> None:
        """Cache the context K/V of prompt features (P, n * D), by default those of the engine's last prefill (then,
        where the engine padded it, one captured step per padded width reads its padded buffer: rows past the
        prompt land in slots that stay masked until overwritten); nothing is pending afterwards."""
        width = self.engine.prefill_padded_width if features is None else None
        if width is None:
            features = self.engine.prompt_features if features is None else features
            self._prefill_body(features)
            self.context.fill_(features.shape[0])
        else:
            self._prefill_step(width)()

    def capture_prefill(self, lengths) -> None:
        """Capture the prefill steps that the engine's prefills of prompts of these `lengths` will need."""
        for width in self.engine.prefill_widths(lengths):
            self._prefill_step(width)

    def _prefill_step(self, width: int) -> Step:
        step = self.prefill_steps.get(width)
        if step is None:
            step = self.prefill_steps[width] = Step(lambda: self._padded_prefill(width), f"drafter prefill {width}")
            if self.step.graph is not None:
                capture_or_warn(step, self.engine.prefill_pool())
        return step

    def _padded_prefill(self, width: int) -> None:
        self._prefill_body(self.engine.prefill_features[:width])
        self.context.copy_(self.engine.prefill_keep)

    def _prefill_body(self, features: torch.Tensor) -> None:
        positions = self.slot_index[: features.shape[0]]
        context = self._norm(self.drafter.hidden_norm, self.drafter.fc(features.to(self.dtype)))
        for layer, cache in zip(self.layers, self.kv, strict=True):
            self._cache_context(layer.self_attn, context, positions, cache)
        self.pending.zero_()

    @torch.inference_mode()
    def draft(self) -> None:
        """Add the pending features, then draft after `block_ids[0]`: `logits`, `drafts` (and `probs` when sampling).

        With `refine` the drafts are greedy and made in passes: after each, the first `refine[i]` drafts go into the
        block in place of their MASKs and the step runs again (nothing is pending then, so it redrafts the block
        over the cached context). Only device operations: it can be enqueued before the host reads anything. Then
        `logits` holds the last pass's, which are not the kept drafts' own; `confidence` those of the passes that
        fixed each draft, as the plain loop computes them."""
        self.draw_noise()
        self.passes(self.step)

    def draw_noise(self) -> None:
        """The noise of the next step's draws, when sampling (a round that drafts inside its own step calls it)."""
        if self.noise is not None:
            draw_gumbel_(self.noise, self.generator)

    def note_verified(self, accepted: torch.Tensor, bonus: torch.Tensor) -> None:
        """After a verification that accepted `accepted` drafts and emitted `bonus` (0-d device tensors): the
        features of the anchor and the accepted drafts are pending, and `bonus` is the next block's anchor."""
        self.pending.copy_(accepted + 1)
        self.block_ids[:1].copy_(bonus.view(1))

    def passes(self, step) -> None:
        """The block drafted by `step` (the captured step, or its body inside a larger graph: `rounds.py`) in the
        passes `refine` asks for."""
        step()
        fixed = 0
        kept = None if self.confidence is None or not self.refine else torch.empty_like(self.confidence)
        for keep in self.refine:
            self.block_ids[1 + fixed : 1 + keep].copy_(self.drafts[fixed:keep])
            if kept is not None:
                kept[fixed:keep].copy_(self.confidence[fixed:keep])
            fixed = keep
            step()
        if fixed:
            self.drafts[:fixed].copy_(self.block_ids[1 : 1 + fixed])
            self.block_ids[1:].fill_(self.mask_token_id)
            if kept is not None:
                self.confidence[:fixed].copy_(kept[:fixed])

    def _cache_context(self, attn, context: torch.Tensor, positions: torch.Tensor, cache) -> None:
        length, dim = context.shape[0], attn.head_dim
        key = self._norm(attn.k_norm, attn.k_proj(context).view(length, -1, dim)).transpose(0, 1)
        value = attn.v_proj(context).view(length, -1, dim).transpose(0, 1)
        key = _rotate(key, self.cos[positions][None], self.sin[positions][None])
        cache[0].index_copy_(1, positions, key)
        cache[1].index_copy_(1, positions, value)

    def _draft(self) -> None:
        drafter, bs = self.drafter, self.block_size
        features = self.engine.features
        context = self._norm(drafter.hidden_norm, drafter.fc(features.to(self.dtype)))
        context_positions = self.context + self.block_index[: features.shape[0]]
        anchor = self.context + self.pending
        positions = anchor + self.block_index[:bs]
        cos, sin = self.cos[positions][None], self.sin[positions][None]
        hidden = self.embed(self.block_ids).to(self.dtype)
        for layer, cache in zip(self.layers, self.kv, strict=True):
            attn = layer.self_attn
            self._cache_context(attn, context, context_positions, cache)

            def attention(x, attn=attn, cache=cache):
                dim = attn.head_dim
                query = _rotate(self._norm(attn.q_norm, attn.q_proj(x).view(bs, -1, dim)).transpose(0, 1), cos, sin)
                key = _rotate(self._norm(attn.k_norm, attn.k_proj(x).view(bs, -1, dim)).transpose(0, 1), cos, sin)
                cache[0].index_copy_(1, positions, key)
                cache[1].index_copy_(1, positions, attn.v_proj(x).view(bs, -1, dim).transpose(0, 1))
                visible = self._visible(attn, positions)
                return attn.o_proj(ops.cached_attention(query, cache[0], cache[1], visible, attn.scaling))

            # A DFlash2 layer convolves inside each residual branch (the block is one conv block).
            hidden = hidden + around(layer.attention_conv, attention, self._norm(layer.input_layernorm, hidden))
            hidden = hidden + around(layer.mlp_conv, layer.mlp, self._norm(layer.post_attention_layernorm, hidden))
        slots = self._norm(drafter.norm, hidden)[1 - self.offset :]
        if self.chained:
            drafts, logits = drafter.walk(slots, self.engine.lm_head, self.block_ids[0], self._pick)
        else:
            logits = drafter.compute_logits(slots, self.engine.lm_head)
            drafts = self._pick_all(logits)
        self.logits.copy_(logits)
        self.drafts.copy_(drafts)
        if self.confidence is not None:
            # Each draft after the token before it: the anchor, then the drafts. (A drafter that drafts in passes
            # has no Markov head, so its confidence head does not read them.)
            prev = torch.cat([self.block_ids[:1], drafts[:-1]])
            self.confidence.copy_(torch.sigmoid(drafter.confidence_logits(slots, prev)))
        self.context.copy_(anchor)
        self.pending.zero_()

    def _pick_all(self, logits: torch.Tensor) -> torch.Tensor:
        """Every draft of a block drafted in one go: the argmax of each row, or each drawn from its own q."""
        if self.noise is None:
            return logits.argmax(dim=-1)
        probs = sampling_probs(logits, *self.sampling)
        self.probs.copy_(probs)
        return gumbel_draw(probs, self.noise)

    def _pick(self, k: int, logits: torch.Tensor) -> torch.Tensor:
        token, probs = gumbel_pick(logits, self.sampling, None if self.noise is None else self.noise[k])
        if probs is not None:
            self.probs[k].copy_(probs)
        return token[0]

    def _norm(self, module, x):
        return self.norms[id(module)](x)

    def _visible(self, attn, positions: torch.Tensor) -> torch.Tensor:
        """(bs, slots): the context and the whole block, narrowed by the layer's causal / sliding-window rule."""
        keys, queries = self.slot_index[None], positions[:, None]
        visible = keys < positions[-1] + 1
        if attn.is_causal:
            visible = visible & (keys <= queries)
        if attn.sliding_window is not None:
            visible = visible & (queries - keys < attn.sliding_window)
            if not attn.is_causal:
                visible = visible & (keys - queries < attn.sliding_window)
        return visible
