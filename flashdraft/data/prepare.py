"""`flashdraft prepare`: training data (JSONL / Parquet, local or S3) -> tokenised shards, once.

    flashdraft prepare --data data/regen/*.jsonl --tokenizer Qwen3.5-27B/ --out shards/qwen3.5-27b
    flashdraft prepare --data s3://bucket/regen/ --endpoint-url https://minio.local:9000 \\
        --tokenizer Qwen3.5-27B/ --out shards/qwen3.5-27b --max-length 3072 --skip-bad

The output directory is written atomically and stamped with a content hash of the inputs (file names with their
sizes and modification times or ETags — not their bytes, so a copied file counts as changed — the tokenizer, every
option that changes the output). Re-running with the same inputs reuses it;
different inputs refuse to overwrite it without --force. Bad records stop the run with the file and line (or row)
unless --skip-bad, which skips and counts them per reason. Prints a summary table and the output path.

One writer at a time: the shards are written under a lock beside the output directory (`.NAME.flashdraft-lock`,
flashdraft.io.lock); a second `prepare` of the same directory stops naming the first. A disk, quota or file-size
limit that fills up stops the run with the path and an estimate of the space needed; nothing half-written is left
(an existing output directory stays as it was).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections import deque
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from flashdraft.config import S3Config
from flashdraft.data.encoder import Encoder, Sample
from flashdraft.data.errors import DataError, DataReport, redact
from flashdraft.data.formats import FormatConfig
from flashdraft.data.shards import LAYOUT_VERSION, ShardWriter, read_meta
from flashdraft.data.sources import SourceFile, iter_records, resolve_sources
from flashdraft.io import lock
from flashdraft.io.atomic import leftovers_beside, remove_leftovers_beside
from flashdraft.io.space import room_for

OVERLONG = ("truncate", "drop")
AUTO_WORKERS_BYTES = 32 << 20
# What a tokenizer download fetches: configs and tokenizer.json, chat templates, sentencepiece / BPE vocabularies.
TOKENIZER_FILES = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")


@dataclass(kw_only=True)
class PrepareConfig:
    data: list[str]
    """Files, directories, globs or s3:// URLs (JSONL, JSONL.gz, Parquet), read in this order."""
    tokenizer: str
    """Directory of the target's tokenizer (its chat template renders chat records)."""
    out: str
    """Output shard directory."""
    format: FormatConfig = field(default_factory=FormatConfig)
    """How records become tokens and loss masks."""
    max_length: int = 3072
    """Longest sample, in tokens."""
    overlong: str = "truncate"
    """truncate (keep the first max_length tokens) | drop; counted either way."""
    skip_bad: bool = False
    """Skip bad records (counted per reason) instead of stopping at the first."""
    endpoint_url: str | None = None
    """S3-compatible endpoint; default AWS_ENDPOINT_URL (or AWS's own endpoint)."""
    s3: S3Config = field(default_factory=S3Config)
    """Timeouts and attempts of s3:// reads (see S3Config)."""
    force: bool = False
    """Rebuild, replacing an existing output directory."""
    progress: bool = True
    """Show a progress bar (bytes read)."""
    batch_size: int = 256
    """Records tokenised per batch."""
    workers: int | None = None
    """Processes that render and tokenise (chat templates are Python-bound, so rendering scales with processes);
    the output is identical for any number. None: one for inputs under 32 MiB (starting a process costs
    seconds) or under 4 cores, else half the cores, at most 8. More than one needs the usual
    `if __name__ == "__main__":` guard in a calling script (processes are spawned)."""

    def __post_init__(self):
        if isinstance(self.data, (str, os.PathLike)):
            self.data = [self.data]
        if not self.data:
            raise ValueError("data: give at least one file, directory, glob or s3:// URL")
        if self.max_length < 2:
            raise ValueError(f"max_length: must be at least 2, got {self.max_length}")
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong: expected one of {', '.join(OVERLONG)}, got {self.overlong!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be positive, got {self.batch_size}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers: must be at least 1, got {self.workers}")


@dataclass
class PrepareResult:
    path: Path
    counts: dict[str, Any]
    reused: bool
    report: DataReport | None = None  # None when reused


def load_tokenizer(path: str):
    """The tokenizer in directory `path`, or of hub id `path` from the hub cache (downloaded only with
    HF_HUB_OFFLINE=0, as targets are: see flashdraft.hub.resolve_model_dir)."""
    from transformers import AutoTokenizer

    from flashdraft.hub import resolve_model_dir

    try:
        directory = resolve_model_dir(path, what="tokenizer", allow_patterns=TOKENIZER_FILES)
    except OSError as exc:  # not a directory, not a hub id, or not cached
        raise DataError(str(exc), skippable=False) from None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as exc:
        raise DataError(
            f"cannot load a tokenizer ({type(exc).__name__}: {exc})", source=str(path), skippable=False
        ) from None


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides the token ids: vocabulary and rules, special tokens, chat template."""
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    h.update(json.dumps(str(tokenizer.chat_template)).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:16]


def input_hashes(files: list[SourceFile], tokenizer_hash: str, cfg: PrepareConfig) -> dict[str, str]:
    """Hashes of what decides the shards: sources (names, sizes, mtimes/ETags), tokenizer, options; and of all."""

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]

    # skip_bad is left out on purpose: a reuse without it is checked against the skip count instead (see _reuse).
    parts = {
        "sources": digest([_endpoint(cfg), [[f.url, f.kind, f.fingerprint] for f in files]]),
        "tokenizer": tokenizer_hash,
        "options": digest([LAYOUT_VERSION, cfg.format.as_dict(), cfg.max_length, cfg.overlong]),
    }
    return {**parts, "content": digest(parts)}


def _endpoint(cfg: PrepareConfig) -> str | None:
    url = cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return redact(url) if url else None


def _reuse(out: Path, hashes: dict[str, str], cfg: PrepareConfig) -> dict | None:
    """meta.json of `out` if it can be reused; None if `out` is to be (re)written; DataError if it must not be."""
    if cfg.force or not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    meta = read_meta(out)
    if meta is None:
        raise DataError(
            "exists and is not a flashdraft shard directory: pass --force to replace it, or choose another --out",
            source=str(out),
            skippable=False,
        )
    if meta.get("content_hash") != hashes["content"]:
        old = meta.get("input_hashes") or {}
        what = ", ".join(k for k in ("sources", "tokenizer", "options") if old.get(k) != hashes[k]) or "format version"
        raise DataError(
            f"holds shards of different inputs (changed: {what}): pass --force to replace them, or "
            "choose another --out",
            source=str(out),
            skippable=False,
        )
    skipped = sum((meta.get("counts") or {}).get("skipped", {}).values())
    if skipped and not cfg.skip_bad:
        raise DataError(
            f"these shards were written with --skip-bad and {skipped} bad records were skipped: pass "
            "--skip-bad to reuse them, or fix the data and pass --force",
            source=str(out),
            skippable=False,
        )
    return meta


def _fit(sample: Sample, cfg: PrepareConfig, report: DataReport) -> Sample | None:
    """Apply max_length and drop samples without loss tokens; count both."""
    if len(sample) > cfg.max_length:
        if cfg.overlong == "drop":
            report.dropped_overlong += 1
            return None
        report.truncated += 1
        sample = Sample(sample.input_ids[: cfg.max_length], sample.loss_mask[: cfg.max_length])
    if not sample.loss_mask.any():
        report.dropped_no_loss += 1
        return None
    return sample


def prepare_shards(cfg: PrepareConfig, *, tokenizer=None, console=None) -> PrepareResult:
    """Build (or reuse) the shards of `cfg`; see the module docstring."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    encoder = Encoder(tokenizer, cfg.format)
    if cfg.format.format in ("chat", "sharegpt"):
        encoder.check_chat_template()
    files = resolve_sources(cfg.data, endpoint_url=cfg.endpoint_url, s3=cfg.s3)
    tok_hash = tokenizer_fingerprint(tokenizer)
    hashes = input_hashes(files, tok_hash, cfg)
    out = Path(cfg.out)
    meta = _reuse(out, hashes, cfg)
    if meta is not None and not leftovers_beside(out):
        return PrepareResult(out, meta["counts"], reused=True)
    with lock.hold(out, "prepare", beside=True):
        # Every writer of `out` holds this lock: a temporary or set-aside copy beside it is a killed writer's.
        remove_leftovers_beside(out)
        # Another run may have written the same shards while this one was reading its inputs.
        meta = None if cfg.force else _reuse(out, hashes, cfg)
        if meta is not None:
            return PrepareResult(out, meta["counts"], reused=True)
        return _write(cfg, files, hashes, tok_hash, tokenizer, encoder, console)


def _write(cfg: PrepareConfig, files, hashes, tok_hash, tokenizer, encoder, console) -> PrepareResult:
    out = Path(cfg.out)
    report = DataReport(skip_bad=cfg.skip_bad)
    started = time.time()
    total, read, writer = sum(f.size for f in files), [0], None
    with ExitStack() as stack:
        kept = "the shards already there are unchanged" if out.exists() else "nothing was kept"
        stack.enter_context(
            room_for(
                out.parent,
                lambda: _needed(writer, read[0], total),
                f"the shards {out}",
                f"{kept[0].upper()}{kept[1:]}: make room, then run again",
            )
        )
        writer = stack.enter_context(ShardWriter(out, replace=True))
        advance = stack.enter_context(_progress(files, cfg, console))

        def counted(nbytes: int, records: int | None = None) -> None:
            read[0] += nbytes
            advance(nbytes, records)

        # bad lines come back in place (yield_errors), so the first error reported is the first in the files
        records = iter_records(files, report, progress=counted, yield_errors=True)
        batches = iter(lambda: list(islice(records, cfg.batch_size)), [])
        encoded = stack.enter_context(closing(_encoded(batches, encoder, _workers(cfg, files))))
        for batch, results in encoded:
            for rec, res in zip(batch, results, strict=True):
                if isinstance(res, DataError):
                    report.skip(res.at(rec.source, line=rec.line, row=rec.row))
                    continue
                sample = _fit(res, cfg, report)
                if sample is not None:
                    writer.add(sample)
            advance(0, records=report.records)
        report.kept, report.tokens, report.loss_tokens = len(writer), writer.num_tokens, writer.num_loss_tokens
        if report.kept == 0:
            raise DataError(
                f"no sample left to write (read {report.records} records; counts: {report.as_dict()})",
                source=", ".join(redact(d) for d in cfg.data),
                skippable=False,
            )
        writer.commit(
            {
                "content_hash": hashes["content"],
                "input_hashes": hashes,
                "tokenizer": {"name": str(tokenizer.name_or_path), "hash": tok_hash, "vocab_size": len(tokenizer)},
                "max_length": cfg.max_length,
                "overlong": cfg.overlong,
                "skip_bad": cfg.skip_bad,
                "format": cfg.format.as_dict(),
                "sources": [f.url for f in files],
                "endpoint_url": _endpoint(cfg),
                "counts": report.as_dict(),
                "seconds": round(time.time() - started, 2),
            }
        )
    return PrepareResult(out, report.as_dict(), reused=False, report=report)


def _needed(writer: ShardWriter | None, read: int, total: int) -> int:
    """About the size of the finished shards: what is written so far, scaled by the part of the input read."""
    written = writer.num_bytes if writer is not None else 0
    return int(written * total / read) if read and total > read else written


def _workers(cfg: PrepareConfig, files: list[SourceFile]) -> int:
    if cfg.workers is not None:
        return cfg.workers
    cores = os.cpu_count() or 1
    # The main process parses JSON and writes, and the Rust tokenizer already uses two threads: on few cores a
    # second process only competes with them for the same cores: one process under 4 cores, else half of them.
    if sum(f.size for f in files) < AUTO_WORKERS_BYTES or cores < 4:
        return 1
    return min(8, cores // 2)


def _encoded(batches, encoder: Encoder, workers: int):
    """(batch, results): results[i] is batch[i]'s Sample or DataError, in order; `workers` processes when > 1."""

    def merge(batch, samples):
        samples = iter(samples)
        return batch, [rec.error if rec.error is not None else next(samples) for rec in batch]

    def good(batch):
        return [rec.data for rec in batch if rec.error is None]

    if workers == 1:
        for batch in batches:
            yield merge(batch, encoder.encode_batch(good(batch)))
        return
    # spawn, not fork: the parent may hold threads (s3fs's event loop, the progress bar) that fork would copy
    # in an unknown state.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(encoder.tokenizer, encoder.config)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(encode_in_worker, (good(batch),))))
            # bounded read-ahead: a large remote dataset is never pulled into memory faster than it is encoded
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield merge(done, result.get())
        while pending:
            done, result = pending.popleft()
            yield merge(done, result.get())


_WORKER_ENCODER: Encoder | None = None


def _worker_init(tokenizer, fmt: FormatConfig) -> None:
    global _WORKER_ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER_ENCODER = Encoder(tokenizer, fmt)


def encode_in_worker(datas: list[dict]) -> list:
    return _WORKER_ENCODER.encode_batch(datas)


class _progress:
    """Context manager yielding `advance(nbytes, records=None)`, backed by a rich progress bar when enabled."""

    def __init__(self, files: list[SourceFile], cfg: PrepareConfig, console):
        self.total = sum(f.size for f in files) or None
        self.enabled = cfg.progress
        self.console = console

    def __enter__(self):
        if not self.enabled:
            return lambda nbytes, records=None: None
        from rich import progress as rp

        columns = (
            rp.TextColumn("[bold]reading"),
            rp.BarColumn(),
            rp.DownloadColumn(),
            rp.TransferSpeedColumn(),
            rp.TextColumn("{task.fields[records]:,} records"),
            rp.TimeRemainingColumn(),
        )
        self.bar = rp.Progress(*columns, console=self.console)
        self.bar.start()
        task = self.bar.add_task("read", total=self.total, records=0)

        def advance(nbytes: int, records: int | None = None) -> None:
            fields = {} if records is None else {"records": records}
            self.bar.update(task, advance=nbytes, **fields)

        return advance

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.stop()
