"""The index of an offline features directory (features.json; see features.py), checked field by field when read:
every message names the file and the field.

Format 2 adds the checksums: a CRC-32 of every sample's bytes, of every safetensors file's header and of the target's
head and config (checksums.py). Format 1, written before checksums, is still read, with a warning that it cannot be
verified.
"""

from __future__ import annotations

import json

from flashdraft.data import checksums
from flashdraft.data.errors import DataError

FORMAT = "flashdraft-features/2"
OLD_FORMAT = "flashdraft-features/1"  # no checksums
INDEX = "features.json"
HEAD = "head.safetensors"
CONFIG = "config.json"
RECAPTURE = "run `flashdraft features` again"


# field -> (check, what it must be)
_INDEX_FIELDS = {
    "target_layer_ids": (
        lambda v: isinstance(v, list) and v and all(type(i) is int and i >= 0 for i in v),
        "a non-empty list of layer indices",
    ),
    "hidden_size": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "dtype": (lambda v: v in ("bfloat16", "float16", "float32", "float64"), "bfloat16, float16, float32 or float64"),
    "data_hash": (lambda v: isinstance(v, str) and v, "the content hash of the tokenised data"),
    "num_samples": (lambda v: type(v) is int and v >= 0, "a sample count"),
    "files": (
        lambda v: isinstance(v, list) and all(isinstance(n, str) and "/" not in n for n in v),
        "a list of file names in the directory",
    ),
    "samples": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of file names"),
}


def read_index(fs, root: str, url: str, s3=None) -> dict:
    """features.json, checked field by field; DataError naming the file and the field. `s3`: the S3Config whose
    attempts a transfer cut off is read again for (default its defaults)."""
    from flashdraft.config import S3Config
    from flashdraft.data.remote import fs_endpoint, is_remote_error, read_again_if_cut_off, remote_error

    s3 = s3 or S3Config()
    where = f"{url.rstrip('/')}/{INDEX}"
    try:
        raw = read_again_if_cut_off(lambda: fs.cat_file(f"{root}/{INDEX}"), s3.attempts, where)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"data.features = {url}: no {INDEX} there (run `flashdraft features --out "
            f"{url}` first; the index is written last, so a cut-off run has none)"
        ) from None
    except Exception as exc:
        if not is_remote_error(exc):
            raise
        raise remote_error(exc, where, s3, fs_endpoint(fs)) from None

    def bad(what: str, field: str | None = None) -> DataError:
        return DataError(what, reason="unreadable_file", source=where, field=field, skippable=False)

    try:
        index = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise bad(f"not valid UTF-8 (byte {exc.start}): the file is damaged; run `flashdraft features` again") from None
    except json.JSONDecodeError as exc:
        raise bad(
            f"not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno}): the file is damaged; run "
            "`flashdraft features` again"
        ) from None
    if not isinstance(index, dict):
        raise bad(f"expected a JSON object, got {type(index).__name__}")
    if index.get("format") not in (OLD_FORMAT, FORMAT):
        raise bad(
            f"format {index.get('format')!r}, not {FORMAT}: capture the features again with this version", "format"
        )
    if not isinstance(index.get("final_hidden", False), bool):  # absent in indices written before it existed
        raise bad(f"expected true or false, got {index['final_hidden']!r:.80}", "final_hidden")
    for field, (ok, expected) in _INDEX_FIELDS.items():
        if field not in index:
            raise bad("missing", field)
        if not ok(index[field]):
            raise bad(f"expected {expected}, got {index[field]!r:.80}", field)
    if len(index["samples"]) != index["num_samples"]:
        raise bad(f"{len(index['samples'])} entries for num_samples = {index['num_samples']}", "samples")
    unknown = sorted(set(index["samples"]) - set(index["files"]))
    if unknown:
        raise bad(f"names {unknown[0]}, which is not among the index's files", "samples")
    if index["format"] == OLD_FORMAT:
        checksums.warn_unverified(url, f"to add them, {RECAPTURE}")
        index["checksums"] = None
    else:
        sums = checksums.read_sums(index.get("checksums"), index["num_samples"], ("samples",), (), where, RECAPTURE)
        headers, whole = sums.get("headers"), sums.get("files")  # of each part's header; of the head and config
        if not (
            sums["records_per_chunk"] == 1  # a sample is read whole, so it is checked whole
            and isinstance(headers, dict)
            and all(checksums.is_crc(headers.get(name)) for name in index["files"])
            and isinstance(whole, dict)
            and all(checksums.is_crc(whole.get(name)) for name in (HEAD, CONFIG))
        ):
            raise bad(
                f"expected a {checksums.ALGORITHM} of every sample, part header, {HEAD} and {CONFIG}, missing or "
                f"garbled: the file is damaged; {RECAPTURE}",
                "checksums",
            )
    return index
