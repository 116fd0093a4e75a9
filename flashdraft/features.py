"""Offline features: the target's hidden states of the training data, captured once, read by `train` instead of
running the target (the target is then never loaded: its config, embedding and LM head are stored alongside).

    flashdraft features --config examples/qwen3.5-27b.yaml --out s3://bucket/features/q27   # or a local directory
    torchrun --nproc-per-node 8 -m flashdraft features --config ... --out /data/features/q27   # ranks split samples
    flashdraft train --config examples/qwen3.5-27b.yaml data.features=s3://bucket/features/q27

A features directory (local, or any fsspec URL such as s3://; S3 endpoint from AWS_ENDPOINT_URL):

    features.json                 the index, written last (it is the commit): target, captured layers, hidden size,
                                  dtype, content hash of the tokenised data, and the file of every sample
    config.json                   the target's full text config (what the drafter is built from)
    head.safetensors              the target's input embedding and LM head
    part-RRRRR-KKKKK.safetensors  rank R's K-th shard: tensor "<sample index>" = (T, n * D) hidden states of the
                                  captured layers only, concatenated as `FrozenTarget.capture` returns them, in the
                                  target's dtype (bf16 on GPUs)

Each sequence is captured alone (no padding), as the online trainer does with train.batch_size=1, so online and
offline training on the same data give the same losses (with larger batches the online capture pads, which can
move the last bits). Reading fetches one sample's bytes with a ranged read; nothing else of a shard is read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

FORMAT = "flashdraft-features/1"
INDEX = "features.json"
HEAD = "head.safetensors"
CONFIG = "config.json"
SHARD_BYTES = 1 << 30
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _fs(url: str):
    from fsspec.core import url_to_fs

    from flashdraft.data.sources import storage_options_for

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return url_to_fs(url, **storage_options_for(protocol))


def _put(fs, path: str, data: bytes) -> None:
    """Write a whole file: local files through a temporary name and a rename; object stores in one PUT."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


# ---- writing ------------------------------------------------------------------------------------------------------


@dataclass
class FeaturesResult:
    out: str
    samples: int
    files: int
    bytes: int


def write_features(cfg, out: str, console=None) -> FeaturesResult:
    """Capture the features of every sample of `cfg`'s training data into `out`; collective under torchrun.

    Rank r captures samples r, r + N, r + 2N, ... and writes its own shards; rank 0 then writes the index.
    """
    from safetensors.torch import save

    from flashdraft.train import distributed
    from flashdraft.train.loop import load_inputs

    here = distributed.world()
    device, _, target, data, _ = load_inputs(cfg, Path(cfg.log.out), console, offline=False)
    fs, root = _fs(out)
    fs.makedirs(root, exist_ok=True)
    files: dict[str, list[int]] = {}
    buffer: dict[str, torch.Tensor] = {}
    size = total_bytes = 0

    def flush() -> None:
        nonlocal buffer, size, total_bytes
        if not buffer:
            return
        name = f"part-{here.rank:05d}-{len(files):05d}.safetensors"
        blob = save(buffer)
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
        if index >= len(data) and not cfg.target.shard:
            break
        x = torch.tensor(ids, dtype=torch.long, device=device)[None]
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
    everyone = [files]
    if here.size > 1:
        import torch.distributed as dist

        everyone = [None] * here.size
        dist.all_gather_object(everyone, files)
        sizes = [None] * here.size
        dist.all_gather_object(sizes, total_bytes)
        total_bytes = sum(sizes)
    samples = {i: name for part in everyone for name, indices in part.items() for i in indices}
    if here.is_main:
        head = {"embed": target.model.get_input_embeddings().weight.detach().cpu().clone(),
                "lm_head": target.lm_head_weight.detach().cpu().clone()}  # fmt: skip
        _put(fs, f"{root}/{HEAD}", save(head))
        _put(fs, f"{root}/{CONFIG}", target.config.to_json_string().encode())
        index = {
            "format": FORMAT,
            "target": str(target.name_or_path or cfg.target.path),
            "target_layer_ids": list(target.target_layer_ids),
            "hidden_size": int(target.hidden_size),
            "dtype": str(target.dtype).replace("torch.", ""),
            "data_hash": data.meta["content_hash"],
            "num_samples": len(data),
            "files": sorted({name for part in everyone for name in part}),
            "samples": [samples[i] for i in range(len(data))],
        }
        _put(fs, f"{root}/{INDEX}", json.dumps(index).encode())
    distributed.barrier()
    return FeaturesResult(out, len(samples), len({n for part in everyone for n in part}), total_bytes)


# ---- reading ------------------------------------------------------------------------------------------------------


class FeatureStore:
    """A features directory written by `write_features`, read one sample at a time (see the module docstring)."""

    def __init__(self, url: str, device: torch.device | str = "cpu") -> None:
        self.url = url
        self.device = torch.device(device)
        self.fs, self.root = _fs(url)
        try:
            self.index = json.loads(self.fs.cat_file(f"{self.root}/{INDEX}"))
        except FileNotFoundError:
            raise FileNotFoundError(f"data.features = {url}: no {INDEX} there (run `flashdraft features --out "
                                    f"{url}` first; the index is written last, so a cut-off run has none)") from None  # fmt: skip
        if self.index.get("format") != FORMAT:
            raise ValueError(f"data.features = {url}: {INDEX} has format {self.index.get('format')!r}, not {FORMAT}")
        self.width = len(self.index["target_layer_ids"]) * int(self.index["hidden_size"])
        self._headers: dict[str, tuple[int, dict]] = {}

    def check_data(self, data) -> None:
        """Refuse features captured from other data (another tokenizer, max_length, source files...)."""
        mine, theirs = data.meta.get("content_hash"), self.index["data_hash"]
        if mine != theirs or len(data) != self.index["num_samples"]:
            raise ValueError(f"data.features = {self.url}: captured from other training data ({self.index['num_samples']} "
                             f"samples, content hash {theirs[:12]}) than this config's ({len(data)} samples, "
                             f"{str(mine)[:12]}): re-run `flashdraft features` with this config")  # fmt: skip

    def head_target(self, target_layer_ids: list[int] | None = None) -> HeadTarget:
        from safetensors.torch import load
        from transformers import AutoConfig

        ids = list(self.index["target_layer_ids"])
        if target_layer_ids is not None and list(target_layer_ids) != ids:
            raise ValueError(f"drafter.target_layer_ids = {list(target_layer_ids)}, but the features in {self.url} "
                             f"hold layers {ids}: capture them again or drop the override")  # fmt: skip
        config = json.loads(self.fs.cat_file(f"{self.root}/{CONFIG}"))
        config = AutoConfig.for_model(config.pop("model_type"), **config)
        head = load(self.fs.cat_file(f"{self.root}/{HEAD}"))
        return HeadTarget(config, ids, head["embed"].to(self.device), head["lm_head"].to(self.device),
                          name=self.index["target"])  # fmt: skip

    def sample(self, index: int) -> torch.Tensor:
        """(T, n * D) features of sample `index`, on the CPU."""
        name = self.index["samples"][index]
        start, header = self._header(name)
        entry = header[str(index)]
        begin, end = entry["data_offsets"]
        raw = self.fs.cat_file(f"{self.root}/{name}", start=start + begin, end=start + end)
        dtype = _DTYPES[entry["dtype"]]
        return torch.frombuffer(bytearray(raw), dtype=dtype).view(entry["shape"])

    def batch(self, indices: list[int], length: int) -> torch.Tensor:
        """(B, length, n * D) features of samples `indices`, right-padded with zeros like their token batch."""
        rows = [self.sample(i) for i in indices]
        out = torch.zeros(len(rows), length, self.width, dtype=rows[0].dtype)
        for row, x in enumerate(rows):
            out[row, : x.shape[0]] = x
        return out.to(self.device, non_blocking=True)

    def _header(self, name: str) -> tuple[int, dict]:
        """(offset of the data, header) of a safetensors file: an 8-byte little-endian length, then JSON."""
        if name not in self._headers:
            path = f"{self.root}/{name}"
            (n,) = struct.unpack("<Q", self.fs.cat_file(path, start=0, end=8))
            self._headers[name] = (8 + n, json.loads(self.fs.cat_file(path, start=8, end=8 + n)))
        return self._headers[name]


class HeadTarget:
    """The target as offline training needs it: config, captured layer ids, embedding and LM head; no layers."""

    def __init__(self, config, target_layer_ids: list[int], embed: torch.Tensor, lm_head: torch.Tensor, name=None):
        self.config = config
        self.target_layer_ids = list(target_layer_ids)
        self.num_target_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.name_or_path = name
        self.model = nn.Module()  # holds the two weights; no target FLOPs are counted (there is no forward)
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.model.lm_head = nn.Parameter(lm_head, requires_grad=False)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def capture(self, *args, **kwargs):
        raise RuntimeError("offline training reads the features (FeatureStore.batch); there is no target to run")


# ---- the command ------------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    from flashdraft.train.cli import add_nproc_argument

    p = sub.add_parser("features", help="capture the target's features of the training data for offline training")
    p.add_argument("--config", default=None, help="YAML config of the training run (default: the embedded one)")
    p.add_argument("--out", default=None, help="features directory, local or s3:// (default: data.features)")
    add_nproc_argument(p)
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="dotted overrides, as for train")
    p.set_defaults(run=run)


def run(args) -> int:
    import logging as _logging

    from rich.console import Console

    from flashdraft import embedded
    from flashdraft.config import load_config
    from flashdraft.train import distributed
    from flashdraft.train.cli import relaunch_argv

    if args.nproc is not None and not distributed.launched():
        return distributed.launch(args.nproc, relaunch_argv(args, "features"))
    _logging.basicConfig(level=_logging.INFO, format="%(message)s")
    cfg = load_config(args.config or embedded.ASSETS / "train.yaml", args.overrides)
    out = args.out or cfg.data.features
    if not out:
        raise ValueError("features: where to? give --out DIR (local or s3://) or data.features=DIR")
    console = Console()
    with distributed.session(cfg.train.device, "features") as here:
        if not here.is_main:
            console = Console(quiet=True)
        result = write_features(cfg, out, console)
        if not here.is_main:
            return 0
    console.print(f"[bold green]done[/]: features of {result.samples} samples in {result.files} files "
                  f"({result.bytes / 2**20:.1f} MiB) at {result.out}\ntrain on them with: data.features={result.out}",
                  soft_wrap=True)  # fmt: skip
    return 0
