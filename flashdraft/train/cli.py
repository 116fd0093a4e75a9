"""CLI glue for `flashdraft train` (the loop lives in flashdraft.train.loop)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a DFlash drafter (no arguments: the embedded default on this machine)")
    p.add_argument("--config", default=None, help="YAML config (see examples/); default: the embedded default")
    p.add_argument("--out", default=None, help="output directory (overrides log.out)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in OUT")
    p.add_argument("--help-config", action="store_true", help="list every config field with its default and meaning")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="dotted overrides, e.g. optim.lr=3e-4")
    p.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console

    from flashdraft.config import describe_fields, load_config

    console = Console()
    if args.help_config:
        for name, default, doc in describe_fields():
            console.print(f"[bold]{name}[/] = {default}\n    {doc}")
        return 0
    from flashdraft import embedded

    overrides = list(args.overrides) + ([f"log.out={args.out}"] if args.out else [])
    # No --config: the embedded default (a CPU-sized run), not the paper-scale defaults of the dataclasses.
    cfg = load_config(args.config or embedded.ASSETS / "train.yaml", overrides)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from flashdraft.train.loop import train

    result = train(cfg, resume=args.resume, console=console)
    console.print(f"\n[bold green]done[/]: {result.steps} steps, loss {result.loss:.3f}, simulated τ {result.sim_tau:.2f}"
                  + (f", measured τ {result.measured_tau:.2f} (greedy, held-out prompts)" if result.measured_tau else ""),
                  soft_wrap=True)  # fmt: skip
    console.print(
        f"checkpoint: {result.checkpoint}\nmetrics:    {result.out / 'metrics.jsonl'}\ncurve:      {result.curve}",
        soft_wrap=True,
    )
    return 0
