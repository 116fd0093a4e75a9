"""P3: forward of a Qwen3.5-27B-shaped hybrid target (first N layers, random bf16 weights), tokens/s per variant.

Variants, in one process on one GPU, same weights and inputs:
  all_torch            transformers' torch fallbacks (what users got)          [anchor]
  fla_gdr+torch_conv   fla delta rule, torch conv                              [anchor]
  fla_gdr+fla_conv     fla delta rule, fla's Triton conv                       [anchor]
  fla_gdr+cuda_conv    fla delta rule, Dao's CUDA causal-conv1d (if built)     [anchor]
  flashdraft           flashdraft.fastpath.enable(model) (strict: proven per layer)
Run: python bench/target_forward.py [--layers 16] [--batch 4] [--seq 4096] [--json OUT]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def qwen35_27b_config(num_layers: int):
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=num_layers,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (num_layers // 4),
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return cfg


def _torch_conv_fn(x, weight, bias=None, activation=None, **_):
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    out = out[..., : x.shape[-1]]
    return (F.silu(out) if activation in ("silu", "swish") else out).to(x.dtype)


def _fla_conv_fn(x, weight, bias=None, activation=None, **_):
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x.transpose(1, 2), weight, bias, activation=activation)[0].transpose(1, 2)


def _fla_gdr(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             cu_seqlens=None, **_):  # fmt: skip
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)  # fmt: skip


def run(num_layers: int = 16, batch: int = 4, seq: int = 4096) -> list[dict]:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from bench.timing import events_ms
    from flashdraft import fastpath
    from flashdraft.fastpath.backends import hub_wrapped

    cfg = qwen35_27b_config(num_layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = mq.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    saved = {n: getattr(mq, n) for n in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")}
    torch_gdr = inspect.unwrap(hub_wrapped(saved["torch_chunk_gated_delta_rule"]))  # the torch code, not fla's
    variants = {
        "all_torch": (_torch_conv_fn, torch_gdr),
        "fla_gdr+torch_conv": (_torch_conv_fn, _fla_gdr),
        "fla_gdr+fla_conv": (_fla_conv_fn, _fla_gdr),
    }
    try:
        from causal_conv1d import causal_conv1d_fn as dao

        variants["fla_gdr+cuda_conv"] = (lambda x, w, b=None, activation=None, **_: dao(x, w, b, activation=activation),
                                         _fla_gdr)  # fmt: skip
    except Exception as exc:
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
        rows.append({"variant": "flashdraft", "ms": ms, "tok_s": batch * seq / ms * 1e3,
                     "relerr_vs_torch": ((out - ref).norm() / ref.norm()).item()})  # fmt: skip
        print(rows[-1], flush=True)
        fastpath.disable(model)
    anchors = [r["tok_s"] for r in rows if r["variant"] in ("fla_gdr+fla_conv", "fla_gdr+cuda_conv")]
    ours = rows[-1]["tok_s"]
    rows[-1]["vs_best_anchor"] = ours / max(anchors)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = run(a.layers, a.batch, a.seq)
    for r in rows:
        print(f"{r['variant']:20s} {r['ms']:9.1f} ms {r['tok_s']:10.0f} tok/s relerr {r['relerr_vs_torch']:.2e}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
