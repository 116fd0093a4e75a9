"""The fast path's kernels on a GPU, each beside its anchors measured in the same run on the same inputs.

  conv forward   causal_conv1d, D=10240, W=4, silu, bf16, (B, L) in (1, 8192), (4, 4096), (8, 8192), x channel-last
                 (and channel-first): flashdraft vs transformers' torch fallback, fla's Triton conv and Dao's CUDA
                 causal-conv1d (when importable)
  conv backward  the same shapes (dx and dweight)
  conv update    causal_conv1d_update, B=64, D=10240, one token (microseconds per call)
  target         a Qwen3.5-27B-shaped target's first 16 layers, 4 x 4096 tokens: `fastpath.enable` vs the best
                 combination of fla and the conv anchors (bench/target_forward.py)
and the machine's ceilings: device copy GB/s (read + write) and a large bf16 matmul's TFLOP/s.

Run on a GPU, from the repository root: python -m bench.kernels --json OUT.json   (tables in bench/RESULTS.md)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

from bench import kernels_conv, target_forward


def ceilings() -> dict:
    """Device-to-device copy bandwidth (read+write) and a large bf16 matmul rate on random data."""
    from triton.testing import do_bench

    n = 2 * 1024**3  # 2 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    copy_ms = do_bench(lambda: b.copy_(a), return_mode="median")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: x @ y, return_mode="median")
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def environment() -> dict:
    import transformers
    import triton

    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    for mod in ("fla", "causal_conv1d"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:
            env[mod] = f"missing ({type(exc).__name__})"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-target", action="store_true", help="skip the 16-layer target forward")
    ap.add_argument("--repeat", type=int, default=3, help="conv forward: interleaved rounds per case (median, range)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA device")
    result = {"env": environment(), "ceilings": ceilings()}
    print(result, flush=True)
    result["conv"] = kernels_conv.run_all(repeat=args.repeat)
    if not args.skip_target:
        result["target_forward"] = target_forward.run(16, 4, 4096)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    print("\n=== summary ===")
    print(
        f"ceilings: copy {result['ceilings']['copy_GBps']:.0f} GB/s, bf16 {result['ceilings']['bf16_TFLOPs']:.0f} TFLOP/s"
    )
    kernels_conv.print_table(result["conv"])
    for r in result.get("target_forward", []):
        extra = f"  {r['vs_best_anchor']:.3f}x best anchor" if "vs_best_anchor" in r else ""
        print(
            f"target {r['variant']:20s} {r['ms']:8.1f} ms {r['tok_s']:9.0f} tok/s relerr {r['relerr_vs_torch']:.1e}{extra}"
        )


if __name__ == "__main__":
    main()
