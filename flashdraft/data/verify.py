"""`flashdraft prepare --verify DIR`: every checksum of a shard directory (`prepare`) or an offline features
directory (`features`, local or s3://) checked, every damaged file and record range named.

    flashdraft prepare --verify shards/qwen3.5-27b          # exit 0: all verify; 1: damage found (or no checksums)

Training checks each chunk the first time it reads it (checksums.py); the scan reads everything once, so damage
is found before a run starts, or after one has stopped on it, to see how much is damaged. It goes on past damage.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.data import checksums
from flashdraft.data.errors import DataError


@dataclass
class Scan:
    path: str
    kind: str
    """shards | features"""
    records: int = 0
    """Records (samples) whose checksums were checked."""
    damage: list[DataError] = field(default_factory=list)
    """One error per damaged file and record range (or file that cannot be opened as it should)."""
    unverified: bool = False
    """Written before checksums existed: nothing could be checked."""

    @property
    def ok(self) -> bool:
        return not self.damage and not self.unverified


def kind_of(path: str, s3=None) -> str:
    """shards or features; a DataError when `path` is neither."""
    from flashdraft.data.feature_index import INDEX
    from flashdraft.data.remote import open_fs
    from flashdraft.data.shards import META

    if "://" not in path and (Path(path) / META).is_file():
        return "shards"
    fs, root = open_fs(path, s3=s3)
    if fs.exists(f"{root}/{INDEX}"):
        return "features"
    raise DataError(
        f"neither a shard directory ({META}, from `flashdraft prepare`) nor a features directory ({INDEX}, from "
        "`flashdraft features`)",
        source=path,
        skippable=False,
    )


def scan(path: str, *, s3=None, progress=None) -> Scan:
    """Check every checksum at `path`. `progress(total=None, advance=0)`: told the number of records, then each
    record checked."""
    progress = progress or (lambda total=None, advance=0: None)
    kind = kind_of(path, s3)
    result = Scan(str(path), kind)
    try:
        (_shards if kind == "shards" else _features)(path, s3, result, progress)
    except DataError as exc:  # a file that cannot even be opened as it should (a wrong size, a garbled index)
        result.damage.append(exc)
    return result


def _shards(path: str, s3, result: Scan, progress) -> None:
    from flashdraft.data.shards import TokenizedDataset

    ds = TokenizedDataset(path)
    if ds.checksums is None:
        result.unverified = True
        return
    progress(total=len(ds))
    for chunk in range(checksums.num_chunks(len(ds), ds.per_chunk)):
        result.damage += ds.damage(chunk)
        n = len(checksums.chunk_records(chunk, len(ds), ds.per_chunk))
        result.records += n
        progress(advance=n)


def _features(path: str, s3, result: Scan, progress) -> None:
    from flashdraft.data.feature_index import CONFIG, HEAD
    from flashdraft.data.features import FeatureStore

    store = FeatureStore(path, s3=s3)
    if store.sums is None:
        result.unverified = True
        return
    progress(total=store.index["num_samples"])
    for name in (CONFIG, HEAD):
        try:
            store.file(name)
        except DataError as exc:
            result.damage.append(exc)
    held = defaultdict(list)
    for i, name in enumerate(store.index["samples"]):
        held[name].append(i)
    for name in store.index["files"]:
        try:
            store.header(name)
        except DataError as exc:  # none of its records can be found
            result.damage.append(exc)
            progress(advance=len(held[name]))
            continue
        for i in held[name]:
            try:
                store.sample(i)
            except DataError as exc:
                result.damage.append(exc)
            result.records += 1
            progress(advance=1)


def report(result: Scan, console) -> None:
    """OK, or the damaged files and record ranges, on `console` (rich)."""
    from rich.markup import escape

    what = result.kind
    if result.unverified:
        remedy = (
            "`flashdraft prepare --force` rebuilds them with checksums"
            if result.kind == "shards"
            else "`flashdraft features` captures them again with checksums"
        )
        console.print(
            f"[bold yellow]cannot verify[/]: the {what} in {escape(result.path)} were written without checksums; "
            f"{remedy}",
            soft_wrap=True,
        )
    elif result.damage:
        n = len(result.damage)
        console.print(
            f"[bold red]DAMAGED[/]: the {what} in {escape(result.path)}: {n} {'check fails' if n == 1 else 'checks fail'}:"
        )
        for exc in result.damage:
            console.print(f"  {escape(str(exc))}", soft_wrap=True)
    else:
        console.print(f"[bold green]OK[/]: the {what} in {escape(result.path)}: {result.records:,} records verify")
