"""The bundled default: what `flashdraft train` and `flashdraft eval` use with no arguments (offline, CPU-sized).

This module only says where its files are; `flashdraft.target.load` loads the target (`load_causal_lm(BUNDLED)`)
like any other, and imports no torch here: `flashdraft train` reads its config (and takes the output directory's
lock) before torch loads, so a second run on a busy directory stops at once.

Everything ships in flashdraft/bundled, made by examples/tiny_target (how: its README):
- target/: a *trained* tiny hybrid Qwen3.5 (8 layers: 6 Gated DeltaNet + 2 gated attention, hidden 256, 6.74M
  parameters, bf16), trained on the Python standard library's source (held-out loss 1.77 nats/token), with its own
  MTP head (`mtp.*` tensors, as Qwen3.5 checkpoints ship it; flashdraft.target.mtp reads it);
- tokenizer/: its byte-level BPE (1024 tokens; examples/tiny_target/build_tokenizer.py);
- drafter/: a 3-layer DFlash drafter (block 16) trained on continuations the target wrote itself;
- train.jsonl: 768 of those regenerated {"prompt", "response"} pairs (T=0 and T=1), for fine-tuning on a CPU;
- eval.jsonl: 64 code prefixes from stdlib files the target never saw.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
BUNDLED = "bundled"
DEFAULT_RUN = Path("runs/default")  # where `flashdraft train` (no arguments) writes


def tokenizer_dir() -> Path:
    return ASSETS / "tokenizer"


def train_data() -> list[str]:
    return [str(ASSETS / "train.jsonl")]


def eval_prompts() -> Path:
    return ASSETS / "eval.jsonl"


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir())


def target_dir() -> Path:
    return ASSETS / "target"


def drafter_dir() -> Path:
    return ASSETS / "drafter"
