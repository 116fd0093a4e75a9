"""Tokenised shards: written once, atomically; read memory-mapped by every rank.

A shard directory holds
    input_ids.bin   int32, all samples' token ids concatenated
    loss_mask.bin   uint8, their loss masks (1 = response token), same layout
    index.npy       int64 [N, 2]: (offset, length) of each sample, in tokens
    meta.json       format_version, counts, the checksums, and whatever the writer adds (tokenizer, options,
                    content hash)

Format 2 keeps a CRC-32 of every chunk of 256 samples of each file (and of index.npy's header) in meta.json; a
sample is returned only once its chunk has been checked (once per process: see checksums.py), and a damaged chunk is
a DataError naming the file and the records. Format 1 (before checksums; the same token files, so the same content
hash) is still read, with a warning that it cannot be verified.

    ds = TokenizedDataset("shards/qwen3.5")       # cheap: maps the files, reads nothing
    for i in ds.epoch_order(epoch, seed, rank, world_size):
        input_ids, loss_mask = ds[i]

The order depends only on (number of samples, seed, epoch, rank, world_size) — not on numpy's generator streams
(which may change between numpy versions) nor on the number of loader workers: keys are a splitmix64 hash of the
sample index, the seed and the epoch, and the permutation sorts them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.data import checksums
from flashdraft.data.checksums import RECORDS_PER_CHUNK, crc
from flashdraft.data.encoder import Sample
from flashdraft.data.errors import DataError
from flashdraft.io.atomic import fsync_dir, fsync_file, replace_directory, temporary_directory_beside

FORMAT_VERSION = 2
# The layout of the token, mask and index files, which the content hash covers (flashdraft.data.prepare): format 2
# only added checksums to meta.json, so the shards of format 1, and the features captured from them, stay valid.
LAYOUT_VERSION = 1
READABLE = (1, FORMAT_VERSION)
REBUILD = "rebuild the shards with `flashdraft prepare --force` (or remove them: `train` tokenises again)"
INPUT_IDS, LOSS_MASK, INDEX, META = "input_ids.bin", "loss_mask.bin", "index.npy", "meta.json"
TAILS = ("drop", "pad")


class ShardWriter:
    """Streams samples into a temporary directory beside `out`; `commit(meta)` renames it to `out`.

    Used as a context manager: leaving the block with an exception (or without commit) removes the temporary
    directory, so `out` is never left half-written. `replace=True` allows an existing `out` to be replaced.
    """

    def __init__(self, out: str | os.PathLike, *, replace: bool = False):
        self.out = Path(out)
        self.replace = replace
        self.tmp = temporary_directory_beside(self.out)
        self._ids = open(self.tmp / INPUT_IDS, "wb")
        self._mask = open(self.tmp / LOSS_MASK, "wb")
        self._offsets, self._lengths = array("q"), array("q")
        self._crcs: dict[str, list[int]] = {"input_ids": [], "loss_mask": []}  # per chunk, the last one growing
        self.num_tokens = self.num_loss_tokens = 0
        self.committed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def num_bytes(self) -> int:
        """Bytes written so far (token ids and loss masks)."""
        return self.num_tokens * 5

    def add(self, sample: Sample) -> None:
        ids = np.ascontiguousarray(sample.input_ids, dtype=np.int32)
        mask = np.ascontiguousarray(sample.loss_mask, dtype=np.uint8)
        if ids.shape != mask.shape or ids.ndim != 1:
            raise ValueError(f"input_ids {ids.shape} and loss_mask {mask.shape} must be 1-D and the same length")
        if len(self) % RECORDS_PER_CHUNK == 0:
            for sums in self._crcs.values():
                sums.append(0)
        self._offsets.append(self.num_tokens)
        self._lengths.append(len(ids))
        self._ids.write(ids.tobytes())
        self._mask.write(mask.tobytes())
        self._crcs["input_ids"][-1] = crc(ids, self._crcs["input_ids"][-1])
        self._crcs["loss_mask"][-1] = crc(mask, self._crcs["loss_mask"][-1])
        self.num_tokens += len(ids)
        self.num_loss_tokens += int(mask.sum())

    def commit(self, meta: dict[str, Any] | None = None) -> Path:
        """Write index and meta, make the files durable, and move the directory into place."""
        for f in (self._ids, self._mask):
            fsync_file(f)
            f.close()
        index = np.stack([np.frombuffer(self._offsets, np.int64), np.frombuffer(self._lengths, np.int64)], axis=1)
        index = np.ascontiguousarray(index.reshape(-1, 2))
        with open(self.tmp / INDEX, "wb") as f:
            np.save(f, index)
            fsync_file(f)
            header_bytes = f.tell() - index.nbytes
        with open(self.tmp / INDEX, "rb") as f:
            header = f.read(header_bytes)
        sums = {
            "algorithm": checksums.ALGORITHM,
            "records_per_chunk": RECORDS_PER_CHUNK,
            **self._crcs,
            "index": [crc(index[i : i + RECORDS_PER_CHUNK]) for i in range(0, len(index), RECORDS_PER_CHUNK)],
            "index_header": crc(header),
        }
        meta = {
            **(meta or {}),
            "format_version": FORMAT_VERSION,
            "num_samples": len(self),
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "files": {"input_ids": [INPUT_IDS, "int32"], "loss_mask": [LOSS_MASK, "uint8"], "index": INDEX},
            "checksums": sums,
        }
        with open(self.tmp / META, "w") as f:
            f.write(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            fsync_file(f)
        fsync_dir(self.tmp)  # the files' names too, before the rename publishes them
        if self.out.exists() and not self.replace:
            raise DataError(f"{self.out} already exists (pass --force to replace it)", skippable=False)
        replace_directory(self.tmp, self.out)
        self.committed = True
        return self.out

    def abort(self) -> None:
        for f in (self._ids, self._mask):
            if not f.closed:
                # Closing flushes what is buffered, which fails again on a full disk: the files go anyway.
                with contextlib.suppress(OSError):
                    f.close()
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def read_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """meta.json of a shard directory, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError):
        return None


class TokenizedDataset:
    """Memory-mapped samples of a shard directory: `ds[i] -> (input_ids, loss_mask)`.

    `return_tensors="np"`: int32 / uint8 numpy arrays (read-only views of the map). `"pt"`: int64 / bool torch
    tensors (copies). Pickles without its maps (DataLoader workers re-open them), so it is cheap in every process.
    A sample is returned only once the chunk holding it verifies (see the module docstring).
    """

    def __init__(self, path: str | os.PathLike, *, return_tensors: str = "np"):
        if return_tensors not in ("np", "pt"):
            raise ValueError(f"return_tensors: expected 'np' or 'pt', got {return_tensors!r}")
        self.path = Path(path)
        self.return_tensors = return_tensors
        meta = read_meta(self.path)
        if meta is None:
            raise DataError(
                f"not a shard directory (no readable {META}); run `flashdraft prepare` first",
                source=str(self.path),
                skippable=False,
            )
        if meta.get("format_version") not in READABLE:
            raise DataError(
                f"shard format version {meta.get('format_version')} is not {FORMAT_VERSION}: re-run "
                "`flashdraft prepare --force`",
                source=str(self.path),
                skippable=False,
            )
        self.meta, self.checksums = meta, None
        if meta["format_version"] == 1:
            checksums.warn_unverified(self.path, f"to add them, {REBUILD}")
        else:
            parts = ("input_ids", "loss_mask", "index")
            self.checksums = checksums.read_sums(
                meta.get("checksums"), meta.get("num_samples"), parts, ("index_header",), self.path / META, REBUILD
            )
        self._load_index()
        if self.checksums is not None:  # the index is not read before its chunks verify
            n_tokens = int(meta.get("num_tokens", -1))
        else:  # offsets are cumulative, so the last row gives the total without reading the whole index
            n_tokens = int(self.index[-1, 0] + self.index[-1, 1]) if len(self.index) else 0
        for name, itemsize in ((INPUT_IDS, 4), (LOSS_MASK, 1)):
            size = (self.path / name).stat().st_size
            if size != n_tokens * itemsize:
                raise DataError(
                    f"{name} holds {size} bytes, not the {n_tokens * itemsize} of {n_tokens} tokens: the shards are "
                    f"damaged; {REBUILD}",
                    source=str(self.path),
                    skippable=False,
                )
        self._ids = self._mask = None
        self._verified: set[int] = set()  # chunks checked by this process

    @property
    def per_chunk(self) -> int:
        return self.checksums["records_per_chunk"] if self.checksums else RECORDS_PER_CHUNK

    def _load_index(self) -> None:
        """Map index.npy; with checksums, only once its header (which gives shape and dtype) verifies."""
        path, rows = self.path / INDEX, self.meta.get("num_samples")

        def damaged(what: str) -> DataError:
            return DataError(f"{what}: the file is damaged; {REBUILD}", source=str(path), skippable=False)

        if self.checksums is not None:
            size = path.stat().st_size
            if size < rows * 16:
                raise damaged(f"holds {size} bytes, too few for {rows} samples")
            with open(path, "rb") as f:
                checksums.check(path, "the header", self.checksums["index_header"], f.read(size - rows * 16), REBUILD)
        try:
            self.index = np.load(path, mmap_mode="r")
        except (ValueError, OSError, SyntaxError) as exc:  # format 1 has no checksum of the header
            raise damaged(f"not a readable index ({exc})") from None
        if self.index.shape != (rows, 2) or self.index.dtype != np.int64:
            raise damaged(f"holds {self.index.dtype} {self.index.shape}, not int64 ({rows}, 2)")

    def _open(self) -> None:
        self._ids = np.memmap(self.path / INPUT_IDS, dtype=np.int32, mode="r")
        self._mask = np.memmap(self.path / LOSS_MASK, dtype=np.uint8, mode="r")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "index": None, "_ids": None, "_mask": None, "_verified": set()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load_index()

    def _check_index(self, chunk: int) -> None:
        records = checksums.chunk_records(chunk, len(self), self.per_chunk)
        sums, rows = self.checksums["index"], self.index[records.start : records.stop]
        checksums.check(self.path / INDEX, checksums.records_text(records), sums[chunk], rows, REBUILD)

    def damage(self, chunk: int) -> list[DataError]:
        """The errors of the files of `chunk` that fail their checksums (the index's alone, when it does: the others'
        bytes are found through it); [] when the chunk verifies or the shards carry no checksums."""
        if self.checksums is None:
            return []
        try:
            self._check_index(chunk)
        except DataError as exc:
            return [exc]
        if self._ids is None:
            self._open()
        records = checksums.chunk_records(chunk, len(self), self.per_chunk)
        start = int(self.index[records.start, 0])
        end = int(self.index[records[-1], 0] + self.index[records[-1], 1])
        errors = []
        for name, data, key in ((INPUT_IDS, self._ids, "input_ids"), (LOSS_MASK, self._mask, "loss_mask")):
            stored, read = self.checksums[key][chunk], crc(data[start:end])
            if read != stored:
                errors.append(
                    checksums.mismatch(self.path / name, checksums.records_text(records), stored, read, REBUILD)
                )
        return errors

    def verify(self, chunk: int) -> None:
        """Check `chunk` (the first time only, in this process); a DataError naming the file and the records."""
        if chunk in self._verified:
            return
        errors = self.damage(chunk)
        if errors:
            raise errors[0]
        self._verified.add(chunk)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.index[:, 1])

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.meta["num_loss_tokens"])

    def __getitem__(self, i: int):
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i = i + n if i < 0 else i
        if self.checksums is not None:
            self.verify(i // self.per_chunk)
        if self._ids is None:
            self._open()
        offset, length = self.index[i]
        ids = self._ids[offset : offset + length]
        mask = self._mask[offset : offset + length]
        if self.return_tensors == "pt":
            import torch

            return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.bool_))
        return np.asarray(ids), np.asarray(mask)

    def epoch_order(self, epoch: int, seed: int, rank: int = 0, world_size: int = 1, tail: str = "drop") -> list[int]:
        """This rank's sample indices for `epoch`: a deterministic shuffle split across ranks without overlap."""
        return epoch_order(len(self), epoch, seed, rank, world_size, tail)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection on uint64 (wrapping arithmetic), so distinct inputs give distinct keys."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) that depends only on (n, seed, epoch)."""
    mask = (1 << 64) - 1
    salt = _splitmix64(np.array([seed & mask], dtype=np.uint64))
    salt = _splitmix64(salt ^ np.array([epoch & mask], dtype=np.uint64))
    keys = _splitmix64(np.arange(n, dtype=np.uint64) ^ salt)
    return np.argsort(keys, kind="stable")


def epoch_order(n: int, epoch: int, seed: int, rank: int = 0, world_size: int = 1, tail: str = "drop") -> list[int]:
    """Rank `rank`'s share of the epoch's permutation of n samples: every world_size-th index from `rank` on.

    Every rank gets the same number of samples (a rank that ran out early would hang the others at a collective):
    `tail="drop"` (default) leaves out the last n % world_size samples of the permutation — different ones each
    epoch; `tail="pad"` repeats the first ones instead, so every sample is seen and a few twice.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank/world_size: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if tail not in TAILS:
        raise ValueError(f"tail: expected one of {TAILS}, got {tail!r}")
    order = permutation(n, seed, epoch)
    if tail == "drop":
        order = order[: n - n % world_size]
    elif n % world_size and n:
        extra = world_size - n % world_size
        order = np.concatenate([order, np.resize(order, extra)])
    return order[rank::world_size].tolist()
