"""Speculative decoding on a GPU-sized random hybrid target: `flashdraft eval` end to end, and the rollback cost.

1. Builds a Qwen3.5-0.8B-shaped random bf16 target (24 layers, 18 linear-attention, vocab 248320) with a small
   byte-level BPE tokenizer trained on the Python standard library, and a random 5-layer DFlash drafter; saves both.
2. Runs `flashdraft eval` on code prefixes (greedy, block 16), with transformers (`--engine off`) and/or flashdraft's
   engine (`--engine on`): tau, speed-ups, JSON and PNG. A random drafter is rejected every round (tau = 1), so
   this measures the harness and the cost of a round against a decode step, not a drafter.
3. Times, on a Qwen3.5-27B-shaped target (first 16 layers, random bf16) at context 1024: one decode step,
   a 16-token verify forward, and the exact rollback (snapshot + restore of conv/recurrent states and the KV crop)
   that the plain generation loop pays per round. Scale by 4 for the 64-layer model.
Run on a GPU, from the repository root: python -m bench.spec_gpu --out DIR [--engine off --engine on]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from bench.target_forward import qwen35_27b_config
from bench.timing import events_ms


def build_tokenizer(out: Path, vocab_size: int = 4000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:60]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    prompts = []
    for f in sorted(stdlib.glob("*.py"))[60:76]:
        text = f.read_text(errors="replace")
        prompts.append({"prompt": text[:600], "category": "stdlib-code"})
    return fast, prompts


def eval_run(out: Path, max_new_tokens: int, engines=("off",)) -> dict:
    """`flashdraft eval` with each engine setting; {engine: report} (eval.json for "off", eval_<engine>.json else)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from flashdraft.drafter import DFlashDraftModel

    tdir, ddir = out / "target", out / "drafter"
    tokenizer, prompts = build_tokenizer(tdir)
    cfg = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        target = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    target.save_pretrained(tdir)
    drafter = DFlashDraftModel.from_target(cfg, num_layers=5, block_size=16, tokenizer=tokenizer)
    drafter.to(torch.bfloat16).save_pretrained(ddir)
    del target
    with open(out / "prompts.jsonl", "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p) + "\n")
    reports = {}
    for engine in engines:
        name = "eval" if engine == "off" else f"eval_{engine}"
        cmd = [
            sys.executable,
            "-m",
            "flashdraft",
            "eval",
            "--target",
            str(tdir),
            "--drafter",
            str(ddir),
            "--prompts",
            str(out / "prompts.jsonl"),
            "--limit",
            "4",
            "--max-new-tokens",
            str(max_new_tokens),
            "--ignore-eos",
            "--engine",
            engine,
            "--json",
            str(out / f"{name}.json"),
            "--plot",
            str(out / f"{name}.png"),
            "--no-progress",
        ]
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", flush=True)
        ok = proc.returncode == 0
        reports[engine] = json.loads((out / f"{name}.json").read_text()) if ok else {"error": proc.returncode}
    return reports


def rollback_cost(context: int = 1024, layers: int = 16) -> dict:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from flashdraft import fastpath
    from flashdraft.speculative import rollback

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = mq.Qwen3_5ForCausalLM(qwen35_27b_config(layers)).to(torch.bfloat16).eval()
    fastpath.enable(model, strict=True)
    ids = torch.randint(0, 248320, (1, context), device="cuda")
    res = {}
    with torch.no_grad():
        cache = rollback.new_cache(model)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        snap = rollback.take_snapshot(cache)
        block = torch.randint(0, 248320, (1, 16), device="cuda")
        one = block[:, :1]

        def verify():
            model(input_ids=block, past_key_values=cache, use_cache=True)
            rollback.restore(cache, snap)

        def decode():
            model(input_ids=one, past_key_values=cache, use_cache=True)
            rollback.restore(cache, snap)

        res["snapshot_ms"] = events_ms(lambda: rollback.take_snapshot(cache, reuse=snap))
        res["restore_ms"] = events_ms(lambda: rollback.restore(cache, snap))
        res["verify16_plus_restore_ms"] = events_ms(verify)
        res["decode1_plus_restore_ms"] = events_ms(decode)
        res["snapshot_bytes"] = sum(
            t.numel() * t.element_size() for d in (snap.conv, snap.recurrent) for t in d.values()
        )
    res.update(context=context, layers=layers)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", required=True, help="folder for the target, drafter, prompts, eval JSON/PNG, spec_gpu.json"
    )
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--skip-rollback", action="store_true", help="only the eval part")
    ap.add_argument(
        "--engine",
        action="append",
        choices=["off", "on"],
        default=None,
        help="eval with transformers (off) and/or flashdraft's engine (on); repeatable (default: off)",
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.spec_gpu needs a CUDA device")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {} if a.skip_rollback else {"rollback": rollback_cost()}
    print(result, flush=True)
    result["eval"] = eval_run(out, a.max_new_tokens, tuple(a.engine or ["off"]))
    (out / "spec_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    if a.skip_rollback:
        return
    r = result["rollback"]
    print(
        f"rollback (27B-shaped, {r['layers']} layers, ctx {r['context']}): snapshot {r['snapshot_ms']:.3f} ms, "
        f"restore {r['restore_ms']:.3f} ms; verify16 {r['verify16_plus_restore_ms']:.2f} ms, "
        f"decode1 {r['decode1_plus_restore_ms']:.2f} ms (x4 for 64 layers)"
    )


if __name__ == "__main__":
    main()
