"""The DFlash drafter: Qwen3 decoder layers whose keys and values also see the target's hidden states.

One forward drafts a whole block. Its inputs are the block's token embeddings (made with the *target's* frozen
embedding: `[anchor, MASK x (block_size - 1)]`) and the context features (hidden states of `target_layer_ids`,
concatenated). In every layer the queries come from the block only, while keys and values are projected from
`concat(context, block)` along the sequence ("KV injection"), so the context never flows through the MLPs or the
residual stream. The drafter has no embedding and no LM head; logits come from the target's LM head:

    features = select_context_features(target_out.hidden_states, drafter.target_layer_ids)  # (B, T, n * D)
    block = target.get_input_embeddings()(block_ids)                                        # (B, bs, D)
    hidden = drafter(position_ids=positions, noise_embedding=block, target_hidden=features)  # positions: (B, T + bs)
    logits = drafter.compute_logits(hidden[:, 1:], target.lm_head)                          # (B, bs - 1, V)

Checkpoints are in the format of the reference `dflash` package (also read by SGLang and vLLM), see `config.py`.

A drafter of another family (`families.py`) is the same backbone with more on top: DSpark's Markov head turns the
block's logits into a left-to-right chain (`draft_logits` teacher-forced, `walk` when drafting) and its confidence
head predicts each draft's acceptance (`confidence_logits`); DFlash2 convolves inside each sublayer (`conv.py`) and
walks the block through its candidate selector (`selector.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import PreTrainedConfig, Qwen3Config
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from flashdraft.drafter.attention import DFlashAttention
from flashdraft.drafter.config import (
    AUTO_MAP,
    draft_config_from_target,
    draft_value,
    validate_draft_config,
)
from flashdraft.drafter.conv import around
from flashdraft.drafter.families import FAMILIES, build_convs, build_heads, draft_offset, family_of, family_value
from flashdraft.drafter.mask_token import choose_mask_token_id
from flashdraft.hub import NO_HUB_KERNELS
from flashdraft.io.atomic import atomic_directory

logger = logging.getLogger(__name__)

# Keyword arguments the reference forward accepts and that change nothing here; anything else is a caller's bug.
_INERT_KWARGS = frozenset({"cache_position", "output_attentions", "output_hidden_states", "return_dict"})
# What a serving layout carries beside the drafter (DeepSpec's: copies of the target's embedding and LM head).
_SERVING_COPIES = ("embed_tokens.weight", "lm_head.weight")


def select_context_features(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """Concatenate the target's hidden states of `target_layer_ids` → (B, T, n * D).

    `hidden_states` is transformers' `output_hidden_states` tuple: index 0 is the embedding output, so the
    output of layer i is `hidden_states[i + 1]`.
    """
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


class DFlashDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv, self.mlp_conv = build_convs(config)  # DFlash2's (conv.py), else None

    def forward(self, hidden_states: torch.Tensor, *attention_args, **attention_kwargs) -> torch.Tensor:
        """The attention, then the MLP, each around a residual (inside it, a family's convolutions); takes
        `DFlashAttention.forward`'s arguments."""
        # The context was normed once by hidden_norm; it bypasses input_layernorm and goes straight to k/v_proj.
        attention = lambda x: self.self_attn(x, *attention_args, **attention_kwargs)  # noqa: E731
        hidden_states = hidden_states + around(self.attention_conv, attention, self.input_layernorm(hidden_states))
        return hidden_states + around(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash block drafter (see the module docstring); loads and saves the reference `dflash` format."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        validate_draft_config(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Before post_init, which initialises them (the selector's codebooks excepted: selector.py).
        self.markov_head, self.confidence_head, self.candidate_selector = build_heads(config)
        self.post_init()

    # ---- what a caller needs to know -------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return int(draft_value(self.config, "block_size"))

    @property
    def mask_token_id(self) -> int:
        return int(draft_value(self.config, "mask_token_id"))

    @property
    def target_layer_ids(self) -> list[int]:
        return list(draft_value(self.config, "target_layer_ids"))

    @property
    def num_target_layers(self) -> int:
        return int(draft_value(self.config, "num_target_layers"))

    @property
    def family(self) -> str:
        return family_of(self.config)

    @property
    def draft_offset(self) -> int:
        """Slot k of a block drafts the token at anchor + k + draft_offset (`families.py`)."""
        return draft_offset(self.config)

    @property
    def chains(self) -> bool:
        """Whether its drafts are picked left to right, each after the one before it (`walk`): DSpark's Markov head,
        DFlash2's selector."""
        return self.markov_head is not None or self.candidate_selector is not None

    @property
    def num_drafts(self) -> int:
        """Drafts per block: block_size - 1, or block_size when the anchor's slot drafts too."""
        return self.block_size - 1 + self.draft_offset

    # ---- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target_config: PreTrainedConfig,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        tokenizer=None,
        family: str = "dflash",
        family_fields: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> DFlashDraftModel:
        """A freshly initialised drafter of `family` sized from the target's (text) config; see
        `draft_config_from_target`.

        `target_layer_ids` default to `num_layers` ids spread over the target (`build_target_layer_ids`);
        `mask_token_id` defaults to `choose_mask_token_id(target_config, tokenizer)`. `overrides` replace
        `Qwen3Config` fields (e.g. `intermediate_size`, `layer_types=[...], sliding_window=2048`).
        Build inside `with torch.device("meta"):` to get the shapes without allocating.
        """
        mask_token_id, reason = choose_mask_token_id(target_config, tokenizer, mask_token_id=mask_token_id)
        logger.info("drafter mask token: %s", reason)
        config = draft_config_from_target(
            target_config,
            num_layers=num_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            family=family,
            family_fields=family_fields,
            **overrides,
        )
        return cls(config)

    # ---- forward ---------------------------------------------------------------------------------------------

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | BlockMask | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Draft hidden states of one block (or of many packed blocks, with a mask) → (B, Q, D), final-normed.

        Args:
            position_ids: (B or 1, T + Q) positions of the new context tokens then of the block tokens.
            attention_mask: None, or a boolean mask broadcastable to (B, heads, Q, K), True = attend, where the K
                keys are the cached context, then the T new context tokens, then the Q block tokens, or the same
                pattern as a FlexAttention `BlockMask` (GPU training; see `attend`). When given, it replaces the
                layers' own causal / sliding-window rule (callers fold those in themselves). None: full-attention
                layers see everything, sliding layers use `structural_mask`.
            noise_embedding: (B, Q, D) block token embeddings from the target's input embedding.
            target_hidden: (B, T, n * D) context features (`select_context_features`) of the T tokens not yet
                in the cache.
            past_key_values: a transformers Cache; the context *and* block K/V are appended to it, so after
                each draft crop it back to the context length (`cache.crop(n_context)`), as the reference does.
            use_cache: accepted for signature compatibility; caching happens whenever `past_key_values` is given.
        """
        unexpected = set(kwargs) - _INERT_KWARGS
        if unexpected:
            raise TypeError(f"DFlashDraftModel.forward got unexpected arguments {sorted(unexpected)}")
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding (B, Q, D) and target_hidden (B, T, n*D)")
        expected = self.fc.in_features
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features per token, expected {expected} "
                f"({len(self.target_layer_ids)} target layers x hidden_size {self.config.hidden_size})"
            )
        total = target_hidden.shape[1] + noise_embedding.shape[1]
        if position_ids.shape[-1] != total:
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} tokens, expected {total} "
                f"(target_hidden {target_hidden.shape[1]} + noise_embedding {noise_embedding.shape[1]})"
            )
        context = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(
                hidden,
                context,
                position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
            )
        return self.norm(hidden)

    def draft_logits(
        self, hidden: torch.Tensor, lm_head: nn.Module | torch.Tensor, prev: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of drafting slots hidden (..., K, D), teacher-forced: with a Markov head, each with the bias of
        the true token before its draft, `prev` (..., K) (the anchor, then the labels) -> (..., K, V)."""
        logits = self.compute_logits(hidden, lm_head)
        return logits if self.markov_head is None else logits + self.markov_head.block_bias(prev, hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The confidence head's logits (..., K) of drafting slots hidden (..., K, D) after tokens prev (..., K)."""
        with_markov = family_value(self.config, "confidence_head_with_markov")
        return self.confidence_head(hidden, self.markov_head.embed(prev, hidden) if with_markov else None)

    def walk(self, hidden: torch.Tensor, lm_head: nn.Module | torch.Tensor, first: torch.Tensor, pick) -> tuple:
        """Draft the K slots hidden (K, D) after the token `first` (0-d): `pick(k, logits) -> token` (0-d: argmax
        or a draw) chooses each; with a Markov head or a selector, left to right (`MarkovHead.walk`,
        `CandidateSelector.walk`). Returns (drafts (K,), logits (K, V) as picked from). Device operations only
        (CUDA-graph safe)."""
        base = self.compute_logits(hidden, lm_head)
        if self.candidate_selector is not None:
            return self.candidate_selector.walk(base, hidden, first, pick)
        if self.markov_head is not None:
            return self.markov_head.walk(base, hidden, first, pick)
        return torch.stack([pick(k, base[k]) for k in range(base.shape[0])]), base

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module | torch.Tensor) -> torch.Tensor:
        """Logits of drafter hidden states through the target's LM head (a module, or its (V, D) weight).

        Honours `output_multiplier` and `final_logit_softcapping` when a (reference) config sets them.
        """
        logits = F.linear(hidden, lm_head) if isinstance(lm_head, torch.Tensor) else lm_head(hidden)
        multiplier = draft_value(self.config, "output_multiplier")
        if multiplier is not None:
            logits = logits * float(multiplier)
        softcap = draft_value(self.config, "final_logit_softcapping")
        if softcap is not None and float(softcap) > 0:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits

    # ---- checkpoints -----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any):
        """Load a drafter checkpoint (ours or the reference's) from safetensors only — never by unpickling.

        A hub id is read from the hub cache; it is downloaded only when `local_files_only=False` or HF_HUB_OFFLINE=0
        (see `flashdraft.hub.resolve_local_files_only`). Errors name the directory or its config.json.
        """
        from flashdraft.hub import check_checkpoint, resolve_model_dir

        if kwargs.get("use_safetensors") is False:
            raise ValueError("DFlashDraftModel loads safetensors only; use_safetensors=False is not supported")
        path = resolve_model_dir(
            pretrained_model_name_or_path,
            what="drafter",
            local_files_only=kwargs.pop("local_files_only", None),
            revision=kwargs.pop("revision", None),
        )
        check_checkpoint(path, what="drafter")
        kwargs["use_safetensors"] = True
        config = kwargs.get("config")
        if config is None:
            config = Qwen3Config.from_pretrained(path)
            kwargs["config"] = config
            where = path / "config.json"
            try:
                family_of(config)
                validate_draft_config(config)
            except ValueError as err:
                problem = str(err)
                if draft_value(config, "block_size") is None and draft_value(config, "target_layer_ids") is None:
                    problem = (
                        f"not a DFlash drafter (no block_size, no dflash_config; architectures "
                        f"{getattr(config, 'architectures', None)}): is this the target?"
                    )
                raise ValueError(f"{where}: {problem}") from None
        info_wanted = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(path, *args, **{**NO_HUB_KERNELS, **kwargs}, output_loading_info=True)
        # transformers would initialise a missing weight at random: a damaged checkpoint, or another family's.
        missing = sorted(info.get("missing_keys") or [])
        unexpected = sorted(set(info.get("unexpected_keys") or []) - set(_SERVING_COPIES))
        if missing or unexpected:
            raise ValueError(
                f"{path}: not the weights its config.json describes (a {family_of(model.config)} drafter): "
                + "; ".join(
                    f"{what} {names[:6]}" for what, names in (("missing", missing), ("extra", unexpected)) if names
                )
            )
        return (model, info) if info_wanted else model

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write `config.json` + `model.safetensors` in the reference format, atomically (see `atomic_directory`)."""
        if kwargs.pop("push_to_hub", False):
            raise ValueError("push_to_hub is not supported here: save, then upload the directory")
        with atomic_directory(save_directory) as tmp:
            self.write_checkpoint(tmp, **kwargs)

    def write_checkpoint(self, directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the checkpoint files into an existing `directory`, in place (not atomic)."""
        family = self.family
        if family == "dflash":
            self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(directory, **kwargs)
        # transformers writes the class name; a family keeps its own architecture.
        self.config.architectures = [FAMILIES[family].architecture]
        self.config.save_pretrained(directory)
