"""`flashdraft features`: the target and the tokenised training data of a run's config, built as `flashdraft train`
builds them, passed to flashdraft.data.features.write_features (which says what the command does).

    flashdraft features --config examples/qwen3.5-27b.yaml --out s3://bucket/features/q27   # or a local directory
    torchrun --nproc-per-node 8 -m flashdraft features --config ... --out /data/features/q27   # ranks split samples
"""

from __future__ import annotations

from pathlib import Path

from flashdraft import bundled
from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (Shortcut("data.features", flag="--out", metavar="DIR|s3://..."),)


def add_parser(sub) -> None:
    p = sub.add_parser("features", help="capture the target's features of the training data for offline training")
    options.add_nproc_argument(p)
    options.add(p, execute, SHORTCUTS, default_config=bundled.ASSETS / "train.yaml")


def execute(cfg, args) -> int:
    import logging

    from rich.console import Console

    from flashdraft import distributed
    from flashdraft.data.features import local_dir, output_lock

    if args.nproc is not None and not distributed.launched():
        return distributed.launch(args.nproc, options.relaunch_argv(args, "features"))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = cfg.data.features
    if not out:
        raise ValueError("features: where to? give --out DIR (local or s3://) or data.features=DIR")
    console = Console()
    # Rank 0 takes the lock before the process group exists; every rank checks it once the group is up.
    with (
        output_lock(out),
        distributed.session(
            cfg.train.device, "features", output=local_dir(out), timeout_s=cfg.train.collective_timeout_s
        ) as here,
    ):
        if not here.is_main:
            console = Console(quiet=True)
        result = _write(cfg, out, console)
        if not here.is_main:
            return EXIT_OK
    console.print(
        f"[bold green]done[/]: features of {result.samples} samples in {result.files} files "
        f"({result.bytes / 2**20:.1f} MiB) at {result.out}\ntrain on them with: data.features={result.out}",
        soft_wrap=True,
    )
    return EXIT_OK


def _write(cfg, out: str, console):
    """The config's target and training data (online: the target is run, whatever `data.features` says), then their
    features written to `out`."""
    from flashdraft.data.features import write_features
    from flashdraft.train.setup import load_inputs

    _, _, target, data, _ = load_inputs(cfg, Path(cfg.log.out), console, offline=False)
    return write_features(target, data, out, s3=cfg.s3, sharded=cfg.target.shard, target_path=cfg.target.path)
