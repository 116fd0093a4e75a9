"""One DFlash training step at Qwen3.5-27B scale on one GPU: flashdraft as shipped vs the naive trainer, same run.

    python -m bench.train_step --seq 3072,32768 --json train_step.json          # an H200: ~4-5 min warm
    python -m bench.train_step --seq 3072 --ablate                              # + each lever switched off
    python -m bench.train_step --seq 3072,32768 --try target.precision=fp8      # + the FP8 target
    python -m bench.train_step --seq 131072 --warmup 1 --steps 2 target.precision=fp8   # long context
    python -m bench.train_step --smoke                                          # tiny, on a CPU

(from the repository root). One random Qwen3.5-27B-shaped target (bf16, built on the GPU, layers 0..61: the last
captured layer is 61), then per sequence length, 512 anchors x 16, batch 1:
  naive        bench/naive_train_step.py (the anchor): output_hidden_states, dense mask + SDPA, full-vocabulary
               logits + CE, bf16 drafter, fused AdamW; target on fla's delta rule + fla's conv
  flashdraft   `flashdraft.train.loop.train_step` itself, on a `Setup` around the same model: FrozenTarget (hooks,
               truncated, `fastpath.enable`, its glue compiled), FlexAttention block mask, chunked linear CE,
               compiled drafter layers, fp32 master weights under bf16 autocast, fused AdamW: the defaults of
               `train.*` and `target.*` on CUDA
  --ablate     adds flashdraft with train.compile=false, and with train.attention=sdpa too (what each lever buys),
               and times the target's forward with cuDNN attention first
  --try K=V    adds flashdraft with one more override (repeatable), e.g. --try target.cudnn_attention=true;
               target.precision=fp8 converts the shared target's linears in place (one-way), so the FP8 variants
               run after every bf16 one, at every length
  --family F   adds every variant again as a drafter of family F (dspark: DSpark's heads and loss, which read the
               target's final hidden states, so its target runs all 64 layers; the same weights as the DFlash
               variants' 62)
  --profile-target  GPU time of one `FrozenTarget.capture` by kernel family and the top kernels (where the target
               forward, most of a long-sequence step, goes)
Each: warmup steps, then timed steps: median wall seconds per step (synchronised), sequence tokens/s, MFU of one FLOP
count per length (the cost model of `flashdraft.telemetry.flops.step_flops`, printed; docs/benchmarks.md explains it),
peak GPU memory of the timed steps, CUDA-event breakdown by phase. A variant that runs out of GPU memory is
recorded as OOM (the naive trainer does from about 65536 tokens: it holds every layer's hidden states), and the run
goes on. Extra arguments `section.field=value` override flashdraft's config (e.g. train.compile=false).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import time
from types import SimpleNamespace

import torch

from bench import naive_train_step as naive
from bench.anchors import fla_kernels
from flashdraft.benchmarks import train_step as step_timing

MASK_TOKEN = 248070


def target_config(d: naive.Dims, num_layers: int, smoke: bool):
    """The anchor's Qwen3.5-27B-shaped text config (all `num_layers`; 3 linear-attention : 1 full attention)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    if not smoke:
        linear = dict(
            linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128
        )
    cfg = Qwen3_5TextConfig(
        vocab_size=d.vocab,
        hidden_size=d.hidden,
        intermediate_size=d.ffn,
        num_hidden_layers=num_layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.head_dim,
        linear_conv_kernel_dim=4,
        **linear,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)],
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_random_target(
    d: naive.Dims, full_layers: int, device: str, dtype: torch.dtype, smoke: bool, whole: bool = False
):
    """Random weights, initialised on the device in `dtype` (no fp32 or CPU copy of 27B parameters): the layers up to
    the last captured one, or all of them (`whole`: a DSpark variant reads the final hidden states)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    full = target_config(d, full_layers, smoke)
    kept = copy.deepcopy(full)
    kept.num_hidden_layers = full_layers if whole else max(d.layer_ids) + 1
    kept.layer_types = full.layer_types[: kept.num_hidden_layers]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = mq.Qwen3_5ForCausalLM(kept).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    return model, full


def target_view(model):
    """A causal LM sharing `model`'s weights but not its list of layers or its config: FrozenTarget truncates the model
    it is given (to the last captured layer for DFlash, to none for DSpark), and each family's target is made from
    one model this way."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    decoder = copy.copy(model.model)
    decoder._modules = dict(model.model._modules)
    decoder.layers = torch.nn.ModuleList(list(model.model.layers))
    view._modules["model"] = decoder
    view.config = decoder.config = copy.deepcopy(model.config)
    return view


def flashdraft_config(d: naive.Dims, seq: int, device: str, overrides: list[str]):
    from flashdraft.config import load_config

    return load_config(
        None,
        [
            f"target.path=random-{d.hidden}",
            f"drafter.num_layers={d.drafter_layers}",
            f"drafter.block_size={d.block_size}",
            f"drafter.target_layer_ids={list(d.layer_ids)}",
            f"drafter.mask_token_id={min(MASK_TOKEN, d.vocab - 1)}",
            f"data.max_length={seq}",
            f"recipe.num_anchors={d.anchors}",
            "train.batch_size=1",
            "train.grad_accum=1",
            f"train.device={device}",
            *overrides,
        ],
    )


def cost_flops(model, d: naive.Dims, seq: int, cfg) -> float:
    """One FLOP count per length for both variants: `flops.step_flops` on the target and a meta-device drafter."""
    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.telemetry.flops import step_flops

    with torch.device("meta"):
        drafter = DFlashDraftModel.from_target(
            model.config,
            num_layers=d.drafter_layers,
            block_size=d.block_size,
            target_layer_ids=list(d.layer_ids),
            mask_token_id=cfg.drafter.mask_token_id,
        )
    shim = SimpleNamespace(target=SimpleNamespace(model=model, lm_head_weight=model.lm_head.weight), drafter=drafter)
    return step_flops(shim, seq, d.anchors * (d.block_size - 1))


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def lengths(text: str) -> list[int]:
    """--seq: one length or several separated by commas ("65536,131072")."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq {text!r}: lengths in tokens, separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--seq {text!r}: lengths in tokens, separated by commas")
    return values


def oom_row(variant: str, seq: int, exc: BaseException) -> dict:
    return {"variant": variant, "seq": seq, "error": f"OOM: {str(exc).splitlines()[0][:160]}"}


def run_naive(model, d, seq, device, dtype, warmup, steps, flops) -> dict:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from flashdraft.fastpath.backends import hub_wrapped

    names = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
    saved = {n: getattr(mq, n) for n in names}
    kernels = fla_kernels() if device == "cuda" else None
    # Without fla (the CPU): transformers' own torch functions, as the anchor's fallback variant runs them.
    torch_fns = (inspect.unwrap(hub_wrapped(f)) for f in saved.values())
    mq.causal_conv1d_fn, mq.torch_chunk_gated_delta_rule = kernels or torch_fns
    variant = "naive (fla target)" if kernels is not None else "naive (torch target)"
    torch.manual_seed(1)
    default = torch.get_default_dtype()
    drafter = optimizer = None
    try:
        torch.set_default_dtype(dtype)  # the anchor's drafter is plain bf16, weights and AdamW states alike
        try:
            with torch.device(device):
                drafter = naive.Drafter(d)
        finally:
            torch.set_default_dtype(default)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device == "cuda")
        generator = torch.Generator(device=device).manual_seed(2)
        step = naive.make_step(model, drafter, optimizer, d, seq, device, generator)
        result = step_timing.measure(step, torch.device(device), warmup, steps)
    except torch.cuda.OutOfMemoryError as exc:
        result = oom_row(variant, seq, exc)
    finally:
        for n, fn in saved.items():
            setattr(mq, n, fn)
    free(drafter, optimizer)
    if "error" in result:
        return result
    peak = fbench_peak(device)
    return {
        "variant": variant,
        "seq": seq,
        **result,
        "seq_tokens": seq,
        "flops": flops,
        "tok_s": seq / result["step_s"],
        "mfu": flops / result["step_s"] / peak if peak else None,
    }


def fbench_peak(device: str):
    from flashdraft.telemetry.flops import device_peak

    peak = device_peak(torch.device(device))
    return peak.flops if peak else None


def run_flashdraft(target, d, seq, device, warmup, steps, overrides, label="flashdraft") -> dict:
    cfg = flashdraft_config(d, seq, device, overrides)
    s = None
    compiled_before = compile_seconds()
    frames_before = compile_frames()
    try:
        start = time.perf_counter()
        s = step_timing.bench_setup(cfg, target, steps=warmup + steps)
        setup_s = time.perf_counter() - start
        result = step_timing.run_train_step(s, cfg, warmup=warmup, steps=steps)
        # From the loaded target to the end of the first step: the drafter's build and compile, the first step's
        # compiles and autotuning (cold only for the first variant of a shape in a new process).
        result.update(setup_s=setup_s, first_step_after_s=setup_s + (result["warmup_steps_s"] or result["steps_s"])[0])
        after = compile_seconds()
        result["compile_s"] = {k: round(v - compiled_before.get(k, 0.0), 2) for k, v in after.items()}
        result["compile_frames"] = compile_frames()[len(frames_before) :]
    except torch.cuda.OutOfMemoryError as exc:
        result = oom_row(label, seq, exc)
    free(s)
    return {**result, "variant": label, "seq": seq, "overrides": overrides}


def compile_seconds() -> dict:
    """torch.compile's seconds so far in this process, by phase (Dynamo's own counters: tracing, Inductor, the
    wait for its parallel Triton compiles), for where a first step's time goes; {} where torch lacks them."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return dict(calculate_time_spent())
    except (ImportError, AttributeError):
        return {}


def compile_frames() -> list[dict]:
    """Every frame torch.compile compiled so far in this process (a backward compiled at its first call counts as
    its own), in order: where it starts, its seconds in all and in Inductor, and Triton's compile and autotuning
    inside them; [] where torch lacks these records. Which graph a slow first step spends its compile on."""
    try:
        from torch._dynamo import utils

        utils.set_compilation_metrics_limit(4096)  # the default keeps the last 64
        metrics = utils.get_compilation_metrics()
    except (ImportError, AttributeError):
        return []

    def seconds(us):
        return None if us is None else round(us / 1e6, 3)

    def frame(m):  # records without a frame: a graph's backward, compiled at its first call, or its run-time tuning
        if m.co_name is None:
            return f"{'first run' if m.is_runtime else 'backward'} of graph {m.compile_id}"
        return f"{m.co_name} {os.path.basename(m.co_filename or '')}:{m.co_firstlineno}"

    return [
        {
            "frame": frame(m),
            "compile_id": m.compile_id,
            "runtime": m.is_runtime,
            "s": seconds(m.duration_us),
            "inductor_s": m.inductor_compile_time_s,
            "triton_compile_s": seconds(m.triton_compile_time_us),
            "triton_autotune_s": seconds(m.runtime_triton_autotune_time_us),
            "graph_ops": m.graph_op_count,
            "fail": m.fail_reason,
        }
        for m in metrics
    ]


def precision_of(d: naive.Dims, seq: int, device: str, overrides: list[str]) -> str:
    """The variant's `target.precision`, read from the config it will run with (at a length it runs)."""
    return flashdraft_config(d, seq, device, overrides).target.precision


def target_sdpa_backends(target, d: naive.Dims, seq: int) -> dict:
    """`target.cudnn_attention`: the target's 16 full-attention layers on cuDNN attention before flash (SDPA's
    default order). Times `FrozenTarget.capture` both ways and compares the features."""
    from bench.timing import events_ms

    ids = torch.randint(0, d.vocab, (1, seq), device="cuda")
    attn = torch.ones_like(ids)
    default = target.capture(ids, attn)
    default_ms = events_ms(lambda: target.capture(ids, attn), iters=3, warmup=1)
    target.cudnn_attention = True
    try:
        cudnn = target.capture(ids, attn)
        cudnn_ms = events_ms(lambda: target.capture(ids, attn), iters=3, warmup=1)
        err = ((cudnn.float() - default.float()).norm() / default.float().norm()).item()
        row = {"cudnn_first_ms": cudnn_ms, "features_relerr": err}
    except Exception as exc:  # noqa: BLE001 - a lever that does not run here is a result, not a failure
        row = {"cudnn_first_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        target.cudnn_attention = False
    free(default)
    return {"variant": "target sdpa backends", "seq": seq, "default_ms": default_ms, **row}


@torch.no_grad()
def target_profile(target, d: naive.Dims, seq: int, device: str) -> dict:
    """One warm `FrozenTarget.capture` of `seq` tokens under the profiler: GPU time by kernel family, top kernels."""
    from bench.timing import kernel_breakdown

    ids = torch.randint(0, d.vocab, (1, seq), device=device)
    attn = torch.ones_like(ids)
    free(target.capture(ids, attn))  # warm: autotuning, allocator
    return {
        "variant": "target profile",
        "seq": seq,
        **kernel_breakdown(lambda: target.capture(ids, attn), cuda=device == "cuda"),
    }


def print_target_profile(row: dict) -> None:
    total = row["gpu_ms"]
    print(f"\n#### FrozenTarget.capture, seq {row['seq']}: {total:.1f} ms of kernels ({row['kernels']} launches)")
    print("| family | ms | share | kernels |\n|---|---|---|---|")
    for fam, v in row["families"].items():
        print(f"| {fam} | {v['ms']:.1f} | {v['ms'] / total:.1%} | {v['count']} |")
    print("top kernels: " + "; ".join(f"{t['name'][:70]} x{t['count']} {t['ms']:.1f} ms" for t in row["top"]))


def compare(rows: list[dict], seqs: list[int]) -> dict:
    """Per length and flashdraft variant: its step against the naive trainer of the same run ("OOM" where one ran
    out of memory)."""
    out = {}
    for seq in seqs:
        at = [r for r in rows if r["seq"] == seq and ("step_s" in r or "error" in r)]
        b = next((r for r in at if r["variant"].startswith("naive")), None)
        per = {}
        for a in (r for r in at if r["variant"].startswith("flashdraft")):
            if "error" in a:
                per[a["variant"]] = "OOM"
                continue
            c = {"mfu": a["mfu"], "step_s": a["step_s"], "peak_gib": a["peak_gib"]}
            if b is not None and "error" in b:
                c["naive"] = "OOM"
            elif b is not None:
                c |= {
                    "speedup_vs_naive": b["step_s"] / a["step_s"],
                    "naive_mfu": b["mfu"],
                    "naive_peak_gib": b["peak_gib"],
                }
            per[a["variant"]] = c
        if per:
            out[str(seq)] = per
    return out


def write_report(args, rows: list[dict], seqs: list[int], flops: dict, t0: float) -> dict:
    """Write --json (every row so far, the FLOP counts, the machine); returns the comparison. Called after each
    row too, so that a run cut short by a time limit keeps what it measured."""
    summary = compare(rows, seqs)
    report = {
        "machine": step_timing.machine(),
        "smoke": args.smoke,
        "flops_per_step": {str(k): v for k, v in flops.items()},
        "results": rows,
        "comparison": summary,
        "wall_s": time.time() - t0,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(tmp, args.json)
    return summary


def print_oom(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:22s} {r['seq']:6d}  {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--seq", type=lengths, action="extend", help="sequence lengths, comma-separated (repeatable); default 3072"
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (flashdraft's first compiles)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    ap.add_argument("--json", help="write every row, the FLOP counts and the machine here")
    ap.add_argument("--smoke", action="store_true", help="a tiny target and drafter on the CPU (checks the script)")
    ap.add_argument("--ablate", action="store_true", help="also flashdraft without compile, and with SDPA too")
    ap.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="section.field=value",
        help="also flashdraft with this override added (repeatable)",
    )
    ap.add_argument(
        "--family",
        dest="families",
        action="append",
        default=[],
        choices=["dspark"],
        help="also every variant as a drafter of this family (repeatable)",
    )
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--profile-target", action="store_true", help="GPU time of the target's capture by kernel")
    ap.add_argument("overrides", nargs="*", metavar="section.field=value", help="flashdraft config overrides")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench.train_step needs a CUDA device (or --smoke for the CPU check)")

    if args.smoke:
        d = naive.Dims(
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            ffn=128,
            vocab=512,
            layer_ids=(1, 3, 5),
            block_size=4,
            anchors=16,
            drafter_layers=2,
        )
        seqs, full_layers, device, dtype = args.seq or [96], 8, "cpu", torch.float32
    else:
        d = naive.Dims()
        seqs, full_layers, device, dtype = args.seq or [3072], 64, "cuda", torch.bfloat16
    t0 = time.time()
    model, full_config = build_random_target(d, full_layers, device, dtype, args.smoke, whole=bool(args.families))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"built the random target: {model.config.num_hidden_layers} of {full_layers} layers, {n_params / 1e9:.2f}B "
        f"params, {dtype}, {device}, in {time.time() - t0:.0f} s",
        flush=True,
    )
    flops = {seq: cost_flops(model, d, seq, flashdraft_config(d, seq, device, [])) for seq in seqs}
    for seq, f in flops.items():
        print(
            f"seq {seq}: FLOPs per step (cost model, attention excluded) {f / 1e12:.2f} T = "
            f"{f / seq / 1e9:.1f} GFLOP per sequence token",
            flush=True,
        )

    rows = []
    # The naive trainer first, on the untouched model: FrozenTarget below truncates it and patches the fast path in.
    if not args.skip_naive:
        for seq in seqs:
            rows.append(run_naive(model, d, seq, device, dtype, args.warmup, args.steps, flops[seq]))
            print(step_timing.table([rows[-1]]) if "error" not in rows[-1] else rows[-1], flush=True)
            write_report(args, rows, seqs, flops, t0)
            free()

    from flashdraft.target import FrozenTarget

    variants = [("flashdraft" + (f"[{','.join(args.overrides)}]" if args.overrides else ""), list(args.overrides))]
    if args.ablate:
        variants += [
            ("flashdraft[eager]", [*args.overrides, "train.compile=false"]),
            ("flashdraft[eager,sdpa]", [*args.overrides, "train.compile=false", "train.attention=sdpa"]),
        ]
    variants += [(f"flashdraft[{extra}]", [*args.overrides, extra]) for extra in args.tries]
    variants += [(f"{label} {f}", [*o, f"drafter.family={f}"]) for f in args.families for label, o in variants]
    targets = {}

    def target_of(overrides):
        """The family's target (DSpark: every layer kept), made once per precision from the shared model."""
        whole = "drafter.family=dspark" in overrides
        if whole not in targets:
            targets[whole] = FrozenTarget(target_view(model), list(d.layer_ids), config=full_config, final_hidden=whole)
            print(f"flashdraft target fast path: {targets[whole].fastpath_report.summary()}", flush=True)
        return targets[whole]

    # FP8 converts the shared model in place (its bf16 weights are freed): every bf16 variant runs first, and the
    # FP8 phase starts with the target that keeps every layer, so that all of them are converted.
    for precision in ("bf16", "fp8"):
        chosen = [(label, o) for label, o in variants if precision_of(d, seqs[0], device, o) == precision]
        chosen.sort(key=lambda v: ("drafter.family=dspark" in v[1]) != (precision == "fp8"))
        targets.clear()
        for seq in seqs if chosen else ():
            # Each length compiles its own static graphs, as it would run alone (a training run's varying lengths
            # get one dynamic graph after the second length instead).
            torch._dynamo.reset()
            if args.ablate and device == "cuda" and precision == "bf16":
                rows.append(target_sdpa_backends(target_of(chosen[0][1]), d, seq))
                print(rows[-1], flush=True)
            if args.profile_target and precision == "bf16":
                rows.append(target_profile(target_of(chosen[0][1]), d, seq, device))
                print_target_profile(rows[-1])
            for label, overrides in chosen:
                t1 = time.time()
                target = target_of(overrides)
                rows.append(run_flashdraft(target, d, seq, device, args.warmup, args.steps, overrides, label))
                rows[-1]["wall_incl_compile_s"] = time.time() - t1
                print(step_timing.table([rows[-1]]) if "error" not in rows[-1] else rows[-1], flush=True)
                write_report(args, rows, seqs, flops, t0)
            if precision == "fp8" and args.profile_target:
                rows.append(
                    target_profile(target_of(chosen[0][1]), d, seq, device) | {"variant": "target profile (fp8)"}
                )
                print_target_profile(rows[-1])

    summary = write_report(args, rows, seqs, flops, t0)
    print(f"\n{json.dumps(summary)}\n{time.time() - t0:.0f} s in all" + (f"; wrote {args.json}" if args.json else ""))
    print(step_timing.table([r for r in rows if "step_s" in r]))
    print_oom(rows)
    for r in rows:
        if r["variant"].startswith("target profile"):
            print_target_profile(r)
        elif "step_s" not in r and "error" not in r:
            print(r)


if __name__ == "__main__":
    main()
