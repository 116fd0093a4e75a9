"""`flashdraft features`: the target and the tokenised training data of a run's config, built as `flashdraft train`
builds them, passed to flashdraft.data.features.write_features (which says what the command does).

    flashdraft features --config examples/qwen3.5-27b.yaml --out s3://bucket/features/q27   # or a local directory
    torchrun --nproc-per-node 8 -m flashdraft features --config ... --out /data/features/q27   # ranks split samples
"""

from __future__ import annotations

from pathlib import Path

from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.cli.train import add_nproc_argument, relaunch_argv
from flashdraft.data.features import FeaturesResult, local_dir, output_lock, write_features


def add_parser(sub) -> None:
    p = sub.add_parser("features", help="capture the target's features of the training data for offline training")
    p.add_argument("--config", default=None, help="YAML config of the training run (default: the bundled one)")
    p.add_argument("--out", default=None, help="features directory, local or s3:// (default: data.features)")
    add_nproc_argument(p)
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="dotted overrides, as for train")
    p.set_defaults(run=run)


def run(args) -> int:
    import logging

    from rich.console import Console

    from flashdraft import bundled, distributed
    from flashdraft.config import load_config

    if args.nproc is not None and not distributed.launched():
        return distributed.launch(args.nproc, relaunch_argv(args, "features"))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(args.config or bundled.ASSETS / "train.yaml", args.overrides)
    out = args.out or cfg.data.features
    if not out:
        raise ValueError("features: where to? give --out DIR (local or s3://) or data.features=DIR")
    console = Console()
    # Rank 0 takes the lock before the process group exists; every rank checks it once the group is up.
    with output_lock(out), distributed.session(cfg.train.device, "features", output=local_dir(out)) as here:
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


def _write(cfg, out: str, console) -> FeaturesResult:
    """The config's target and training data (online: the target is run, whatever `data.features` says), then their
    features written to `out`."""
    from flashdraft.train.setup import load_inputs

    _, _, target, data, _ = load_inputs(cfg, Path(cfg.log.out), console, offline=False)
    return write_features(target, data, out, s3=cfg.s3, sharded=cfg.target.shard, target_path=cfg.target.path)
