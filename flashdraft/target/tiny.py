"""Randomly initialised models: tiny ones of every target family flashdraft supports (for tests, `flashdraft doctor`
and examples), and the first layers of a real model's config (`flashdraft doctor --model`). Nothing is loaded.

Each tiny family has the real architecture (for hybrids: linear-attention layers and full-attention layers in the
3:1 pattern of Qwen3.5) at a size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

import os

import torch

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
ALL_FAMILIES = (*HYBRID_FAMILIES, "qwen3")


# What every tiny family shares: 4 query heads and 2 key/value heads of 16 dimensions.
_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def _hybrid_kwargs(num_layers: int, vocab_size: int) -> dict:
    return dict(
        _TINY,
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4)
        + ["linear_attention"] * (num_layers % 4),
    )


_TINY_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def tiny_config(family: str = "qwen3_5", num_layers: int = 4, vocab_size: int = 256, **overrides):
    """A tiny transformers text config of `family` (one of ALL_FAMILIES)."""
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**_hybrid_kwargs(num_layers, vocab_size), intermediate_size=128)
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(**_hybrid_kwargs(num_layers, vocab_size), **_TINY_MOE)
    elif family == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(**_hybrid_kwargs(num_layers, vocab_size), intermediate_size=128, **_TINY_MOE)
    elif family == "qwen3":
        from transformers import Qwen3Config

        cfg = Qwen3Config(**_TINY, vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers)
    else:
        raise ValueError(f"unknown target family {family!r}; expected one of {', '.join(ALL_FAMILIES)}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def random_tiny_model(
    family: str = "qwen3_5",
    num_layers: int = 4,
    vocab_size: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    **overrides,
):
    """A randomly initialised tiny causal LM of `family`, in eval mode.

    The fast path is *not* enabled here: callers decide (tests compare both).
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, num_layers, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


def random_model_like(path: str | os.PathLike, num_layers: int, device: str | torch.device, dtype: torch.dtype):
    """The first `num_layers` layers of the model that a config.json or model directory describes, randomly
    initialised (its weights are not read), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(path)
    if os.path.isfile(path):
        config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)) or ".")
    elif os.path.isdir(path):
        config = AutoConfig.from_pretrained(path)
    else:
        raise FileNotFoundError(f"{path!r}: not a config.json or model directory")
    config = config.get_text_config()
    n = min(num_layers, config.num_hidden_layers)
    config.num_hidden_layers = n
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
