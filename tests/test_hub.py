"""Where models come from: no Hub kernels swapped in at load time (transformers 5.25+ does so by default)."""

import torch

from flashdraft import bundled
from flashdraft.drafter import DFlashDraftModel
from flashdraft.target import load_causal_lm, load_frozen_target


def test_loaded_models_are_not_kernelized():
    """transformers 5.25+ kernelizes a loaded model when the `kernels` package is installed (fetching kernels from
    the Hub, replacing layers); every flashdraft loader turns that off, so the proven fast path is what runs."""
    target = load_causal_lm(bundled.BUNDLED, dtype=torch.float32, device="cpu")
    assert not getattr(target, "use_kernels", False)
    drafter = DFlashDraftModel.from_pretrained(bundled.drafter_dir())
    assert not getattr(drafter, "use_kernels", False)
    frozen = load_frozen_target(bundled.BUNDLED, layer_ids=[1, 3], device="cpu")
    assert not getattr(frozen.model, "use_kernels", False)
