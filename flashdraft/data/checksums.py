"""Checksums of data files, checked when a record is first read: a byte damaged on disk stops the run with the file
and the records it holds, before they reach a loss.

Shards (shards.py) keep one CRC-32 per chunk of RECORDS_PER_CHUNK samples of each of their files in meta.json;
offline features (features.py) one per sample, one per safetensors header, and one per whole small file in
features.json. CRC-32 (zlib, in the standard library) runs at about 2 GB/s on one core and detects every burst of
up to 32 flipped bits, so any one damaged byte; it guards against rot, not against someone forging the files.

Files written before checksums existed are read as before, with one warning per directory and process that they
cannot be verified.
"""

from __future__ import annotations

import logging
import zlib

from flashdraft.data.errors import DataError

logger = logging.getLogger(__name__)

ALGORITHM = "crc32"
# Shards: a reader verifies the whole chunk of the sample it reads, once per process. 256 samples of at most
# data.max_length tokens (3072: 3.75 MiB of token ids and masks) hash in about 2 ms, small next to a training step
# even while every sample of a batch falls in a chunk not yet verified; and a million samples take ~12k checksums
# (~150 KB of meta.json).
RECORDS_PER_CHUNK = 256

_warned: set[str] = set()


def crc(data, value: int = 0) -> int:
    """CRC-32 of bytes or of a C-contiguous array (a memory map reads only the bytes it covers), continuing from
    `value`, the CRC-32 of what came before."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


def chunk_records(chunk: int, n: int, per_chunk: int = RECORDS_PER_CHUNK) -> range:
    """The records of `chunk` among n."""
    return range(chunk * per_chunk, min(n, (chunk + 1) * per_chunk))


def num_chunks(n: int, per_chunk: int = RECORDS_PER_CHUNK) -> int:
    return -(-n // per_chunk)


def records_text(records: range) -> str:
    return f"record {records.start}" if len(records) == 1 else f"records {records.start}-{records[-1]}"


def mismatch(path, what: str, stored: int, read: int, remedy: str) -> DataError:
    """The error of `what` (e.g. "records 256-511", "the header") of file `path`, whose checksum is not `stored`."""
    fails = "fail their" if what.startswith("records ") else "fails its"
    return DataError(
        f"{what} {fails} checksum (stored {stored:08x}, read {read:08x}): the file is damaged; {remedy}",
        reason="damaged_file",
        source=str(path),
        skippable=False,
    )


def check(path, what: str, stored: int, data, remedy: str) -> None:
    """A DataError (`mismatch`) unless the CRC-32 of `data` is `stored`."""
    read = crc(data)
    if read != stored:
        raise mismatch(path, what, stored, read, remedy)


def warn_unverified(path, remedy: str) -> None:
    """Once per path and process: the files at `path` carry no checksums (written before they existed)."""
    key = str(path)
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s: written without checksums, so damage on disk cannot be detected; %s", key, remedy)


def is_crc(value) -> bool:
    return type(value) is int and 0 <= value <= 0xFFFFFFFF


def read_sums(sums, n: int, lists: tuple[str, ...], singles: tuple[str, ...], where, remedy: str) -> dict:
    """`sums`, the checksums entry of an index (meta.json, features.json) of n records, checked: the algorithm, a
    positive records_per_chunk, a CRC-32 per chunk under each key of `lists` and one under each of `singles`; a
    DataError naming `where` and the field otherwise (a garbled entry would otherwise turn checking off)."""
    per_chunk = sums.get("records_per_chunk") if isinstance(sums, dict) else None
    ok = (
        isinstance(sums, dict)
        and type(n) is int
        and n >= 0
        and sums.get("algorithm") == ALGORITHM
        and type(per_chunk) is int
        and per_chunk > 0
        and all(is_crc(sums.get(k)) for k in singles)
        and all(
            isinstance(sums.get(k), list) and len(sums[k]) == num_chunks(n, per_chunk) and all(map(is_crc, sums[k]))
            for k in lists
        )
    )
    if not ok:
        raise DataError(
            f"expected a {ALGORITHM} per chunk of records of each file, missing or garbled: the file is damaged; "
            f"{remedy}",
            reason="damaged_file",
            source=str(where),
            field="checksums",
            skippable=False,
        )
    return sums
