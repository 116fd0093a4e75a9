"""What offline training has of the target instead of running it (flashdraft.data.features)."""

from __future__ import annotations

import torch
from torch import nn


class HeadTarget:
    """The target as offline training needs it: config, captured layer ids, embedding and LM head; no layers."""

    def __init__(self, config, target_layer_ids: list[int], embed: torch.Tensor, lm_head: torch.Tensor, name=None):
        self.config = config
        self.target_layer_ids = list(target_layer_ids)
        self.num_target_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.name_or_path = name
        self.model = nn.Module()  # holds the two weights; no target FLOPs are counted (there is no forward)
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.model.lm_head = nn.Parameter(lm_head, requires_grad=False)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def capture(self, *args, **kwargs):
        raise RuntimeError("offline training reads the features (FeatureStore.batch); there is no target to run")
