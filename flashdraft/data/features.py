"""Offline features: the target's hidden states of the training data, captured once, read by `train` instead of
running the target (the target is then never loaded: its config, embedding and LM head are stored alongside).

    flashdraft features --config examples/qwen3.5-27b.yaml --out s3://bucket/features/q27   # or a local directory
    torchrun --nproc-per-node 8 -m flashdraft features --config ... --out /data/features/q27   # ranks split samples
    flashdraft train --config examples/qwen3.5-27b.yaml data.features=s3://bucket/features/q27

A features directory (local, or any fsspec URL such as s3://; S3 endpoint from AWS_ENDPOINT_URL):

    features.json                 the index, written last (it is the commit): target, captured layers, hidden size,
                                  dtype, content hash of the tokenised data, the file of every sample, and the
                                  checksums of the samples, part headers, head and config
    config.json                   the target's full text config (what the drafter is built from)
    head.safetensors              the target's input embedding and LM head
    part-RRRRR-KKKKK.safetensors  rank R's K-th shard: tensor "<sample index>" = (T, n * D) hidden states of the
                                  captured layers only, concatenated as `FrozenTarget.capture` returns them, in the
                                  target's dtype (bf16 on GPUs); with `final_hidden` in the index, (T, (n + 1) * D):
                                  the target's final-normed last hidden state after them (what DSpark's loss and
                                  recipe.labels=target read: the target's own next-token distributions), n + 1 / n
                                  of the bytes

Each sequence is captured alone (no padding), as the online trainer does with train.batch_size=1, so online and
offline training on the same data give the same losses (with larger batches the online capture pads, which can
move the last bits). Reading fetches one sample's bytes with a ranged read; nothing else of a shard is read.

Writing a local directory holds its lock (flashdraft.io.lock; rank 0 under torchrun), removes an old index first and
writes each file under a temporary name: a run that is cut off or runs out of room (StorageFull, naming the path and
the space needed) leaves no features.json, so `train` refuses the directory rather than reading half of it. The index
is checked field by field when read (feature_index.py), each sample, part header, head and config against its
CRC-32 the first time this process reads it (checksums.py); every message names the file, and the records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
from dataclasses import dataclass

import torch

from flashdraft.data import checksums
from flashdraft.data.errors import DataError
from flashdraft.data.feature_index import CONFIG, FORMAT, HEAD, INDEX, RECAPTURE, read_index
from flashdraft.data.head_target import HeadTarget
from flashdraft.distributed import ranks
from flashdraft.io import lock
from flashdraft.io.atomic import atomic_write_bytes
from flashdraft.io.space import room_for

logger = logging.getLogger(__name__)

SHARD_BYTES = 1 << 30
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header: a longer one is a damaged length
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _fs(url: str, s3=None):
    from flashdraft.data.remote import open_fs

    return open_fs(url, s3=s3)


def local_dir(url: str) -> str | None:
    """The local directory of `url`, or None for an object store (which has no lock)."""
    return url.removeprefix("file://") if "://" not in url or url.startswith("file://") else None


def output_lock(out: str):
    """The lock of a local features directory (see flashdraft.io.lock); object stores have none."""
    local = local_dir(out)
    return lock.hold(local, "features") if local is not None else contextlib.nullcontext()


def _put(fs, path: str, data: bytes) -> None:
    """Write a whole file: local files through a temporary name and a rename; object stores in one PUT."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        atomic_write_bytes(path, data, tmp=f"{path}.tmp-{os.getpid()}")
    else:
        fs.pipe_file(path, data)


def _parse_header(blob: bytes) -> tuple[int, dict]:
    """(offset of the data, header) of a safetensors file's bytes."""
    (n,) = struct.unpack("<Q", blob[:8])
    return 8 + n, json.loads(blob[8 : 8 + n])


# ---- writing ------------------------------------------------------------------------------------------------------


@dataclass
class FeaturesResult:
    out: str
    samples: int
    files: int
    bytes: int


def write_features(
    target, data, out: str, *, s3=None, sharded: bool = False, target_path: str | None = None
) -> FeaturesResult:
    """Capture the features of every sample of `data` (a TokenizedDataset) with `target` (a FrozenTarget, its
    captured layers configured) into `out`; collective under torchrun.

    Rank r captures samples r, r + N, r + 2N, ... and writes its own shards; rank 0 then writes the index. `sharded`:
    the target is FSDP-sharded over the ranks (`target.shard`), so every rank runs the same number of forwards.
    `s3`: the S3Config of an s3:// `out`; `target_path`: the target's name in the index when the model has none.
    """
    with output_lock(out):
        return _write_features(target, data, out, s3, sharded, target_path)


def _write_features(target, data, out: str, s3, sharded: bool, target_path: str | None) -> FeaturesResult:
    here = ranks.world()
    fs, root = _fs(out, s3)
    if here.is_main:
        fs.makedirs(root, exist_ok=True)
        # The old index goes first: until the new one is written, the directory is not a features directory.
        if fs.exists(f"{root}/{INDEX}"):
            fs.rm_file(f"{root}/{INDEX}")
    ranks.barrier()
    width = (len(target.target_layer_ids) + int(target.final_hidden)) * target.hidden_size
    needed = (data.num_tokens * width + 2 * target.lm_head_weight.numel()) * target.dtype.itemsize
    with room_for(
        out,
        needed,
        f"the features of {len(data)} samples",
        f"{out} has no {INDEX}, so train refuses it: make room, then run `flashdraft features` again",
    ):
        return _capture(target, data, out, fs, root, here, sharded, target_path)


def _capture(target, data, out: str, fs, root: str, here, sharded: bool, target_path: str | None) -> FeaturesResult:
    from safetensors.torch import save

    device = target.device
    files: dict[str, list[int]] = {}
    sums: dict = {"headers": {}, "samples": {}}  # this rank's checksums, of the bytes as written
    buffer: dict[str, torch.Tensor] = {}
    size = total_bytes = 0

    def flush() -> None:
        nonlocal buffer, size, total_bytes
        if not buffer:
            return
        name = f"part-{here.rank:05d}-{len(files):05d}.safetensors"
        blob = save(buffer)
        start, header = _parse_header(blob)
        sums["headers"][name] = checksums.crc(memoryview(blob)[:start])
        for key in buffer:
            begin, end = header[key]["data_offsets"]
            sums["samples"][int(key)] = checksums.crc(memoryview(blob)[start + begin : start + end])
        _put(fs, f"{root}/{name}", blob)
        files[name] = [int(k) for k in buffer]
        total_bytes += len(blob)
        buffer, size = {}, 0

    # With a sharded target every rank must run the same number of forwards (its all-gathers are collective):
    # a rank with fewer samples repeats one and drops the result.
    rounds = math.ceil(len(data) / here.size)
    for k in range(rounds):
        index = here.rank + k * here.size
        ids, _ = data[min(index, len(data) - 1)]
        if index >= len(data) and not sharded:
            break
        x = torch.tensor(ids, dtype=torch.long, device=device)[None]
        if target.final_hidden:  # the final hidden states after the captured layers' (see the module docstring)
            captured = torch.cat(target.capture(x, torch.ones_like(x), final=True), dim=-1)[0]
        else:
            captured = target.capture(x, torch.ones_like(x))[0]
        if index >= len(data):
            continue
        buffer[str(index)] = captured.cpu().contiguous()
        size += captured.numel() * captured.element_size()
        if size >= SHARD_BYTES:
            flush()
        if here.is_main and (k + 1) % max(1, rounds // 10) == 0:
            logger.info("features: %d / %d samples", min(len(data), (k + 1) * here.size), len(data))
    flush()
    everyone, all_sums = [files], [sums]
    if here.size > 1:
        import torch.distributed as dist

        ranks.barrier()  # ranks finish their shares at different times: wait through the store, not a collective
        everyone, all_sums = [None] * here.size, [None] * here.size
        dist.all_gather_object(everyone, files)
        dist.all_gather_object(all_sums, sums)
        sizes = [None] * here.size
        dist.all_gather_object(sizes, total_bytes)
        total_bytes = sum(sizes)
    samples = {i: name for part in everyone for name, indices in part.items() for i in indices}
    if here.is_main:
        head = {
            "embed": target.model.get_input_embeddings().weight.detach().cpu().clone(),
            "lm_head": target.lm_head_weight.detach().cpu().clone(),
        }
        head, config = save(head), target.config.to_json_string().encode()
        _put(fs, f"{root}/{HEAD}", head)
        _put(fs, f"{root}/{CONFIG}", config)
        crcs = {i: c for part in all_sums for i, c in part["samples"].items()}
        index = {
            "format": FORMAT,
            "target": str(target.name_or_path or target_path),
            "target_layer_ids": list(target.target_layer_ids),
            "hidden_size": int(target.hidden_size),
            "final_hidden": bool(target.final_hidden),
            "dtype": str(target.dtype).replace("torch.", ""),
            "data_hash": data.meta["content_hash"],
            "num_samples": len(data),
            "files": sorted({name for part in everyone for name in part}),
            "samples": [samples[i] for i in range(len(data))],
            "checksums": {
                "algorithm": checksums.ALGORITHM,
                # one per sample: a sample is read whole (tens of MB: its positions x captured layers x hidden size
                # x 2 bytes), so checking it reads nothing more and hashing costs a fraction of reading it
                "records_per_chunk": 1,
                "samples": [crcs[i] for i in range(len(data))],
                "headers": {name: c for part in all_sums for name, c in part["headers"].items()},
                "files": {HEAD: checksums.crc(head), CONFIG: checksums.crc(config)},
            },
        }
        _put(fs, f"{root}/{INDEX}", json.dumps(index).encode())
    ranks.barrier()
    return FeaturesResult(out, len(samples), len({n for part in everyone for n in part}), total_bytes)


# ---- reading ------------------------------------------------------------------------------------------------------


class FeatureStore:
    """A features directory written by `write_features`, read one sample at a time (see the module docstring)."""

    def __init__(self, url: str, device: torch.device | str = "cpu", s3=None) -> None:
        """`s3`: timeouts and attempts for an s3:// URL (flashdraft.config.S3Config; default its defaults)."""
        self.url = url
        self.device = torch.device(device)
        from flashdraft.config import S3Config

        self.fs, self.root = _fs(url, s3)
        self.s3 = s3 or S3Config()
        self.attempts = self.s3.attempts
        self.index = read_index(self.fs, self.root, url, self.s3)
        self.sums = self.index["checksums"]  # None: format 1, written without them
        self.final_hidden = bool(self.index.get("final_hidden", False))  # written before the field existed: no
        self.width = (len(self.index["target_layer_ids"]) + self.final_hidden) * int(self.index["hidden_size"])
        self._headers: dict[str, tuple[int, dict]] = {}
        self._verified: set[int] = set()  # samples checked by this process

    def check_data(self, data) -> None:
        """Refuse features captured from other data (another tokenizer, max_length, source files...)."""
        mine, theirs = data.meta.get("content_hash"), self.index["data_hash"]
        if mine != theirs or len(data) != self.index["num_samples"]:
            raise ValueError(
                f"data.features = {self.url}: captured from other training data ({self.index['num_samples']} "
                f"samples, content hash {theirs[:12]}) than this config's ({len(data)} samples, "
                f"{str(mine)[:12]}): re-run `flashdraft features` with this config"
            )

    def head_target(self, target_layer_ids: list[int] | None = None) -> HeadTarget:
        from safetensors.torch import load
        from transformers import AutoConfig

        ids = list(self.index["target_layer_ids"])
        if target_layer_ids is not None and list(target_layer_ids) != ids:
            raise ValueError(
                f"drafter.target_layer_ids = {list(target_layer_ids)}, but the features in {self.url} "
                f"hold layers {ids}: capture them again or drop the override"
            )
        config, head = self.file(CONFIG), self.file(HEAD)
        config = json.loads(config)
        config = AutoConfig.for_model(config.pop("model_type"), **config)
        head = load(head)
        return HeadTarget(
            config, ids, head["embed"].to(self.device), head["lm_head"].to(self.device), name=self.index["target"]
        )

    def sample(self, index: int) -> torch.Tensor:
        """(T, n * D) features of sample `index`, on the CPU."""
        name = self.index["samples"][index]
        start, header = self.header(name)
        entry = header.get(str(index))
        if entry is None:
            raise DataError(
                f"holds no sample {index}, which {INDEX} places there: the features are damaged; {RECAPTURE}",
                source=self.where(name),
                skippable=False,
            )
        begin, end = entry["data_offsets"]
        raw = self._read(name, start + begin, start + end)
        if self.sums is not None and index not in self._verified:
            what = checksums.records_text(range(index, index + 1))
            checksums.check(self.where(name), what, self.sums["samples"][index], raw, RECAPTURE)
            self._verified.add(index)
        dtype = _DTYPES[entry["dtype"]]
        return torch.frombuffer(bytearray(raw), dtype=dtype).view(entry["shape"])

    def require_final(self) -> None:
        """A DataError unless the store holds the target's final hidden states (`final_hidden`)."""
        if not self.final_hidden:
            raise DataError(
                f"data.features = {self.url}: holds no final hidden states of the target, which DSpark's loss and "
                "recipe.labels=target read: capture them again with this config (`flashdraft features` stores them "
                "for such a config)"
            )

    def batch(self, indices: list[int], length: int, final: bool = False):
        """(B, length, n * D) features of samples `indices`, right-padded with zeros like their token batch; with
        `final`, also (B, length, D) the target's final hidden states (a DataError if the store holds none)."""
        if final:
            self.require_final()
        rows = [self.sample(i) for i in indices]
        out = torch.zeros(len(rows), length, self.width, dtype=rows[0].dtype)
        for row, x in enumerate(rows):
            out[row, : x.shape[0]] = x
        out = out.to(self.device, non_blocking=True)
        if not self.final_hidden:
            return out
        hidden = int(self.index["hidden_size"])
        return (out[..., :-hidden], out[..., -hidden:]) if final else out[..., :-hidden]

    def where(self, name: str) -> str:
        """The URL of file `name` of the store, as messages name it."""
        return f"{self.url.rstrip('/')}/{name}"

    def records_of(self, name: str) -> list[int]:
        """The samples that file `name` holds."""
        return [i for i, n in enumerate(self.index["samples"]) if n == name]

    def file(self, name: str) -> bytes:
        """The whole of file `name` (the head or the config), checked against its checksum."""
        raw = self._read(name)
        if self.sums is not None:
            checksums.check(self.where(name), "the file", self.sums["files"][name], raw, RECAPTURE)
        return raw

    def header(self, name: str) -> tuple[int, dict]:
        """(offset of the data, header) of a safetensors file: an 8-byte little-endian length, then JSON; checked
        against its checksum before it is parsed."""
        if name not in self._headers:
            size = self._read(name, 0, 8)
            (n,) = struct.unpack("<Q", size.ljust(8, b"\0"))
            raw = size + self._read(name, 8, 8 + min(n, _MAX_HEADER))
            stored, read = (self.sums or {}).get("headers", {}).get(name), checksums.crc(raw)
            if stored is not None and read != stored:
                held = self.records_of(name)
                listed = ", ".join(map(str, held[:4])) + (", …" if len(held) > 4 else "")
                what = f"the header (of record{'s' if len(held) > 1 else ''} {listed})"
                raise checksums.mismatch(self.where(name), what, stored, read, RECAPTURE)
            try:
                self._headers[name] = (8 + n, json.loads(raw[8:]))
            except ValueError:  # format 1, which has no checksum to say so first
                raise DataError(
                    f"not a safetensors header: the file is damaged; {RECAPTURE}", source=self.where(name)
                ) from None
        return self._headers[name]

    def _read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of a file (all of it by default), read again when an object store cuts the transfer
        off."""
        from flashdraft.data.remote import fs_endpoint, is_remote_error, read_again_if_cut_off, remote_error

        path = f"{self.root}/{name}"
        try:
            return read_again_if_cut_off(lambda: self.fs.cat_file(path, start=start, end=end), self.attempts, path)
        except Exception as exc:
            if not is_remote_error(exc):
                raise
            # Past the attempts: a DataError naming the file (exit 2), not the store's traceback.
            raise remote_error(exc, self.where(name), self.s3, fs_endpoint(self.fs)) from None
