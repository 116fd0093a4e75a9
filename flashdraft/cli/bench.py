"""`flashdraft bench train-step`: the arguments of the command, then flashdraft.benchmarks.train_step's timing of the
training step (which says what it measures) on the config's target and drafter, printed as a table and written as
JSON."""

from __future__ import annotations

import argparse
import json

from flashdraft.benchmarks.train_step import bench_setup, load_bench_target, machine, run_train_step, table
from flashdraft.cli.exit_codes import EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speed on this machine (train-step)")
    inner = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = inner.add_parser("train-step", help="time flashdraft's training step on a config's target and drafter")
    t.add_argument("--config", default=None, help="YAML config (see examples/); default: the bundled default")
    t.add_argument("--seq", type=int, default=None, help="sequence length in tokens (default: data.max_length)")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    t.add_argument("--steps", type=int, default=4, help="timed steps")
    t.add_argument("--json", default=None, help="also write the result as JSON to this file")
    t.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="dotted overrides, e.g. train.compile=false"
    )
    # The top-level parser adds --debug to each subcommand's parser; this one is a level further down.
    t.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print full tracebacks on errors")
    t.set_defaults(run=run)


def run(args) -> int:
    import logging

    from flashdraft import bundled
    from flashdraft.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.warmup < 0 or args.steps < 1:
        raise ValueError(f"--warmup {args.warmup} / --steps {args.steps}: need warmup >= 0 and steps >= 1")
    overrides = list(args.overrides) + ([f"data.max_length={args.seq}"] if args.seq is not None else [])
    cfg = load_config(args.config or bundled.ASSETS / "train.yaml", overrides)
    target, tokenizer = load_bench_target(cfg)
    s = bench_setup(cfg, target, tokenizer=tokenizer, steps=args.warmup + args.steps)
    print(
        f"target: {target.name_or_path or cfg.target.path}, {len(target.decoder.layers)} layers run, "
        f"{target.dtype}, {target.device}; drafter {sum(p.numel() for p in s.drafter.parameters()) / 1e6:.1f}M "
        f"params; seq {cfg.data.max_length} x batch {cfg.train.batch_size} x accum {cfg.train.grad_accum}, "
        f"{cfg.recipe.num_anchors} anchors x {s.drafter.block_size}",
        flush=True,
    )
    from flashdraft.telemetry.flops import describe

    if (basis := describe(s.device, s.peak)) is not None:
        print(basis, flush=True)
    result = run_train_step(s, cfg, warmup=args.warmup, steps=args.steps)
    result["seq"] = cfg.data.max_length
    print(
        f"FLOPs per step (the trainer's cost model, attention excluded): {result['flops']:.4g} = "
        f"{result['flops'] / result['seq_tokens'] / 1e9:.4g} GFLOP per sequence token; attention "
        f"{result['attention']}, compiled layers {result['compiled']}"
    )
    print(table([result]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "results": [result]}, fh, indent=1)
    return EXIT_OK
