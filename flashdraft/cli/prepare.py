"""`flashdraft prepare`: the data section of the config (what to tokenise, with which tokenizer, into which shard
directory, how) and the prepare section, as a `PrepareConfig` for flashdraft.data.prepare.prepare_shards (which
says what the command does). With a training run's --config it writes the shards that run reads (data.shards).
`--verify DIR` checks the checksums of shards or offline features instead (flashdraft.data.verify)."""

from __future__ import annotations

import functools

from flashdraft import bundled
from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_CHECK_FAILED, EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (
    Shortcut("data.train", flag="--data", repeat=True, metavar="PATH_OR_GLOB_OR_S3"),
    Shortcut("data.tokenizer", metavar="DIR"),
    Shortcut("data.shards", flag="--out", metavar="DIR"),
    *options.shortcuts("data.format", "data.max_length", "data.overlong", "data.skip_bad", "data.drop_thinking"),
    *options.shortcuts("prepare.split_marker", "prepare.append_eos", "prepare.template_kwargs", "prepare.endpoint_url"),
    Shortcut("s3.connect_timeout", flag="--s3-connect-timeout", metavar="S"),
    Shortcut("s3.read_timeout", flag="--s3-read-timeout", metavar="S"),
    Shortcut("s3.attempts", flag="--s3-attempts", metavar="N"),
    *options.shortcuts("prepare.force", "prepare.workers"),
    Shortcut("prepare.progress", negate=True),
    Shortcut("prepare.verify", metavar="DIR"),
)


def add_parser(sub) -> None:
    from flashdraft.data import prepare

    p = sub.add_parser(
        "prepare",
        help="tokenise training data (JSONL/Parquet, local or s3://) into shards, once",
        description=prepare.__doc__.split("\n\n")[0],
    )
    options.add(p, execute, SHORTCUTS)


def tokenizer_of(cfg) -> str | None:
    """data.tokenizer, else the target's (target.path): named, or the bundled one for the bundled data."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if cfg.target.path != bundled.BUNDLED:
        return cfg.target.path
    return str(bundled.tokenizer_dir()) if cfg.data.train == [bundled.BUNDLED] else None


def execute(cfg, args) -> int:
    from rich.console import Console

    from flashdraft.data.errors import DataReport
    from flashdraft.data.formats import FormatConfig
    from flashdraft.data.prepare import PrepareConfig, prepare_shards

    if cfg.prepare.verify:
        return verify(cfg)
    tokenizer = tokenizer_of(cfg)
    # User data is never tokenised with the bundled tokenizer by default: a tokenizer (or target) is named.
    options.require(args, cfg, *(["data.tokenizer"] if tokenizer is None else []), "data.shards")
    sources = bundled.train_data() if cfg.data.train == [bundled.BUNDLED] else cfg.data.train
    job = PrepareConfig(
        data=list(sources),
        tokenizer=tokenizer,
        out=cfg.data.shards,
        format=FormatConfig(
            format=cfg.data.format,
            drop_thinking=cfg.data.drop_thinking,
            split_marker=cfg.prepare.split_marker,
            append_eos=cfg.prepare.append_eos,
            template_kwargs=cfg.prepare.template_kwargs,
        ),
        max_length=cfg.data.max_length,
        overlong=cfg.data.overlong,
        skip_bad=cfg.data.skip_bad,
        endpoint_url=cfg.prepare.endpoint_url,
        s3=cfg.s3,
        force=cfg.prepare.force,
        progress=cfg.prepare.progress,
        workers=cfg.prepare.workers,
    )
    result = prepare_shards(job, console=Console(stderr=True))
    out = Console()
    if result.reused:
        out.print(f"reusing the shards in {result.path} (same inputs, tokenizer and options; --force rebuilds)")
        counts = result.counts
        report = DataReport(skip_bad=job.skip_bad, **{k: v for k, v in counts.items() if k != "skipped"})
        report.skipped.update(counts.get("skipped", {}))
    else:
        report = result.report
    out.print(report.table())
    out.print(f"shards: {result.path}")
    return EXIT_OK


def verify(cfg) -> int:
    """The scan of `prepare.verify`, with a progress bar: exit 0 when everything verifies, 1 otherwise."""
    from rich import progress as rp
    from rich.console import Console

    from flashdraft.data.verify import report, scan

    err = Console(stderr=True)
    columns = (rp.TextColumn("[bold]verifying"), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeRemainingColumn())
    with rp.Progress(*columns, console=err, disable=not cfg.prepare.progress, transient=True) as bar:
        task = bar.add_task("verify", total=None)
        result = scan(cfg.prepare.verify, s3=cfg.s3, progress=functools.partial(bar.update, task))
    report(result, Console())
    return EXIT_OK if result.ok else EXIT_CHECK_FAILED
