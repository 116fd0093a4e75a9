"""Build the bundled tokenizer from the Python standard library (offline, deterministic).

    python examples/tiny_target/build_tokenizer.py        # writes flashdraft/bundled/tokenizer/

A byte-level BPE (vocabulary 1024) trained on the first 40 stdlib modules over 8 kB, with a Qwen-style chat
template. The rest of flashdraft/bundled/ comes from examples/tiny_target/ (its README says how): the trained
target (train_target.py) and, from ship.py, the drafter, `train.jsonl` (rows the target regenerated) and
`eval.jsonl` (held-out prompts).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OUT = Path(__file__).resolve().parents[2] / "flashdraft" / "bundled"


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 8000)
    tok_files = files[:40]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(f) for f in tok_files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(OUT / "tokenizer")

    print("wrote", OUT / "tokenizer", "from", [p.name for p in tok_files[:3]], "...")


if __name__ == "__main__":
    main()
