"""Forward of a Qwen3.5-27B-shaped hybrid target (first N layers, random bf16 weights): tokens/s per variant.

Variants, in one process on one GPU, same weights and inputs:
  all_torch            transformers' torch fallbacks (neither fla nor causal-conv1d installed)        [anchor]
  fla_gdr+torch_conv   fla delta rule, torch conv                                                     [anchor]
  fla_gdr+fla_conv     fla delta rule, fla's Triton conv                                              [anchor]
  fla_gdr+cuda_conv    fla delta rule, Dao's CUDA causal-conv1d (if importable)                       [anchor]
  flashdraft           flashdraft.fastpath.enable(model) (strict: proven per layer)
Run on a GPU, from the repository root: python -m bench.target_forward [--layers 16] [--batch 4] [--seq 4096]
[--json OUT] (bench.kernels runs it too, at those defaults).
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch

from bench.anchors import fla_kernels, torch_conv_fn
from bench.timing import events_ms


def qwen35_27b_config(num_layers: int):
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=num_layers,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4),
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def run(num_layers: int = 16, batch: int = 4, seq: int = 4096) -> list[dict]:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from flashdraft import fastpath
    from flashdraft.fastpath.backends import hub_wrapped

    cfg = qwen35_27b_config(num_layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = mq.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    saved = {n: getattr(mq, n) for n in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    torch_gdr = inspect.unwrap(hub_wrapped(saved["torch_chunk_gated_delta_rule"]))  # the torch code, not fla's
    fla = fla_kernels()
    if fla is None:
        raise SystemExit("bench.target_forward compares against fla: install fla-core")
    fla_conv, fla_gdr = fla
    variants = {
        "all_torch": (torch_conv_fn, torch_gdr),
        "fla_gdr+torch_conv": (torch_conv_fn, fla_gdr),
        "fla_gdr+fla_conv": (fla_conv, fla_gdr),
    }
    try:
        from causal_conv1d import causal_conv1d_fn as dao

        variants["fla_gdr+cuda_conv"] = (
            lambda x, w, b=None, activation=None, **_: dao(x, w, b, activation=activation),
            fla_gdr,
        )
    except Exception as exc:  # noqa: BLE001 - an anchor that is not installed is reported, not fatal
        print(f"(Dao causal-conv1d not importable: {exc})")
    forward = lambda: model.model(input_ids=ids, use_cache=False)
    rows, ref = [], None
    with torch.no_grad():
        for name, (conv, gdr) in variants.items():
            mq.causal_conv1d_fn, mq.torch_chunk_gated_delta_rule = conv, gdr
            out = forward().last_hidden_state.float()
            ref = out if ref is None else ref
            err = ((out - ref).norm() / ref.norm()).item()
            ms = events_ms(forward, iters=3 if name == "all_torch" else 5, warmup=1)
            rows.append({"variant": name, "ms": ms, "tok_s": batch * seq / ms * 1e3, "relerr_vs_torch": err})
            print(rows[-1], flush=True)
        for n, fn in saved.items():
            setattr(mq, n, fn)
        report = fastpath.enable(model, strict=True)
        print(report)
        out = forward().last_hidden_state.float()
        ms = events_ms(forward, iters=5, warmup=1)
        rows.append(
            {
                "variant": "flashdraft",
                "ms": ms,
                "tok_s": batch * seq / ms * 1e3,
                "relerr_vs_torch": ((out - ref).norm() / ref.norm()).item(),
            }
        )
        print(rows[-1], flush=True)
        fastpath.disable(model)
    anchors = [r["tok_s"] for r in rows if r["variant"] in ("fla_gdr+fla_conv", "fla_gdr+cuda_conv")]
    ours = rows[-1]["tok_s"]
    rows[-1]["vs_best_anchor"] = ours / max(anchors)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="target layers (a multiple of 4)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.target_forward needs a CUDA device")
    rows = run(a.layers, a.batch, a.seq)
    for r in rows:
        print(f"{r['variant']:20s} {r['ms']:9.1f} ms {r['tok_s']:10.0f} tok/s relerr {r['relerr_vs_torch']:.2e}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
