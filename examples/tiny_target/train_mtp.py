"""Train the bundled target's MTP head on a CPU and ship it in the target's checkpoint.

    python examples/tiny_target/corpus.py --out build/tiny_target/corpus      # once: the standard library's tokens
    nice python examples/tiny_target/train_mtp.py --corpus build/tiny_target/corpus --ship

The head is what Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints ship (flashdraft.target.mtp): one decoder layer of the
target's own kind over fc([norm(embedding of token t + 1); norm(the target's final hidden state at t)]), then a
norm and the target's LM head (shared, not trained), trained with the target frozen. Serving chains the layer:
its second and later drafts read its own previous output instead of the target's hidden state. Qwen (the
Qwen3-Next release) describe training their MTP for that multi-step use, and FastMTP (Cai et al. 2025) trains one
shared layer applied recursively; so does this script (`--chain`, default 3 = `flashdraft eval --mtp-drafts`): the loss is a weighted
sum over steps k = 1 .. K of the cross-entropy of step k's logits at t against token t + k + 1, weights
`--chain-decay`^(k-1) (a later draft only counts when the earlier ones were accepted), computed for every anchor
at once by `flashdraft.target.mtp.chained`, which attends as the serving cache does. `--chain 1` is the one-step
objective (cross-entropy at t against token t + 2).

Data (seeded): the last `--seq` tokens of each regenerated row (`--rows`, default bundled/train.jsonl: the
target's own continuations at T=0 and T=1 of training-file prompts; more files: e.g. a `flashdraft regenerate`
output of the bundled target) and `--windows` random windows of the standard library's training files
(train.u16, what the target was trained on). The target's final-normed hidden states are
computed once, by flashdraft's engine, and cached in `--out` (target_states.safetensors, reused while the data
arguments stay the same). Held out: windows of heldout.u16 (files neither the target nor its drafter saw);
reported there: the loss, and the agreement per step — how often step k's argmax at t equals the target's own
argmax at t + k, which is draft k's acceptance rate at T=0 when the drafts before it were right.

Prints the loss curve; writes metrics.jsonl, summary.json and the head (mtp_head.safetensors, bf16) to `--out`.
`--ship` writes the head (bf16) into the bundled target's model.safetensors as `mtp.*` tensors and sets
`mtp_num_hidden_layers: 1` in its config.json (`flashdraft.target.mtp.write_mtp`), the layout the loader reads from
real checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from flashdraft import bundled
from flashdraft.speculative.engine.target_runner import TargetEngine
from flashdraft.target import load_causal_lm
from flashdraft.target.mtp import MTPHead, chained, write_mtp


def row_windows(tokenizer, seq: int, files: list[Path]) -> list[list[int]]:
    """The last `seq` tokens of each regenerated row (prompt + the target's continuation) long enough to have them."""
    windows = []
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            ids = tokenizer(row["prompt"] + row["response"], add_special_tokens=False)["input_ids"]
            if len(ids) >= seq:
                windows.append(ids[-seq:])
    return windows


def corpus_windows(tokens: np.ndarray, count: int, seq: int, gen: torch.Generator) -> list[list[int]]:
    starts = torch.randint(0, len(tokens) - seq, (count,), generator=gen).tolist()
    return [tokens[s : s + seq].astype(np.int64).tolist() for s in starts]


@torch.inference_mode()
def target_states(target, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """ids (N, T), final-normed hidden states (N, T, D) and the target's argmax at each position (N, T)."""
    engine = TargetEngine(target, max_len=len(windows[0]), block_size=2)
    hidden = []
    # One thread: the token-by-token loop is launch-bound, and a second thread only spins on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    for i, ids in enumerate(windows):
        engine.prefill(torch.tensor(ids))
        hidden.append(engine.prompt_hidden.clone())
        if (i + 1) % 100 == 0:
            print(
                f"  target hidden states: {i + 1}/{len(windows)} windows, {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    torch.set_num_threads(threads)
    hidden = torch.stack(hidden)
    choice = torch.cat([target.lm_head(h).argmax(dim=-1) for h in hidden.split(64)])  # in slices: V is wide
    return {"ids": torch.tensor(windows), "hidden": hidden, "choice": choice}


def cached_states(path: Path, key: str, compute) -> dict[str, torch.Tensor]:
    """The target's states from `path` if they were computed for the same data (`key`), else computed and saved."""
    if path.is_file():
        with safe_open(path, framework="pt") as f:
            same = (f.metadata() or {}).get("key") == key
        if same:
            print(f"target hidden states from {path}")
            return load_file(path)
    states = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {f"{split}.{k}": v.contiguous() for split, d in states.items() for k, v in d.items()}
    save_file(flat, str(path), metadata={"key": key})
    return flat


def mtp_loss(head, target, ids, hidden, steps: int, decay: float):
    """Σ_k decay^(k-1) CE_k / Σ_k decay^(k-1), and each step's logits (anchors 0 .. T - steps - 2)."""
    logits = [target.get_output_embeddings()(out) for out in chained(head, target, ids, hidden, steps)]
    n = logits[0].shape[1]
    weights = [decay**k for k in range(steps)]
    losses = [F.cross_entropy(lg.flatten(0, 1), ids[:, k + 2 : k + 2 + n].flatten()) for k, lg in enumerate(logits)]
    return sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights), logits


@torch.no_grad()
def evaluate(head, target, data, batch: int, steps: int, decay: float) -> dict:
    """Held-out loss, and per step k the agreement of its argmax at t with the target's own at t + k."""
    head.eval()
    ids, hidden, choice = data
    losses, agree = [], [[] for _ in range(steps)]
    for i in range(0, ids.shape[0], batch):
        loss, logits = mtp_loss(head, target, ids[i : i + batch], hidden[i : i + batch], steps, decay)
        losses.append(float(loss))
        n = logits[0].shape[1]
        for k, lg in enumerate(logits):
            agree[k].append((lg.argmax(dim=-1) == choice[i : i + batch, k + 1 : k + 1 + n]).float().mean().item())
    head.train()
    per_step = [round(sum(a) / len(a), 4) for a in agree]
    return {"heldout_loss": sum(losses) / len(losses), "agreement": per_step[0], "agreement_by_step": per_step}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=Path("build/tiny_target/corpus"))
    p.add_argument("--out", type=Path, default=Path("build/tiny_target/mtp"))
    p.add_argument("--rows", type=Path, nargs="+", default=[bundled.ASSETS / "train.jsonl"], help="regenerated rows")
    p.add_argument("--chain", type=int, default=3, help="chained steps trained (1: the one-step objective)")
    p.add_argument("--chain-decay", type=float, default=0.5, help="loss weight of step k: decay^(k-1)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--windows", type=int, default=768, help="standard-library training windows beside the rows")
    p.add_argument("--heldout", type=int, default=48, help="held-out windows")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1, help="1 trains fastest on a busy 2-core machine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ship", action="store_true", help="write the head into the package's bundled target")
    a = p.parse_args(argv)

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    start = time.perf_counter()
    target = load_causal_lm(bundled.BUNDLED, dtype=torch.float32, device="cpu").requires_grad_(False)
    tokenizer = bundled.load_tokenizer()
    train_tokens = np.fromfile(a.corpus / "train.u16", dtype=np.uint16)
    held_tokens = np.fromfile(a.corpus / "heldout.u16", dtype=np.uint16)
    rows = row_windows(tokenizer, a.seq, a.rows)
    train_windows = rows + corpus_windows(train_tokens, a.windows, a.seq, gen)
    held_windows = corpus_windows(held_tokens, a.heldout, a.seq, gen)
    key = json.dumps([a.seq, a.windows, a.heldout, a.seed, len(rows), len(train_tokens), len(held_tokens)])
    if a.chain < 1 or a.seq < a.chain + 2:
        p.error(f"--chain must be >= 1 and --seq at least --chain + 2 (got {a.chain}, {a.seq})")
    states = cached_states(
        a.out / "target_states.safetensors",
        key,
        lambda: {"train": target_states(target, train_windows), "held": target_states(target, held_windows)},
    )
    train, held = ((states[f"{s}.ids"], states[f"{s}.hidden"], states[f"{s}.choice"]) for s in ("train", "held"))
    print(
        f"hidden states of {train[0].numel():,} training tokens ({len(rows)} regenerated rows, {a.windows} "
        f"stdlib windows) and {held[0].numel():,} held-out tokens; {time.perf_counter() - start:.0f} s"
    )

    head = MTPHead.for_target(target)
    head.apply(target._init_weights)  # the target's own initialisation (normal 0.02, norms at zero)
    head.train().requires_grad_(True)
    params = sum(t.numel() for t in head.parameters())
    optimizer = torch.optim.AdamW(head.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rows_out = [{"step": 0, **evaluate(head, target, held, a.batch, a.chain, a.chain_decay)}]
    print(f"MTP head: {params / 1e6:.2f}M parameters; step 0: {rows_out[0]}")
    train_start = time.perf_counter()
    for step in range(a.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        pick = torch.randint(0, train[0].shape[0], (a.batch,), generator=gen)
        loss, _ = mtp_loss(head, target, train[0][pick], train[1][pick], a.chain, a.chain_decay)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 25 == 0:
            rows_out.append({"step": step + 1, "loss": float(loss.detach()), "lr": optimizer.param_groups[0]["lr"]})
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            rows_out.append({"step": step + 1, **evaluate(head, target, held, a.batch, a.chain, a.chain_decay)})
            print(
                f"step {step + 1}/{a.steps}  loss {float(loss.detach()):.3f}  "
                f"held-out {rows_out[-1]['heldout_loss']:.3f}  agreement by step {rows_out[-1]['agreement_by_step']}  "
                f"{time.perf_counter() - train_start:.0f} s",
                flush=True,
            )
    final = rows_out[-1]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_out))
    summary = {
        "params": params,
        "steps": a.steps,
        "train_seconds": time.perf_counter() - train_start,
        "total_seconds": time.perf_counter() - start,
        "training_tokens": train[0].numel(),
        **final,
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    head = head.eval().requires_grad_(False).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(a.out / "mtp_head.safetensors"))
    print(
        f"trained {a.steps} steps in {summary['train_seconds']:.0f} s: held-out loss {final['heldout_loss']:.3f}, "
        f"agreement with the target by step {final['agreement_by_step']}; wrote {a.out}"
    )
    if a.ship:
        write_mtp(bundled.target_dir(), head)
        print(f"shipped the MTP head into {bundled.target_dir()}")


if __name__ == "__main__":
    main()
