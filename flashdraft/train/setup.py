"""What a training run holds before its first step, and the order it reads its data in.

    s = setup(cfg, out, console)            # device, tokenizer, frozen target, drafter, data, step counts, peak
    indices = step_indices(s, cfg, step)    # this rank's micro-batches of `step`: sample indices
    ids, loss_mask, attention_mask = collate(s.data, indices[0], s.device)

Data order is a fixed function of (seed, epoch), so a resumed run reads what an uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

import numpy as np
import torch
from rich import get_console
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from flashdraft import bundled
from flashdraft.config import RunConfig
from flashdraft.data import FormatConfig, PrepareConfig, TokenizedDataset, prepare_shards
from flashdraft.data.features import FeatureStore, HeadTarget
from flashdraft.devices import resolve_device, resolve_dtype
from flashdraft.drafter import DFlashDraftModel
from flashdraft.target import FrozenTarget, check_fp8, glue_compile_enabled, load_frozen_target
from flashdraft.train import data_parallel, distributed
from flashdraft.train.blocks import DraftBatch, anchor_generator, build_blocks, sample_anchors, sample_reveals
from flashdraft.train.compile import compile_drafter, resolve_auto_compile
from flashdraft.train.flops import Peak, describe, device_peak, step_flops
from flashdraft.train.wallclock import WallClock

logger = logging.getLogger(__name__)


class Samples(Protocol):
    """What the loop reads of its data (`TokenizedDataset`; benchmarks pass synthetic sequences)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...  # (token ids, loss mask)

    def epoch_order(self, epoch: int, seed: int) -> list[int]: ...


@dataclass
class Setup:
    device: torch.device
    tokenizer: PreTrainedTokenizerBase | None
    target: FrozenTarget | HeadTarget  # HeadTarget: offline, only the embedding and LM head beside the features
    drafter: DFlashDraftModel
    data: Samples
    steps_per_epoch: int
    total_steps: int
    features: FeatureStore | None = None  # when training offline (data.features): read instead of the target
    full_target: PreTrainedModel | None = None  # the untruncated target, loaded on the first real-τ measurement
    tau_decoder: DFlashDraftModel | None = None  # the drafter's copy in the target's dtype that the τ engine decodes
    peak: Peak | None = None  # dense bf16 rate of one device, for MFU (None: unknown, or a CPU)


def setup(cfg: RunConfig, out: Path, console, clock: WallClock | None = None) -> Setup:
    """Everything a run needs before its first step. The `auto` compile switches of `cfg` are decided here, for
    this run's size (`compile.resolve_auto_compile`), and set in `cfg`. `clock`: times the target, the data and
    the drafter as phases."""
    clock = clock or WallClock()
    device, tokenizer, target, data, features = load_inputs(cfg, out, console, clock=clock)
    with clock.phase("drafter"):
        return _with_drafter(cfg, device, tokenizer, target, data, features)


def _with_drafter(cfg: RunConfig, device, tokenizer, target, data, features) -> Setup:
    drafter = build_drafter(cfg, target, tokenizer).to(device)
    # The global step: every rank takes batch_size x grad_accum of its sequences (data_parallel.py).
    per_step = cfg.train.batch_size * cfg.train.grad_accum * distributed.world().size
    steps_per_epoch = len(data) // per_step
    if steps_per_epoch == 0:
        raise ValueError(
            f"data: {len(data)} samples, fewer than one step needs (train.batch_size x train.grad_accum "
            f"x {distributed.world().size} processes = {per_step})"
        )
    total = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    peak = device_peak(device, cfg.train.peak_tflops)
    if (line := describe(device, peak)) is not None and distributed.world().is_main:
        logger.info("%s", line)
    run_flops = total * planned_step_flops(cfg, target, drafter, per_step)
    resolve_auto_compile(cfg, device, run_flops, peak.flops if peak else None)
    if isinstance(target, FrozenTarget):
        target.compile_glue(glue_compile_enabled(cfg.target, device))
    compile_drafter(drafter, cfg.train, device)  # per layer, before sharding (as torchtitan orders them)
    drafter = data_parallel.parallelize_drafter(drafter, device)
    return Setup(device, tokenizer, target, drafter, data, steps_per_epoch, total, features, peak=peak)


def planned_step_flops(cfg: RunConfig, target, drafter, sequences: int) -> float:
    """The cost model's FLOPs of one global step of `sequences` sequences, each at data.max_length tokens with
    recipe.num_anchors full blocks: what a step costs at most."""
    tokens = sequences * cfg.data.max_length
    labelled = sequences * min(cfg.recipe.num_anchors, cfg.data.max_length) * (drafter.block_size - 1)
    return step_flops(SimpleNamespace(target=target, drafter=drafter), tokens, labelled)


def load_inputs(cfg: RunConfig, out: Path, console, *, offline: bool | None = None, clock: WallClock | None = None):
    """(device, tokenizer, frozen target, tokenised data, features) of `cfg`; also what `flashdraft features` uses.

    Offline (`data.features` set, unless `offline=False`): the features are read from there and the target is only
    its config, embedding and LM head, saved beside them; features is None otherwise. `clock`: times "target" (the
    fast-path probe inside it as its own phase) and "data".
    """
    clock = clock or WallClock()
    hf_logging.disable_progress_bar()  # transformers' per-checkpoint tqdm bars would tear the rich progress bar
    offline = bool(cfg.data.features) if offline is None else offline
    layer_ids = captured_layer_ids(cfg)
    device = resolve_device(cfg.train.device, field="train.device")
    dtype = resolve_dtype(cfg.target.dtype, device)
    if cfg.target.precision == "fp8" and not offline:
        check_fp8(device, dtype)  # before minutes of loading
    # target.shard: the whole target never sits on one GPU; it loads into CPU memory and each rank keeps 1/N.
    load_on = torch.device("cpu") if cfg.target.shard and distributed.world().size > 1 else device
    torch.manual_seed(cfg.train.seed)
    features = None
    with clock.phase("target"):
        if offline:
            features = FeatureStore(cfg.data.features, device=device, s3=cfg.s3)
            target = features.head_target(layer_ids)
        else:
            target = load_frozen_target(
                cfg.target,
                layer_ids=layer_ids,
                device=load_on,
                dtype=dtype,
                num_features=cfg.drafter.num_layers,
                final_hidden=cfg.recipe.labels == "target",
            )
            if cfg.target.shard:
                data_parallel.shard_target(target.model, device)
            target.configure(cfg.target)
    if getattr(target, "probe_seconds", None):
        clock.move("target", "fast-path probe", target.probe_seconds)
    with clock.phase("data"):
        tokenizer, data = _tokenized_data(cfg, out, console)
    if features is not None:
        features.check_data(data)
    return device, tokenizer, target, data, features


def _tokenized_data(cfg: RunConfig, out: Path, console):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(cfg), trust_remote_code=cfg.target.trust_remote_code)
    sources = bundled.train_data() if cfg.data.train == [bundled.BUNDLED] else cfg.data.train
    # Rank 0 tokenises (or finds the shards already there); the others then reuse its shards.
    with distributed.main_first():
        prepared = prepare_shards(
            PrepareConfig(
                data=sources,
                tokenizer=tokenizer_path(cfg),
                out=cfg.data.shards or str(out / "shards"),
                format=FormatConfig(format=cfg.data.format, drop_thinking=cfg.data.drop_thinking),
                max_length=cfg.data.max_length,
                overlong=cfg.data.overlong,
                skip_bad=cfg.data.skip_bad,
                s3=cfg.s3,
                progress=(console or get_console()).is_terminal,
            ),  # a bar in a log file: a torn line
            tokenizer=tokenizer,
            console=console,
        )
    return tokenizer, TokenizedDataset(prepared.path)


def tokenizer_path(cfg: RunConfig) -> str:
    """data.tokenizer, else the target's own (the bundled tokenizer for the bundled target)."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    return str(bundled.tokenizer_dir()) if cfg.target.path == bundled.BUNDLED else cfg.target.path


def captured_layer_ids(cfg: RunConfig) -> list[int] | None:
    """The target layers to capture: drafter.target_layer_ids, else those of the drafter fine-tuned from
    (drafter.init_from), else None (the default spread over the target)."""
    if cfg.drafter.target_layer_ids is not None or not cfg.drafter.init_from:
        return cfg.drafter.target_layer_ids
    try:
        config = json.loads((_init_from_dir(cfg) / "config.json").read_text())
        return list(config["dflash_config"]["target_layer_ids"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # from_pretrained reports a missing or broken checkpoint with its own message


def _init_from_dir(cfg: RunConfig) -> Path:
    return bundled.drafter_dir() if cfg.drafter.init_from == bundled.BUNDLED else Path(cfg.drafter.init_from)


def build_drafter(cfg: RunConfig, target: FrozenTarget | HeadTarget, tokenizer) -> DFlashDraftModel:
    """The drafter to train, in float32: drafter.init_from's (checked against the config and the target), else a
    new one shaped from the target (seeded by train.seed)."""
    if cfg.drafter.init_from:
        source = _init_from_dir(cfg)
        drafter = DFlashDraftModel.from_pretrained(source)
        for name, want, got in (
            ("block_size", cfg.drafter.block_size, drafter.block_size),
            ("num_layers", cfg.drafter.num_layers, len(drafter.layers)),
        ):
            if want != got:
                raise ValueError(
                    f"drafter.{name} = {want}, but the drafter of drafter.init_from ({source}) was "
                    f"trained with {got}: set drafter.{name}: {got}, or drafter.init_from: null"
                )
        if list(drafter.target_layer_ids) != list(target.target_layer_ids):
            raise ValueError(
                f"drafter.init_from: its target_layer_ids {drafter.target_layer_ids} differ from the "
                f"target's captured layers {target.target_layer_ids}"
            )
        return drafter.float()
    torch.manual_seed(cfg.train.seed)
    return DFlashDraftModel.from_target(
        target.config,
        num_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=target.target_layer_ids,
        mask_token_id=cfg.drafter.mask_token_id,
        tokenizer=tokenizer,
        **cfg.drafter.overrides,
    ).float()


# ---- data order and collation -------------------------------------------------------------------------------------


def step_indices(s: Setup, cfg: RunConfig, step: int) -> list[list[int]]:
    """Sample indices of this rank's micro-batches of `step`: a fixed function of (seed, step, rank, world)."""
    per_step = cfg.train.batch_size * cfg.train.grad_accum * distributed.world().size
    epoch, offset = divmod(step, s.steps_per_epoch)
    order = _epoch_order(s.data, epoch, cfg.train.seed)
    chunk = order[offset * per_step : (offset + 1) * per_step]
    b = cfg.train.batch_size
    return data_parallel.rank_share([chunk[i : i + b] for i in range(0, per_step, b)])


_ORDER_CACHE: dict = {}


def _epoch_order(data: Samples, epoch: int, seed: int) -> list[int]:
    key = (id(data), epoch, seed)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE.clear()
        _ORDER_CACHE[key] = data.epoch_order(epoch, seed)
    return _ORDER_CACHE[key]


def collate(data: Samples, indices: list[int], device: torch.device):
    """Right-padded (input_ids, loss_mask, attention_mask), each (B, T_max)."""
    samples = [data[i] for i in indices]
    width = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    attn = torch.zeros(len(samples), width, dtype=torch.long)
    for row, (x, m) in enumerate(samples):
        n = len(x)
        ids[row, :n] = torch.tensor(x, dtype=torch.long)  # copies out of the read-only memory map
        mask[row, :n] = torch.tensor(m, dtype=torch.bool)
        attn[row, :n] = 1
    return ids.to(device), mask.to(device), attn.to(device)


def pad_positions(t: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T, ...) right-padded with zeros to (B, width, ...): a static shape for the compiled drafter."""
    if t.shape[1] > width:
        raise ValueError(
            f"a micro-batch of {t.shape[1]} positions is longer than data.max_length = {width}: prepare "
            "the data with this max_length, or set train.static_shapes=false"
        )
    if t.shape[1] == width:
        return t  # no copy: at 131072 tokens the features alone are gigabytes
    pad = [0, 0] * (t.ndim - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def step_blocks(
    s: Setup, cfg: RunConfig, ids, mask, indices: list[int], epoch: int, width: int | None = None
) -> DraftBatch:
    """The drafted blocks of one micro-batch: anchors seeded by (seed, epoch, sample); `width`: static shapes."""
    bs = s.drafter.block_size
    anchors, reveals = [], []
    for row, index in enumerate(indices):
        generator = anchor_generator(cfg.train.seed, epoch, index)
        anchors.append(
            sample_anchors(mask[row].cpu(), cfg.recipe.num_anchors, bs, generator, cfg.recipe.anchor_sampling)
        )
        # Drawn after the anchors, so that the anchors do not depend on recipe.reveal.
        reveals.append(sample_reveals(anchors[-1].numel(), bs, cfg.recipe.reveal, generator))
    num_blocks = None
    if width is not None:
        ids, mask, num_blocks = pad_positions(ids, width), pad_positions(mask, width), cfg.recipe.num_anchors
    return build_blocks(ids, mask, anchors, bs, s.drafter.mask_token_id, cfg.recipe.gamma, num_blocks, reveals)
