"""The DFlash drafter: model (reference `dflash` checkpoint format), its config and the mask-token choice."""

from flashdraft.drafter.config import build_target_layer_ids, draft_config_from_target, validate_draft_config
from flashdraft.drafter.mask_token import choose_mask_token_id
from flashdraft.drafter.model import DFlashDraftModel, select_context_features

__all__ = [
    "DFlashDraftModel",
    "build_target_layer_ids",
    "choose_mask_token_id",
    "draft_config_from_target",
    "select_context_features",
    "validate_draft_config",
]
