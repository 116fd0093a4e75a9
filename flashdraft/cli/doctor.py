"""CLI glue for `flashdraft doctor` (the checks live in flashdraft.fastpath.doctor); `--model` picks what it probes."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check that every fast kernel of a hybrid target is active, per layer")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--model",
        default=None,
        help="tiny family name (qwen3_5, qwen3_5_moe, qwen3_next, qwen3), a config.json or a model "
        "directory; built with random weights (first --probe-layers layers). Default: tiny qwen3_5",
    )
    p.add_argument("--probe-layers", type=int, default=4, help="layers of --model to build and probe (default 4)")
    p.add_argument("--build-log", default=None, help="a pip log of a failed causal-conv1d build to explain")
    p.set_defaults(run=run)


def run(args) -> int:
    from flashdraft.fastpath.doctor import main

    return main(args.json, probe_model(args.model, args.probe_layers), args.build_log)


def probe_model(spec: str | None, probe_layers: int):
    """`--model` as the builder `(device, dtype) -> model` doctor probes: a tiny family (by default tiny qwen3_5), or
    the first `probe_layers` layers of a config.json or model directory; random weights either way. An unknown
    `spec` is refused here, before any check runs."""
    import functools
    import os

    from flashdraft.fastpath.doctor import build_probe_model
    from flashdraft.target.tiny import ALL_FAMILIES, build_tiny_target

    if spec is None or spec in ALL_FAMILIES:
        return lambda device, dtype: build_tiny_target(spec or "qwen3_5", dtype=dtype, device=device)
    if not os.path.exists(spec):
        raise FileNotFoundError(
            f"--model {spec!r}: not a tiny family ({', '.join(ALL_FAMILIES)}), config.json or model directory"
        )
    return functools.partial(build_probe_model, spec, probe_layers)
