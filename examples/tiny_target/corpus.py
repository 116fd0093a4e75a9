"""The tiny target's corpus: the Python standard library's own source files, split by file, tokenised once.

    python examples/tiny_target/corpus.py --out build/tiny_target/corpus

Every machine with Python has this text offline. Files are split by a hash of their path: ~90% train the target
(and give the drafter's regeneration prompts), ~10% are held out from both and give the evaluation prompts.
Writes:
  train.u16 / heldout.u16   token ids (uint16, flat, one <|endoftext|> between files) for the target's training
  drafter_prompts.jsonl     {"prompt"} code windows from training files, for `flashdraft regenerate` (T=0)
  drafter_prompts_t1.jsonl  with --t1-prompts-per-file: other windows of the same files, for the T=1 regeneration
  heldout_prompts.jsonl     {"prompt", "category"} code prefixes from held-out files, for `flashdraft eval`
  files.json                which file went where, the Python version and the token counts
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import sysconfig
from pathlib import Path

import numpy as np

# Package trees that are tests, GUIs or vendored data rather than ordinary library code.
EXCLUDED_PARTS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "dist-packages",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "__pycache__",
    "tkinter",
}
HELDOUT_PERCENT = 10


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in EXCLUDED_PARTS or p.startswith("test") for p in parts):
            continue
        files.append(path)
    return files


def is_heldout(relative: str) -> bool:
    """Stable across machines and Python versions: a file's split depends only on its relative path."""
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def code_windows(
    text: str, rng: random.Random, count: int, length: int, taken: set[int] | None = None
) -> tuple[list[str], set[int]]:
    """`count` windows of `length` characters starting at line starts (so prompts look like code, not noise), none
    starting where a window in `taken` did; returns the windows and their starts."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text) - length]
    starts = [s for s in starts if s + length <= len(text) and s not in (taken or ())]
    if not starts:
        return [], set()
    chosen = rng.sample(starts, min(count, len(starts)))
    return [text[s : s + length] for s in chosen], set(chosen)


def build(
    out: Path,
    tokenizer_dir: Path,
    prompts_per_file: int,
    heldout_prompts: int,
    prompt_chars: int,
    seed: int,
    t1_prompts_per_file: int = 0,
) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    root = Path(sysconfig.get_paths()["stdlib"])
    # One stream per split, so the held-out prompts (the evaluation set) stay the same whatever --prompts-per-file is,
    # and the T=0 prompts whatever --t1-prompts-per-file is.
    drafter_rng, held_rng = random.Random(f"{seed}/drafter"), random.Random(f"{seed}/heldout")
    t1_rng = random.Random(f"{seed}/drafter-t1")
    out.mkdir(parents=True, exist_ok=True)
    split = {"train": [], "heldout": []}
    tokens = {"train": [], "heldout": []}
    drafter, drafter_t1, held = [], [], []
    for path in stdlib_files(root):
        relative = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < 2 * prompt_chars:
            continue
        name = "heldout" if is_heldout(relative) else "train"
        split[name].append(relative)
        tokens[name].extend(tok.encode(text).ids + [eos])
        if name == "train":
            windows, taken = code_windows(text, drafter_rng, prompts_per_file, prompt_chars)
            drafter += [{"prompt": w, "source": relative} for w in windows]
            if t1_prompts_per_file:
                windows, _ = code_windows(text, t1_rng, t1_prompts_per_file, prompt_chars, taken)
                drafter_t1 += [{"prompt": w, "source": relative} for w in windows]
        else:
            windows, _ = code_windows(text, held_rng, 2, prompt_chars)
            held += [{"prompt": w, "category": "stdlib-heldout", "source": relative} for w in windows]
    drafter_rng.shuffle(drafter)
    t1_rng.shuffle(drafter_t1)
    held_rng.shuffle(held)
    for name, ids in tokens.items():
        np.asarray(ids, dtype=np.uint16).tofile(out / f"{name}.u16")
    with open(out / "drafter_prompts.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in drafter)
    if t1_prompts_per_file:
        with open(out / "drafter_prompts_t1.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in drafter_t1)
    with open(out / "heldout_prompts.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in held[:heldout_prompts])
    info = {
        "python": sys.version.split()[0],
        "tokens": {k: len(v) for k, v in tokens.items()},
        "files": split,
        "drafter_prompts": len(drafter),
        "drafter_prompts_t1": len(drafter_t1),
        "heldout_prompts": min(heldout_prompts, len(held)),
        "seed": seed,
    }
    (out / "files.json").write_text(json.dumps(info, indent=1))
    return info


def main(argv: list[str] | None = None) -> None:
    default_tok = Path(__file__).resolve().parents[2] / "flashdraft" / "bundled" / "tokenizer"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/tiny_target/corpus"))
    p.add_argument("--tokenizer", type=Path, default=default_tok)
    p.add_argument("--prompts-per-file", type=int, default=40, help="drafter prompts per training file (T=0)")
    p.add_argument(
        "--t1-prompts-per-file",
        type=int,
        default=0,
        help="also write drafter_prompts_t1.jsonl: this many other windows per file, for the T=1 regeneration",
    )
    p.add_argument("--heldout-prompts", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.prompts_per_file < 1 or a.t1_prompts_per_file < 0:
        p.error("--prompts-per-file must be >= 1 and --t1-prompts-per-file >= 0")
    info = build(
        a.out, a.tokenizer, a.prompts_per_file, a.heldout_prompts, a.prompt_chars, a.seed, a.t1_prompts_per_file
    )
    print(
        f"corpus from Python {info['python']}: {info['tokens']['train']:,} train tokens "
        f"({len(info['files']['train'])} files), {info['tokens']['heldout']:,} held-out tokens "
        f"({len(info['files']['heldout'])} files); {info['drafter_prompts']} drafter prompts, "
        f"{info['drafter_prompts_t1']} T=1 drafter prompts, {info['heldout_prompts']} held-out prompts -> {a.out}"
    )


if __name__ == "__main__":
    main()
