"""Data-parallel training on N GPUs (NCCL) checked against one GPU, on the bundled target in bf16.

    python -m bench.dist_gpu [--json OUT.json]      # all visible GPUs (at least 2)
    python -m bench.dist_gpu --smoke                # the same checks on the CPU with gloo and 2 processes

(from the repository root; each run is a `python -m flashdraft` subprocess, so flashdraft must be importable).

What each row is (losses of `--steps` steps, one global batch = batch_size x grad_accum x ranks):
  parity       1 GPU with grad_accum=N vs N GPUs with grad_accum=1 (`flashdraft train --nproc N`): max relative
               loss difference (bf16 autocast; the sums run in another order) and tok/s of each
  resume N->1  the N-GPU checkpoint of half-way resumed on 1 GPU: its losses vs the uninterrupted N-GPU run
  shard        `target.shard=true` on N GPUs (decoder layers FSDP2-sharded) vs the 1-GPU run
  offline      `flashdraft features --nproc N`, then training on the features vs online (batch_size 1): max
               relative loss difference (0 on the CPU; a GPU's attention backward may sum in another order)
  error        rank 1 raises at its first step while rank 0 waits in an NCCL all_reduce: seconds until torchrun
               exits, and whether rank 1's message is in its output (a hang would hit the 240 s timeout)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = ["log.every=1", "data.eval_prompts=null", "target.dtype=bfloat16"]


def _env(extra: Path | None = None) -> dict:
    """The subprocesses' environment; `extra` goes first on PYTHONPATH (a sitecustomize that injects a failure)."""
    path = ([str(extra)] if extra else []) + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1"}


def flashdraft(args: list[str], nproc: int | None, env: dict | None = None, timeout: int = 300):
    cmd = [sys.executable, "-m", "flashdraft", *args] + ([f"--nproc={nproc}"] if nproc else [])
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env())
    return run, time.perf_counter() - start


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rel_diff(a: list[dict], b: list[dict]) -> float:
    pairs = {r["step"]: r["loss"] for r in a}
    return max(abs(r["loss"] - pairs[r["step"]]) / abs(pairs[r["step"]]) for r in b if r["step"] in pairs)


def tok_s(rows: list[dict]) -> float:
    later = rows[len(rows) // 2 :] or rows  # past the first steps' start-up
    return sum(r["tok_s"] for r in later) / len(later)


def check(run, what: str) -> None:
    if run.returncode != 0:
        raise SystemExit(f"{what} failed ({run.returncode}):\n{run.stderr[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=None, help="GPUs (default: all visible)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes, 4 steps")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    if args.smoke:
        nproc, steps, device = 2, 4, ["train.device=cpu", "target.dtype=float32"]
    else:
        nproc, steps, device = args.nproc or torch.cuda.device_count(), args.steps, ["train.device=cuda"]
        if nproc < 2:
            raise SystemExit(f"needs at least 2 GPUs, {nproc} visible (or --smoke)")
    work = Path(tempfile.mkdtemp(prefix="dist_gpu-"))
    common = [*BASE, *device, f"train.max_steps={steps}", f"log.checkpoint_every={steps // 2}", "train.batch_size=2"]
    rows, result = (
        [],
        {
            "nproc": nproc,
            "steps": steps,
            "smoke": args.smoke,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
    )

    one, many = work / "one", work / "many"
    run, t1 = flashdraft(["train", "--out", str(one), *common, f"train.grad_accum={nproc}"], None)
    check(run, "1 GPU")
    run, tn = flashdraft(["train", "--out", str(many), *common, "train.grad_accum=1"], nproc)
    check(run, f"{nproc} GPUs")
    m1, mn = metrics(one), metrics(many)
    result["parity"] = {
        "rel_diff": rel_diff(m1, mn),
        "tok_s_1": tok_s(m1),
        "tok_s_n": tok_s(mn),
        "losses_1": [r["loss"] for r in m1],
        "losses_n": [r["loss"] for r in mn],
        "wall_1": t1,
        "wall_n": tn,
    }
    rows.append(
        (
            "parity",
            f"max rel loss diff {result['parity']['rel_diff']:.1e}",
            f"tok/s 1 rank {result['parity']['tok_s_1']:.0f}, {nproc} ranks {result['parity']['tok_s_n']:.0f}",
        )
    )

    resumed = work / "resumed"
    shutil.copytree(many, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{steps:08d}")
    run, _ = flashdraft(["train", "--resume", "--out", str(resumed), *common, f"train.grad_accum={nproc}"], None)
    check(run, "resume on 1")
    result["resume"] = {"rel_diff": rel_diff(mn, metrics(resumed))}
    rows.append((f"resume {nproc}->1", f"max rel loss diff {result['resume']['rel_diff']:.1e}", "vs the N-GPU run"))

    shard = work / "shard"
    run, _ = flashdraft(["train", "--out", str(shard), *common, "train.grad_accum=1", "target.shard=true"], nproc)
    check(run, "target.shard")
    result["shard"] = {"rel_diff": rel_diff(m1, metrics(shard)), "tok_s": tok_s(metrics(shard))}
    rows.append(
        ("shard", f"max rel loss diff {result['shard']['rel_diff']:.1e}", f"tok/s {result['shard']['tok_s']:.0f}")
    )

    feats, online, offline = work / "features", work / "online", work / "offline"
    small = [*BASE, *device, "train.max_steps=4", "train.batch_size=1", f"log.out={work / 'frun'}"]
    run, tf = flashdraft(["features", "--out", str(feats), *small], nproc)
    check(run, "features")
    run, _ = flashdraft(["train", "--out", str(online), *small[:-1]], None)
    check(run, "online")
    run, _ = flashdraft(["train", "--out", str(offline), *small[:-1], f"data.features={feats}"], None)
    check(run, "offline")
    equal = [r["loss"] for r in metrics(online)] == [r["loss"] for r in metrics(offline)]
    # Equal bits where the kernels are deterministic (the CPU); a GPU's attention backward may add in any order.
    off_diff = rel_diff(metrics(online), metrics(offline))
    result["offline"] = {"equal": equal, "rel_diff": off_diff, "features_wall": tf}
    rows.append(("offline", f"max rel loss diff to online {off_diff:.1e}", f"bit-equal {equal}; features {tf:.0f} s"))

    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    import flashdraft.train.loop as loop\n"
        "    def boom(*a, **k):\n        raise ValueError('injected failure on rank 1')\n    loop.train_step = boom\n"
    )
    run, te = flashdraft(["train", "--out", str(work / "err"), *common], nproc, env=_env(site), timeout=240)
    message = "(rank 1): error: injected failure on rank 1" in run.stderr
    result["error"] = {"returncode": run.returncode, "seconds": te, "message": message}
    rows.append(("error", f"exit {run.returncode} after {te:.0f} s", f"rank 1's message shown: {message}"))

    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = (
        result["parity"]["rel_diff"] < 2e-2
        and result["resume"]["rel_diff"] < 2e-2
        and result["shard"]["rel_diff"] < 2e-2
        and off_diff < 1e-3
        and run.returncode != 0
        and message
    )
    print(
        f"\nflashdraft data parallel: {nproc} x {result['gpu'] or 'CPU'} ({'smoke' if args.smoke else 'NCCL'}), "
        f"{steps} steps"
    )
    for name, a, b in rows:
        print(f"  {name:<12} {a:<36} {b}")
    print(("OK" if ok else "FAILED") + (f" (JSON: {args.json})" if args.json else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
