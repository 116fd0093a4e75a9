"""`flashdraft bench train-step`: the config of a training run (data.max_length is the sequence length) and the
bench section, then flashdraft.benchmarks.train_step's timing of the training step (which says what it
measures) on the config's target and drafter, printed as a table and written as JSON."""

from __future__ import annotations

import argparse
import json

from flashdraft import bundled
from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (
    Shortcut("data.max_length", flag="--seq", metavar="N"),
    *options.shortcuts("bench.warmup", "bench.steps"),
    Shortcut("bench.json", metavar="FILE"),
)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speed on this machine (train-step)")
    inner = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = inner.add_parser("train-step", help="time flashdraft's training step on a config's target and drafter")
    options.add(t, execute, SHORTCUTS, default_config=bundled.ASSETS / "train.yaml")
    # The top-level parser adds --debug to each subcommand's parser; this one is a level further down.
    t.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print full tracebacks on errors")


def execute(cfg, args) -> int:
    import logging

    from flashdraft.benchmarks.train_step import bench_setup, load_bench_target, machine, run_train_step, table

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    b = cfg.bench
    target, tokenizer = load_bench_target(cfg)
    s = bench_setup(cfg, target, tokenizer=tokenizer, steps=b.warmup + b.steps)
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
    result = run_train_step(s, cfg, warmup=b.warmup, steps=b.steps)
    result["seq"] = cfg.data.max_length
    print(
        f"FLOPs per step (the trainer's cost model, attention excluded): {result['flops']:.4g} = "
        f"{result['flops'] / result['seq_tokens'] / 1e9:.4g} GFLOP per sequence token; attention "
        f"{result['attention']}, compiled layers {result['compiled']}"
    )
    print(table([result]))
    if b.json:
        with open(b.json, "w") as fh:
            json.dump({"machine": machine(), "results": [result]}, fh, indent=1)
    return EXIT_OK
