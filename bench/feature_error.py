"""How far FP8 linears (`target.precision: fp8`) move the features a drafter is trained on: per captured layer.

    python -m bench.feature_error --json feature_error.json          # a GPU with FP8 (Hopper): ~1 min warm
    python -m bench.feature_error --smoke                            # the bundled target only, on a CPU (~1 min)

(from the repository root). Two targets, each captured (`FrozenTarget.capture`) in bf16, then with its linears
converted to FP8 in place (the probe proves them first), with Hopper's fast FP8 accumulation on and off:
  bundled   the shipped trained tiny Qwen3.5 target on real text (its own training data: prompts and the
            continuations it wrote), beside a float32 copy as the reference (float64 on the CPU), so bf16's own
            error is shown too
  27b       a random Qwen3.5-27B-shaped target (layers 0..61, as `bench.train_step` builds it) on the same text's
            tokens, 4096 per sequence; no float32 copy fits beside it, so FP8 is measured against bf16
Relative error = ||a - b|| / ||b|| over all tokens of one captured layer (Frobenius). The table is printed as
Markdown (the one in docs/training.md comes from this script) and, with --json, written with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench import naive_train_step as naive
from bench.train_step import build_random_target
from flashdraft import bundled
from flashdraft.benchmarks import train_step as step_timing
from flashdraft.fastpath import fp8
from flashdraft.target import FrozenTarget, load_causal_lm


def text_ids(rows: int, length: int, vocab: int | None = None) -> torch.Tensor:
    """(rows, length) token ids of the bundled training data (prompt + response), concatenated and cut."""
    tokenizer = bundled.load_tokenizer()
    stream: list[int] = []
    with open(bundled.train_data()[0]) as fh:
        for line in fh:
            record = json.loads(line)
            stream += tokenizer(record["prompt"] + record["response"])["input_ids"]
            if len(stream) >= rows * length:
                break
    if len(stream) < rows * length:
        raise SystemExit(f"the bundled data holds {len(stream)} tokens, fewer than {rows} x {length}")
    ids = torch.tensor(stream[: rows * length]).view(rows, length)
    return ids if vocab is None else ids % vocab


def relative_errors(got: torch.Tensor, reference: torch.Tensor, layers: int) -> list[float]:
    """Per captured layer: ||got - reference|| / ||reference|| over every token."""
    a = got.float().unflatten(-1, (layers, -1)).transpose(0, 2).flatten(1)
    b = reference.float().unflatten(-1, (layers, -1)).transpose(0, 2).flatten(1)
    return ((a - b).norm(dim=1) / b.norm(dim=1)).tolist()


def fp8_errors(target: FrozenTarget, ids: torch.Tensor, reference: torch.Tensor, rows: dict, key: str) -> None:
    """Convert `target` to FP8 (strict: the probe must prove every FP8 linear), then capture with the fast
    accumulation on and off; errors against `reference` go into rows[key + " fast"] / [key + " exact"]."""
    layers = len(target.target_layer_ids)
    target.set_precision("fp8")
    rows["probe"] = target.fastpath_report.summary()
    for fast in (True, False):
        for _, module in fp8.fp8_linears(target.decoder):
            module.fast_accum = fast
        rows[f"{key} ({'fast' if fast else 'exact'} accumulation)"] = relative_errors(
            target.capture(ids), reference, layers
        )


@torch.no_grad()
def bundled_rows(device: str, rows: int, length: int) -> dict:
    """The bundled target against itself in float32 (float64 on the CPU): bf16, then FP8 linears."""
    ids = text_ids(rows, length).to(device)
    layers = [1, 3, 5, 7]
    exact = torch.float64 if device == "cpu" else torch.float32
    name = str(exact).replace("torch.", "")
    reference = FrozenTarget.from_model(
        load_causal_lm(bundled.BUNDLED, dtype=exact, device=device), layers, strict=False
    )
    expected = reference.capture(ids)
    out = {"layers": layers, "tokens": ids.numel()}
    target = FrozenTarget.from_model(load_causal_lm(bundled.BUNDLED, dtype=torch.bfloat16, device=device), layers)
    out[f"bf16 vs {name}"] = relative_errors(target.capture(ids), expected, len(layers))
    if device == "cpu":  # the CPU's scaled matmul; FP8 on a CPU is refused by the config (no speed to gain)
        fp8.convert_linears(target.decoder.layers)
        out[f"fp8 vs {name}"] = relative_errors(target.capture(ids), expected, len(layers))
        return out
    fp8_errors(target, ids, expected, out, f"fp8 vs {name}")
    return out


@torch.no_grad()
def random_27b_rows(rows: int, length: int) -> dict:
    d = naive.Dims()
    model, full_config = build_random_target(d, 64, "cuda", torch.bfloat16, smoke=False)
    target = FrozenTarget(model, list(d.layer_ids), config=full_config)
    ids = text_ids(rows, length).cuda()  # the bundled vocabulary's ids, all inside the 27B one
    expected = target.capture(ids)
    out = {"layers": list(d.layer_ids), "tokens": ids.numel()}
    fp8_errors(target, ids, expected, out, "fp8 vs bf16")
    del model, target, expected
    torch.cuda.empty_cache()
    return out


def markdown(name: str, result: dict) -> str:
    layers = result["layers"]
    head = f"| {name} ({result['tokens']} tokens) | " + " | ".join(f"layer {i}" for i in layers) + " |"
    lines = [head, "|---" * (len(layers) + 1) + "|"]
    for key, errors in result.items():
        if isinstance(errors, list) and key != "layers":
            lines.append(f"| {key} | " + " | ".join(f"{e:.2%}" for e in errors) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the errors, the probe lines and the machine here")
    ap.add_argument("--smoke", action="store_true", help="the bundled target only, on the CPU")
    ap.add_argument("--length", type=int, default=4096, help="tokens per sequence of the 27B shape")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not args.smoke:
        if not cuda:
            raise SystemExit("bench.feature_error needs a CUDA device with FP8 (or --smoke for the CPU check)")
        if (reason := fp8.unsupported_reason(torch.device("cuda"))) is not None:
            raise SystemExit(f"bench.feature_error: {reason}")
    t0 = time.time()
    report = {"machine": step_timing.machine(), "targets": {}}
    report["targets"]["bundled"] = bundled_rows("cuda" if cuda else "cpu", rows=4, length=512 if cuda else 256)
    print(markdown("bundled target", report["targets"]["bundled"]), flush=True)
    if cuda:
        report["targets"]["27b"] = random_27b_rows(rows=1, length=args.length)
        print("\n" + markdown("27B shape, random weights", report["targets"]["27b"]), flush=True)
    for name, result in report["targets"].items():
        if "probe" in result:
            print(f"{name}: {result['probe']}")
    report["wall_s"] = time.time() - t0
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    print(f"{report['wall_s']:.0f} s" + (f"; wrote {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
