"""CLI glue for `flashdraft train` (the loop lives in flashdraft.train.loop).

flashdraft train --config C.yaml                             # one process
flashdraft train --nproc 8 --config C.yaml                   # 8 on this machine: torchrun, NCCL variables set
torchrun --nproc-per-node 8 -m flashdraft train --config C.yaml
"""

from __future__ import annotations

import signal

from flashdraft.cli.exit_codes import EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a DFlash drafter (no arguments: the bundled default on this machine)")
    p.add_argument("--config", default=None, help="YAML config (see examples/); default: the bundled default")
    p.add_argument("--out", default=None, help="output directory (overrides log.out)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in OUT (a run of the same config stopped before its first "
        "checkpoint starts again from step 0)",
    )
    p.add_argument("--help-config", action="store_true", help="list every config field with its default and meaning")
    add_nproc_argument(p)
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="dotted overrides, e.g. optim.lr=3e-4")
    p.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console

    from flashdraft.config import describe_fields, load_config

    console = Console()
    if args.help_config:
        for name, default, doc in describe_fields():
            console.print(f"[bold]{name}[/] = {default}\n    {doc}")
        return EXIT_OK
    import logging

    from flashdraft import bundled
    from flashdraft.io import lock

    if args.nproc is not None:
        from flashdraft import distributed

        if not distributed.launched():
            return distributed.launch(args.nproc, relaunch_argv(args, "train"))

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    given_out = [o.partition("=")[2] for o in args.overrides if o.partition("=")[0].strip() == "log.out"]
    if args.out and given_out and given_out[-1] != args.out:
        raise ValueError(f"--out {args.out} and log.out={given_out[-1]} disagree: give one of them")
    overrides = list(args.overrides) + ([f"log.out={args.out}"] if args.out else [])
    # No --config: the bundled default (a CPU-sized run), not the paper-scale defaults of the dataclasses.
    cfg = load_config(args.config or bundled.ASSETS / "train.yaml", overrides)
    # One writer per output directory, taken before torch loads: a second run on it stops within a second.
    with lock.hold(cfg.log.out, "train"):
        return _run(args, cfg, console)


def _run(args, cfg, console) -> int:
    from rich.console import Console

    from flashdraft import distributed

    preflight(cfg, resume=args.resume)
    from flashdraft.train.loop import train

    with distributed.session(cfg.train.device, "train", output=cfg.log.out) as world:
        if not world.is_main:
            console = Console(quiet=True)
        result = train(cfg, resume=args.resume, console=console)
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

    from flashdraft import bundled
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


def add_nproc_argument(p) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="run N data-parallel processes on this machine (launches torchrun --standalone; sets "
        "NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set)",
    )


def relaunch_argv(args, command: str) -> list[str]:
    """The arguments of this command again, without --nproc: what each torchrun worker runs."""
    argv = [command]
    for flag in ("config", "out"):
        if getattr(args, flag, None):
            argv += [f"--{flag}", str(getattr(args, flag))]
    for flag in ("resume", "debug"):
        if getattr(args, flag, False):
            argv.append(f"--{flag}")
    return argv + list(getattr(args, "overrides", []))
