"""CLI glue for `flashdraft doctor` (the checks live in flashdraft.fastpath.doctor); doctor.model picks what it
probes, built with random weights by flashdraft.target.tiny."""

from __future__ import annotations

from flashdraft.cli import options
from flashdraft.cli.options import Shortcut

SHORTCUTS = (
    Shortcut("doctor.json"),
    Shortcut("doctor.model", metavar="M"),
    *options.shortcuts("doctor.probe_layers"),
    Shortcut("doctor.build_log", metavar="LOG"),
)


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check that every fast kernel of a hybrid target is active, per layer")
    options.add(p, execute, SHORTCUTS)


def execute(cfg, args) -> int:
    from flashdraft.fastpath.doctor import main

    d = cfg.doctor
    return main(d.json, probe_model(d.model, d.probe_layers), d.build_log)


def probe_model(spec: str | None, probe_layers: int):
    """doctor.model as the builder `(device, dtype) -> model` doctor probes: a tiny family (by default tiny qwen3_5),
    or the first `probe_layers` layers of a config.json or model directory; random weights either way. An unknown
    `spec` is refused here, before any check runs."""
    import functools
    import os

    from flashdraft.target.tiny import ALL_FAMILIES, random_model_like, random_tiny_model

    if spec is None or spec in ALL_FAMILIES:
        return lambda device, dtype: random_tiny_model(spec or "qwen3_5", dtype=dtype, device=device)
    if not os.path.exists(spec):
        raise FileNotFoundError(
            f"--model {spec!r}: not a tiny family ({', '.join(ALL_FAMILIES)}), config.json or model directory"
        )
    return functools.partial(random_model_like, spec, probe_layers)
