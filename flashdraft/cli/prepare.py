"""`flashdraft prepare`: the arguments of the command, turned into a `PrepareConfig` for
flashdraft.data.prepare.prepare_shards (which says what the command does)."""

from __future__ import annotations

import json

from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.config import S3Config
from flashdraft.data import prepare
from flashdraft.data.errors import DataReport
from flashdraft.data.formats import FORMATS, FormatConfig
from flashdraft.data.prepare import OVERLONG, PrepareConfig, prepare_shards


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenise training data (JSONL/Parquet, local or s3://) into shards, once",
        description=prepare.__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--data",
        action="append",
        required=True,
        metavar="PATH_OR_GLOB_OR_S3",
        help="file, directory, glob or s3:// URL of .jsonl / .jsonl.gz / .parquet (repeatable)",
    )
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="the target's tokenizer directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output shard directory")
    p.add_argument("--format", default="auto", choices=FORMATS, help="record format (default: auto, per record)")
    p.add_argument("--max-length", type=int, default=3072, help="longest sample in tokens (default 3072)")
    p.add_argument("--overlong", default="truncate", choices=OVERLONG, help="overlong samples: truncate or drop")
    p.add_argument("--skip-bad", action="store_true", help="skip bad records (counted per reason) instead of stopping")
    p.add_argument("--drop-thinking", action="store_true", help="remove <think>...</think> / reasoning_content")
    p.add_argument("--split-marker", default=None, help="text records: loss only after this marker")
    p.add_argument("--append-eos", action="store_true", help="text records: append the EOS token")
    p.add_argument(
        "--template-kwargs",
        default=None,
        metavar="JSON",
        help="extra chat-template variables, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    defaults = S3Config()
    p.add_argument(
        "--s3-connect-timeout",
        type=float,
        default=defaults.connect_timeout,
        metavar="S",
        help=f"s3://: seconds to wait for a connection (default {defaults.connect_timeout:g})",
    )
    p.add_argument(
        "--s3-read-timeout",
        type=float,
        default=defaults.read_timeout,
        metavar="S",
        help=f"s3://: seconds an open connection may stay silent (default {defaults.read_timeout:g})",
    )
    p.add_argument(
        "--s3-attempts",
        type=int,
        default=defaults.attempts,
        metavar="N",
        help=f"s3://: tries per request, the first included (default {defaults.attempts})",
    )
    p.add_argument("--force", action="store_true", help="rebuild and replace an existing --out")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenising processes (default: 1 for small inputs, else half the cores, max 8)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _json_object(text: str | None, option: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option}: expected a JSON object such as '{{\"enable_thinking\": false}}', got {text!r}")
    return value


def _s3_config(args) -> S3Config:
    for flag, value in (("--s3-connect-timeout", args.s3_connect_timeout), ("--s3-read-timeout", args.s3_read_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} {value:g}: must be > 0 (seconds)")
    if args.s3_attempts < 1:
        raise ValueError(f"--s3-attempts {args.s3_attempts}: must be >= 1 (the first try included)")
    return S3Config(
        connect_timeout=args.s3_connect_timeout, read_timeout=args.s3_read_timeout, attempts=args.s3_attempts
    )


def run(args) -> int:
    from rich.console import Console

    cfg = PrepareConfig(
        data=list(args.data),
        tokenizer=args.tokenizer,
        out=args.out,
        format=FormatConfig(
            format=args.format,
            drop_thinking=args.drop_thinking,
            split_marker=args.split_marker,
            append_eos=args.append_eos,
            template_kwargs=_json_object(args.template_kwargs, "--template-kwargs"),
        ),
        max_length=args.max_length,
        overlong=args.overlong,
        skip_bad=args.skip_bad,
        endpoint_url=args.endpoint_url,
        s3=_s3_config(args),
        force=args.force,
        progress=not args.no_progress,
        workers=args.workers,
    )
    result = prepare_shards(cfg, console=Console(stderr=True))
    out = Console()
    if result.reused:
        out.print(f"reusing the shards in {result.path} (same inputs, tokenizer and options; --force rebuilds)")
        counts = result.counts
        report = DataReport(skip_bad=cfg.skip_bad, **{k: v for k, v in counts.items() if k != "skipped"})
        report.skipped.update(counts.get("skipped", {}))
    else:
        report = result.report
    out.print(report.table())
    out.print(f"shards: {result.path}")
    return EXIT_OK
