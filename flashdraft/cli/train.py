"""CLI glue for `flashdraft train` (the loop lives in flashdraft.train.loop).

flashdraft train --config C.yaml                             # one process
flashdraft train --nproc 8 --config C.yaml                   # 8 on this machine: torchrun, NCCL variables set
torchrun --nproc-per-node 8 -m flashdraft train --config C.yaml
"""

from __future__ import annotations

import signal

from flashdraft import bundled
from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (Shortcut("log.out", flag="--out", metavar="DIR"),)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a DFlash drafter (no arguments: the bundled default on this machine)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in OUT (a run of the same config stopped before its first "
        "checkpoint starts again from step 0); workers restarted by torchrun --max-restarts do this by themselves",
    )
    options.add_nproc_argument(p)
    # No --config: the bundled default (a CPU-sized run), not the paper-scale defaults of the dataclasses.
    options.add(p, execute, SHORTCUTS, default_config=bundled.ASSETS / "train.yaml")


def execute(cfg, args) -> int:
    import logging

    from rich.console import Console

    from flashdraft.io import lock

    if args.nproc is not None:
        from flashdraft import distributed

        if not distributed.launched():
            return distributed.launch(args.nproc, options.relaunch_argv(args, "train"))

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # One writer per output directory, taken before torch loads: a second run on it stops within a second.
    with lock.hold(cfg.log.out, "train"):
        return _run(args, cfg, Console())


def _run(args, cfg, console) -> int:
    from pathlib import Path

    from rich.console import Console

    from flashdraft import distributed
    from flashdraft.train.resume import restarted

    # A worker that torchrun restarted (--max-restarts) resumes by itself: it runs the command line of the first.
    resume = args.resume or restarted(Path(cfg.log.out), cfg)
    preflight(cfg, resume=resume)
    from flashdraft.train.loop import train

    timeout = cfg.train.collective_timeout_s
    with distributed.session(cfg.train.device, "train", output=cfg.log.out, timeout_s=timeout) as world:
        if not world.is_main:
            console = Console(quiet=True)
        result = train(cfg, resume=resume, console=console)
        if not world.is_main:
            return EXIT_OK
    if result.stopped_by:
        console.print(
            f"\n[bold yellow]stopped[/] by {result.stopped_by} after step {result.steps}; checkpoint: "
            f"{result.checkpoint}\ncontinue with: flashdraft train ... --resume",
            soft_wrap=True,
        )
        # Not 0: a scheduler must not take a stopped run for a finished one (128 + signal, as the shell reports).
        return 128 + signal.Signals.__members__.get(result.stopped_by, signal.SIGTERM)
    console.print(f"\n[bold green]done[/]: {result.summary()}", soft_wrap=True)
    console.print(
        f"checkpoint: {result.checkpoint}\nmetrics:    {result.out / 'metrics.jsonl'}"
        + (f"\ncurve:      {result.curve}" if result.curve else ""),
        soft_wrap=True,
    )
    return EXIT_OK


def preflight(cfg, resume: bool = False) -> None:
    """Check the inputs that exist on this machine before any model loads: loading a large target takes minutes,
    and a missing eval prompts file would otherwise surface only after training. Hub ids ('org/name') and remote
    data are left to their loaders (which refuse uncached hub ids unless HF_HUB_OFFLINE=0)."""
    from pathlib import Path

    from flashdraft.data.sources import resolve_sources
    from flashdraft.hub import is_hub_id

    def local(value: str | None) -> Path | None:
        if value is None or value == bundled.BUNDLED or is_hub_id(value) and not Path(value).exists():
            return None
        return Path(value).expanduser()

    for name, value in (("data.tokenizer", cfg.data.tokenizer), ("drafter.init_from", cfg.drafter.init_from)):
        path = local(value)
        if path is not None and not path.is_dir():
            raise FileNotFoundError(f"{name} = {value}: no such directory")
    prompts = local(cfg.data.eval_prompts)
    if prompts is not None and not prompts.is_file():
        raise FileNotFoundError(
            f"data.eval_prompts = {cfg.data.eval_prompts}: no such file (null skips the measured τ)"
        )
    specs = [s for s in cfg.data.train if s != bundled.BUNDLED and "://" not in s]
    if specs:
        resolve_sources(specs)  # a missing file or an empty glob: a DataError naming the spec
    if resume:
        from flashdraft.train.resume import restart_without_checkpoint

        restart_without_checkpoint(Path(cfg.log.out), cfg)  # a missing OUT or another run's: an error, here
