"""Ship a tiny-target drafter as the package's bundled default (flashdraft/bundled/).

    python examples/tiny_target/ship.py --drafter build/tiny_target/drafter_run/checkpoints/step_00003044/drafter
    python examples/tiny_target/ship.py --drafter-only --drafter runs/finetune/checkpoints/step_00001000/drafter

Writes, each replaced atomically:
  drafter/      the drafter in bf16 (config + safetensors): what `flashdraft train` fine-tunes and `flashdraft eval`
                falls back to;
  train.jsonl   a seeded sample of the regenerated rows, T=0 and T=1 (what the bundled default trains on, on a CPU);
  eval.jsonl    the held-out prompts (files neither the target nor the drafter saw).
--drafter-only replaces the drafter and keeps the shipped rows and prompts (a drafter fine-tuned from the shipped one).
The target and tokenizer are not touched: they ship from examples/tiny_target/train_target.py's run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "flashdraft" / "bundled"


def _replace(path: Path, write) -> None:
    """`write(tmp)` fills a temporary sibling of `path`, which then replaces it (a file or a directory)."""
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        target = tmp / path.name
        write(target)
        if path.is_dir():
            shutil.rmtree(path)
        target.replace(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ship_drafter(drafter: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((drafter / "config.json").read_text())
    weights = {}
    for file in sorted(drafter.glob("*.safetensors")):
        weights.update(load_file(file))
    if not weights:
        raise SystemExit(f"{drafter}: no *.safetensors weights")
    config["dtype"] = config["torch_dtype"] = "bfloat16"

    def write(tmp: Path) -> None:
        tmp.mkdir()
        save_file(
            {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "model.safetensors").chmod(0o644)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    _replace(out, write)


def sample_rows(paths: list[Path], per_file: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for path in paths:
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
        if len(lines) < per_file:
            raise SystemExit(f"{path}: {len(lines)} rows, fewer than the {per_file} to ship")
        rows += [{"prompt": r["prompt"], "response": r["response"]} for r in rng.sample(lines, per_file)]
    return rows


def write_jsonl(rows: list[dict], out: Path) -> None:
    _replace(out, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in rows)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, required=True, help="a drafter directory (config.json + safetensors)")
    p.add_argument("--build", type=Path, default=Path("build/tiny_target"))
    p.add_argument("--rows", type=int, default=384, help="rows sampled from each of regen_t0.jsonl, regen_t1.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter-only", action="store_true", help="replace the drafter only; keep train.jsonl, eval.jsonl")
    p.add_argument("--out", type=Path, default=ASSETS)
    a = p.parse_args(argv)
    ship_drafter(a.drafter, a.out / "drafter")
    if a.drafter_only:
        print(f"shipped {a.drafter} (bf16) -> {a.out / 'drafter'}")
        return
    rows = sample_rows([a.build / "regen_t0.jsonl", a.build / "regen_t1.jsonl"], a.rows, a.seed)
    write_jsonl(rows, a.out / "train.jsonl")
    held = [json.loads(line) for line in open(a.build / "corpus" / "heldout_prompts.jsonl") if line.strip()]
    write_jsonl(held, a.out / "eval.jsonl")
    print(f"shipped {a.drafter} (bf16), {len(rows)} training rows and {len(held)} held-out prompts -> {a.out}")


if __name__ == "__main__":
    main()
