"""The embedded default: what `flashdraft train` and `flashdraft eval` use with no arguments (offline, CPU-sized).

A byte-level BPE tokenizer and code data cut from the Python standard library ship in flashdraft/assets/embedded
(built by examples/embedded/build_assets.py). The target is a tiny hybrid Qwen3.5 (3 linear-attention layers to 1
full-attention layer) with *seeded random* weights, built on the fly: it exercises every piece of the recipe, but
its hidden states carry no learned knowledge, so the τ measured against it is a plumbing check, not a quality figure.
"""

from __future__ import annotations

from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent / "assets" / "embedded"
EMBEDDED = "embedded"
DEFAULT_RUN = Path("runs/default")  # where `flashdraft train` (no arguments) writes; `flashdraft eval` reads it
TARGET_LAYERS = 8
TARGET_SEED = 1234
INIT_RANGE = 0.2


def tokenizer_dir() -> Path:
    return ASSETS / "tokenizer"


def train_data() -> list[str]:
    return [str(ASSETS / "train.jsonl")]


def eval_prompts() -> Path:
    return ASSETS / "eval.jsonl"


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir())


def build_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The embedded target: tiny Qwen3.5 (8 layers, hidden 64) over the embedded tokenizer's vocabulary.

    Its linear-attention layers already run flashdraft's device-aware fast path (unprobed; `fastpath.probe`
    proves it): on a CPU, transformers alone would pick fla's GPU-only kernels when fla is installed.
    """
    from flashdraft import fastpath
    from flashdraft.tiny_configs import build_tiny_target

    vocab = len(load_tokenizer())
    # Round the vocabulary up as real checkpoints do: the spare embedding rows give the mask token a home.
    padded = (vocab + 63) // 64 * 64 + (64 if (vocab + 63) // 64 * 64 == vocab else 0)
    # A wider initialisation than transformers' 0.02 gives the frozen LM head a logit range a drafter can use
    # (with 0.02 at width 64 every logit stays within ~0.2). A random 64-wide head still cannot express a token
    # distribution well: this target demonstrates the pipeline, not drafter quality (a trained one is issue 6).
    model = build_tiny_target("qwen3_5", num_layers=TARGET_LAYERS, vocab_size=padded, dtype=dtype, seed=TARGET_SEED,
                              device=device, initializer_range=INIT_RANGE)  # fmt: skip
    fastpath.enable(model, strict=False, run_probe=False)
    return model
