"""Tokenised shards: written once, atomically; read memory-mapped by every rank.

A shard directory holds
    input_ids.bin   int32, all samples' token ids concatenated
    loss_mask.bin   uint8, their loss masks (1 = response token), same layout
    index.npy       int64 [N, 2]: (offset, length) of each sample, in tokens
    meta.json       format_version, counts, and whatever the writer adds (tokenizer, options, content hash)

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

from flashdraft.data.encoder import Sample
from flashdraft.data.errors import DataError
from flashdraft.io.atomic import fsync_dir, fsync_file, replace_directory, temporary_directory_beside

FORMAT_VERSION = 1
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
        self._offsets.append(self.num_tokens)
        self._lengths.append(len(ids))
        self._ids.write(ids.tobytes())
        self._mask.write(mask.tobytes())
        self.num_tokens += len(ids)
        self.num_loss_tokens += int(mask.sum())

    def commit(self, meta: dict[str, Any] | None = None) -> Path:
        """Write index and meta, make the files durable, and move the directory into place."""
        for f in (self._ids, self._mask):
            fsync_file(f)
            f.close()
        index = np.stack([np.frombuffer(self._offsets, np.int64), np.frombuffer(self._lengths, np.int64)], axis=1)
        with open(self.tmp / INDEX, "wb") as f:
            np.save(f, index.reshape(-1, 2))
            fsync_file(f)
        meta = {
            **(meta or {}),
            "format_version": FORMAT_VERSION,
            "num_samples": len(self),
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "files": {"input_ids": [INPUT_IDS, "int32"], "loss_mask": [LOSS_MASK, "uint8"], "index": INDEX},
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
        if meta.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"shard format version {meta.get('format_version')} is not {FORMAT_VERSION}: re-run "
                "`flashdraft prepare --force`",
                source=str(self.path),
                skippable=False,
            )
        self.meta = meta
        self.index = np.load(self.path / INDEX, mmap_mode="r")
        # offsets are cumulative, so the last row gives the total without reading the whole index
        n_tokens = int(self.index[-1, 0] + self.index[-1, 1]) if len(self.index) else 0
        for name, itemsize in ((INPUT_IDS, 4), (LOSS_MASK, 1)):
            size = (self.path / name).stat().st_size
            if size != n_tokens * itemsize:
                raise DataError(
                    f"{name} holds {size} bytes, the index needs {n_tokens * itemsize}: the shards are "
                    "damaged; re-run `flashdraft prepare --force`",
                    source=str(self.path),
                    skippable=False,
                )
        self._ids = self._mask = None

    def _open(self) -> None:
        self._ids = np.memmap(self.path / INPUT_IDS, dtype=np.int32, mode="r")
        self._mask = np.memmap(self.path / LOSS_MASK, dtype=np.uint8, mode="r")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "index": None, "_ids": None, "_mask": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.index = np.load(self.path / INDEX, mmap_mode="r")

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
