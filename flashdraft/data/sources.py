"""Find and stream training records: JSONL (`.jsonl`, `.jsonl.gz`) or Parquet, local or `s3://` (via fsspec/s3fs).

    files = resolve_sources(["data/*.jsonl", "s3://bucket/chat/"], endpoint_url=None)
    for rec in iter_records(files, report):        # rec.data: dict; rec.where(): "file:line" / "file row N"
        ...

A spec is a file, a directory (searched recursively), a glob, or the same on a remote store. Remote files are read
as streams — JSONL line by line through a read-ahead buffer, Parquet row group by row group — so a large dataset is
never downloaded in full before work starts. S3 credentials come from the usual AWS variables and profiles (s3fs /
botocore resolve them); an S3-compatible store is reached with `endpoint_url` or `AWS_ENDPOINT_URL`. Messages show
paths with any embedded credentials removed, and never a secret.

Reaching the object store, its errors and its retries are remote.py's.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashdraft.config import S3Config
from flashdraft.data.errors import DataError, DataReport, redact
from flashdraft.data.remote import endpoint, fs_endpoint, is_remote_error, open_fs, read_again_if_cut_off, remote_error

SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
_GLOB_CHARS = "*?["
_HAS_USERINFO = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/]*@")


@dataclass(frozen=True)
class SourceFile:
    """One input file. `url` is for messages (protocol included, credentials removed); `path` is the fs path."""

    url: str
    path: str
    kind: str  # "jsonl" | "parquet"
    size: int
    fingerprint: str  # size + mtime (local) or ETag (remote): identifies the content without reading it
    fs: Any = field(compare=False, repr=False)
    s3: S3Config = field(default_factory=S3Config, compare=False, repr=False)

    def storage_error(self, exc: BaseException) -> DataError:
        """`exc`, a failure of the storage behind this file, as the DataError that names the file and the fix."""
        return remote_error(exc, self.url, self.s3, fs_endpoint(self.fs))

    def open_raw(self):
        """The file's bytes as fsspec opens them (a failure to reach them raised as `storage_error`)."""
        try:
            return self.fs.open(self.path, "rb")
        except Exception as exc:
            raise self.storage_error(exc) from None


@dataclass
class Record:
    data: dict | None
    source: str
    line: int | None = None  # 1-based line of a JSONL file
    row: int | None = None  # 0-based row of a Parquet file
    error: DataError | None = None  # a bad line/row/file (only with iter_records(..., yield_errors=True))

    def where(self) -> str:
        if self.line is None and self.row is None:
            return self.source
        return f"{self.source}:{self.line}" if self.line is not None else f"{self.source} row {self.row}"


def file_kind(path: str) -> str | None:
    name = path.lower()
    for suffix, kind in SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return None


def _display(protocol: str, path: str) -> str:
    return redact(path if protocol in ("file", "local") else f"{protocol}://{path}")


def _fingerprint(info: dict) -> str:
    tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
    return f"{info.get('size')}:{tag}"


def resolve_sources(
    specs: Sequence[str], *, endpoint_url: str | None = None, s3: S3Config | None = None
) -> list[SourceFile]:
    """The input files of `specs` (files, directories, globs; local or remote), in order, each spec sorted.

    Raises a non-skippable DataError naming the spec when it matches nothing, names an unsupported file type, or
    the store cannot be reached (no credentials, access denied, no such bucket, no answer within the timeouts of
    `s3`).
    """
    s3 = s3 or S3Config()
    files: list[SourceFile] = []
    for spec in specs:
        spec = os.path.expanduser(str(spec))
        shown = redact(spec)
        if _HAS_USERINFO.match(spec):
            raise DataError(
                "credentials inside the URL are not supported (they would end up in logs): use "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile",
                reason="unreadable_file",
                source=shown,
                skippable=False,
            )
        protocol = spec.split("://", 1)[0] if "://" in spec else "file"
        try:
            fs, root = open_fs(spec, endpoint_url, s3)
        except ImportError as exc:
            raise DataError(
                f"no filesystem for '{protocol}://' ({exc}); for S3 install s3fs (pip install s3fs)",
                reason="unreadable_file",
                source=shown,
                skippable=False,
            ) from None
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        try:
            infos = _expand(fs, root)
        except DataError as err:
            raise err.at(shown) from None
        except Exception as exc:
            raise remote_error(exc, shown, s3, endpoint(endpoint_url)) from None
        if not infos:
            raise DataError(
                "matches no .jsonl, .jsonl.gz or .parquet file", reason="unreadable_file", source=shown, skippable=False
            )
        for path, info in infos:
            size = int(info.get("size") or 0)
            files.append(
                SourceFile(
                    url=_display(protocol, path),
                    path=path,
                    kind=file_kind(path),
                    size=size,
                    fingerprint=_fingerprint(info),
                    fs=fs,
                    s3=s3,
                )
            )
    return files


def _expand(fs, root: str) -> list[tuple[str, dict]]:
    if any(c in root for c in _GLOB_CHARS):
        found = fs.glob(root, detail=True)
        return sorted((p, i) for p, i in found.items() if i.get("type") != "directory" and file_kind(p))
    info = fs.info(root)  # FileNotFoundError when absent
    if info.get("type") == "directory":
        found = fs.find(root, detail=True)
        return sorted((p, i) for p, i in found.items() if file_kind(p))
    if file_kind(root) is None:
        raise DataError(
            "unsupported file type: expected .jsonl, .jsonl.gz or .parquet", reason="unreadable_file", skippable=False
        )
    return [(root, info)]


def iter_records(
    files: Sequence[SourceFile], report: DataReport | None = None, progress=None, *, yield_errors: bool = False
) -> Iterator[Record]:
    """Stream the records of `files` in order; `progress(nbytes)` is called as bytes are read.

    A bad line/row or an unreadable file goes to `report.skip` (which raises unless `report.skip_bad`; without a
    report the first one raises). With `yield_errors` it is yielded in its place as a Record with `error` set, so
    a consumer that finds more errors later (e.g. while tokenising) can report them all in file order. Errors
    `--skip-bad` must not hide (missing credentials, access denied) are always raised.
    """
    report = report if report is not None else DataReport()
    for f in files:
        report.files += 1
        reader = _iter_jsonl if f.kind == "jsonl" else _iter_parquet
        try:
            for rec in reader(f, report, progress):
                if rec.error is None or yield_errors:
                    yield rec
                else:
                    report.skip(rec.error)
            continue
        except DataError as exc:
            bad = exc.at(f.url)
        except (OSError, EOFError, zlib.error) as exc:
            remote = is_remote_error(exc) or isinstance(exc, (FileNotFoundError, PermissionError))
            if remote or "credentials" in str(exc).lower():
                raise f.storage_error(exc) from None
            bad = DataError(
                f"unreadable or corrupt file ({type(exc).__name__}: {redact(str(exc))})",
                reason="unreadable_file",
                source=f.url,
            )
        except Exception as exc:
            if is_remote_error(exc):
                raise f.storage_error(exc) from None
            raise
        if yield_errors and bad.skippable:
            yield Record(None, f.url, error=bad)
        else:
            report.skip(bad)


class _Stream:
    """A read-only binary stream over an fsspec file: reads cut off mid-transfer are read again (`s3.attempts`),
    and bytes read are reported, so progress is in bytes of the (compressed) source. Seekable for Parquet."""

    def __init__(self, raw, progress, f: SourceFile):
        self.raw, self.progress, self.f = raw, progress, f

    def read(self, n=-1):
        # fsspec moves the position only when a read succeeds, so reading again asks for the same bytes (a ranged
        # GET): a JSONL line cut mid-way resumes where it stopped, and no record is read twice or skipped.
        data = read_again_if_cut_off(lambda: self.raw.read(n), self.f.s3.attempts, self.f.url)
        if self.progress is not None and data:
            self.progress(len(data))
        return data

    def seek(self, offset, whence=0):
        return self.raw.seek(offset, whence)

    def tell(self):
        return self.raw.tell()

    def readable(self):
        return True

    def seekable(self):
        return True

    @property
    def closed(self):
        return self.raw.closed

    def close(self):
        pass


def _iter_jsonl(f: SourceFile, report: DataReport, progress) -> Iterator[Record]:
    with f.open_raw() as raw:
        stream = _Stream(raw, progress, f)
        lines = gzip.GzipFile(fileobj=stream, mode="rb") if f.path.lower().endswith(".gz") else _lines(stream)
        n_records = 0
        for lineno, line in enumerate(lines, start=1):
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue
            n_records += 1
            report.records += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _bad(
                    f, lineno, f"not valid UTF-8 (byte {exc.start}: {line[exc.start : exc.start + 1]!r})", "non_utf8"
                )
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                yield _bad(f, lineno, f"malformed JSON: {exc.msg} (column {exc.colno})", "malformed_json")
                continue
            if not isinstance(data, dict):
                yield _bad(f, lineno, f"expected a JSON object, got {type(data).__name__}", "not_an_object")
                continue
            yield Record(data, f.url, line=lineno)
        if n_records == 0:
            raise DataError("empty file (no records)", reason="empty_file", source=f.url)


def _bad(f: SourceFile, line: int, what: str, reason: str) -> Record:
    return Record(None, f.url, line=line, error=DataError(what, reason=reason, source=f.url, line=line))


def _lines(stream, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Lines of a binary stream, read in `chunk`-byte pieces (fsspec files are not always line-iterable)."""
    buf = b""
    while True:
        data = stream.read(chunk)
        if not data:
            break
        buf += data
        *complete, buf = buf.split(b"\n")
        yield from complete
    if buf:
        yield buf


def _iter_parquet(f: SourceFile, report: DataReport, progress) -> Iterator[Record]:
    import pyarrow.parquet as pq

    with f.open_raw() as raw:
        try:
            pf = pq.ParquetFile(_Stream(raw, None, f))
        except Exception as exc:
            if is_remote_error(exc):
                raise
            raise DataError(
                f"not a readable Parquet file ({type(exc).__name__}: {exc})", reason="unreadable_file", source=f.url
            ) from None
        meta = pf.metadata
        if meta.num_rows == 0:
            raise DataError("empty file (no rows)", reason="empty_file", source=f.url)
        row = 0
        done = 0
        for g in range(meta.num_row_groups):
            rows = pf.read_row_group(g).to_pylist()
            if progress is not None:
                group = meta.row_group(g)
                nbytes = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
                nbytes = min(nbytes, max(f.size - done, 0))
                done += nbytes
                progress(nbytes)
            for data in rows:
                report.records += 1
                yield Record(data, f.url, row=row)
                row += 1
        if progress is not None and f.size > done:
            progress(f.size - done)
