"""Train the tiny hybrid target that ships as flashdraft's bundled default (an H200 in under 5 minutes).

    python examples/tiny_target/train_target.py --corpus build/tiny_target/corpus --out build/tiny_target/target

A Qwen3.5-architecture causal LM (Gated DeltaNet linear-attention layers and gated full-attention layers, 3:1)
small enough to ship in the package (≤ 15 MB in bf16), trained on the standard library's source (corpus.py) with
the bundled BPE tokenizer. Random windows of `--seq` tokens, AdamW, cosine schedule, bf16 autocast with float32
master weights; held-out loss every `--eval-every` steps. Writes a Hugging Face directory (config, bf16 safetensors,
tokenizer), metrics.jsonl and loss_curve.png. `--smoke` runs a few CPU-sized steps to check the script.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

TOKENIZER = Path(__file__).resolve().parents[2] / "flashdraft" / "bundled" / "tokenizer"


def target_config(vocab_size: int):
    from transformers import Qwen3_5TextConfig

    layers = 8
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def padded_vocab(n: int) -> int:
    # Spare rows after the tokenizer's ids, as real checkpoints have: the drafter's mask token lives there.
    return (n // 64 + 1) * 64


def windows(tokens: np.ndarray, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
    return torch.stack([torch.from_numpy(tokens[s : s + seq].astype(np.int64)) for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, tokens: np.ndarray, seq: int, device, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1)
    model.eval()
    losses = []
    for _ in range(batches):
        ids = windows(tokens, 16, seq, gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine to 10% over `progress` in [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [r for r in rows if "loss" in r]
    held = [r for r in rows if "heldout_loss" in r]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    ax.plot([r["step"] for r in held], [r["heldout_loss"] for r in held], "o-", label="held-out loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tiny hybrid Qwen3.5 target on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=Path("build/tiny_target/corpus"))
    p.add_argument("--out", type=Path, default=Path("build/tiny_target/target"))
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--max-minutes", type=float, default=4.5, help="stop early (and say so) past this wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a few tiny CPU steps: checks the script, not the model")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.batch, a.seq, a.warmup, a.eval_every = 6, 2, 64, 2, 3

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashdraft import fastpath
    from flashdraft.fastpath import backends

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    train_tokens = np.fromfile(a.corpus / "train.u16", dtype=np.uint16)
    held_tokens = np.fromfile(a.corpus / "heldout.u16", dtype=np.uint16)
    torch.manual_seed(a.seed)
    config = target_config(padded_vocab(len(tokenizer)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    report = fastpath.enable(model, strict=device.type == "cuda")
    params = sum(t.numel() for t in model.parameters())
    problem = backends.fla_chunk_backward_problem() if device.type == "cuda" else ""
    if problem:
        print(f"delta rule backward: transformers' torch chunk ({problem.removeprefix('fallback: ')})")
    print(
        f"target: {params / 1e6:.2f}M parameters ({params * 2 / 2**20:.1f} MiB in bf16), fast path: {report.summary()}"
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    rows, start, tokens_seen, stopped_early, step = [], time.perf_counter(), 0, False, 0
    best = (float("inf"), 0, None)
    model.train()
    for step in range(a.steps):
        # The schedule runs over whichever ends first, the steps or the time budget, so a slower GPU still
        # finishes its cosine instead of being cut off at a high learning rate.
        progress = max(step / a.steps, (time.perf_counter() - start) / (a.max_minutes * 60))
        if progress >= 1.0:
            stopped_early = step < a.steps
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, progress, a.lr, a.warmup)
        ids = windows(train_tokens, a.batch, a.seq, gen).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += ids.numel()
        if (step + 1) % 25 == 0 or step == 0:
            elapsed = time.perf_counter() - start
            rows.append(
                {
                    "step": step + 1,
                    "loss": float(loss.detach()),
                    "lr": optimizer.param_groups[0]["lr"],
                    "elapsed_s": elapsed,
                    "tok_s": tokens_seen / elapsed,
                }
            )
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            held = heldout_loss(model, held_tokens, a.seq, device)
            rows.append({"step": step + 1, "heldout_loss": held})
            if held < best[0]:  # keep the weights of the best held-out loss (a 4 M-token corpus overfits)
                best = (held, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
            print(
                f"step {step + 1}/{a.steps}  loss {float(loss.detach()):.3f}  held-out {held:.3f}  "
                f"{tokens_seen / (time.perf_counter() - start):,.0f} tok/s",
                flush=True,
            )
    else:
        step += 1
    if stopped_early:
        print(f"stopped at step {step}: the --max-minutes {a.max_minutes} budget ended the schedule")
    if rows[-1].get("step") != step or "heldout_loss" not in rows[-1]:
        held = heldout_loss(model, held_tokens, a.seq, device)
        rows.append({"step": step, "heldout_loss": held})
        if held < best[0]:
            best = (held, step, None)
    elapsed = time.perf_counter() - start
    if best[2] is not None:
        model.load_state_dict(best[2])
    print(f"kept the weights of step {best[1]} (held-out loss {best[0]:.3f})")
    model.to(torch.bfloat16).save_pretrained(a.out, safe_serialization=True)
    tokenizer.save_pretrained(a.out)
    with open(a.out / "metrics.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    plot(rows, a.out / "loss_curve.png")
    summary = {
        "params": params,
        "steps": step,
        "seconds": elapsed,
        "tokens": tokens_seen,
        "stopped_early": stopped_early,
        "final_heldout_loss": rows[-1].get("heldout_loss"),
        "kept_step": best[1],
        "kept_heldout_loss": best[0],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    (a.out / "training_summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"trained {step} steps in {elapsed:.0f} s ({tokens_seen:,} tokens); held-out loss "
        f"{best[0]:.3f} (step {best[1]}); wrote {a.out}"
    )
    if device.type == "cuda":
        shutil.copy(a.out / "loss_curve.png", a.out.parent / "target_loss_curve.png")


if __name__ == "__main__":
    main()
