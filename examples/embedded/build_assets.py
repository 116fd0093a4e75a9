"""Build the embedded default's tokenizer and data from the Python standard library (offline, deterministic).

    python examples/embedded/build_assets.py        # writes flashdraft/assets/embedded/

- tokenizer/: a byte-level BPE (vocabulary 1024) trained on 40 stdlib modules, with a Qwen-style chat template;
- train.jsonl: {"prompt", "response"} pairs cut from 40 other modules (prompt: 256 characters of code, response:
  the next 256);
- eval.jsonl: {"prompt", "category"} code prefixes from 16 further modules never used for training.
The embedded target is a seeded random tiny Qwen3.5 (flashdraft.embedded) until a trained one ships (issue 6).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OUT = Path(__file__).resolve().parents[2] / "flashdraft" / "assets" / "embedded"


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 8000)
    tok_files, train_files, eval_files = files[:40], files[40:80], files[80:96]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train([str(f) for f in tok_files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(OUT / "tokenizer")

    with open(OUT / "train.jsonl", "w") as fh:
        for f in train_files:
            text = f.read_text(errors="replace")
            for start in range(0, min(len(text), 6000) - 512, 512):
                fh.write(json.dumps({"prompt": text[start : start + 256], "response": text[start + 256 : start + 512]}) + "\n")
    with open(OUT / "eval.jsonl", "w") as fh:
        for f in eval_files:
            fh.write(json.dumps({"prompt": f.read_text(errors="replace")[:256], "category": "stdlib-code"}) + "\n")
    print("wrote", OUT, "files from", [p.name for p in train_files[:3]], "...")


if __name__ == "__main__":
    main()
