"""What a training run holds before its first step, built once: the device, the frozen target, the tokenizer, the
data (in the loader that reads it in order: dataloader.py), the drafter, the number of steps.

    s = setup(cfg, out, console)            # a frozen Setup: nothing in it is replaced during the run
    batch = next(s.batches)                 # this rank's micro-batches of the next step

The `auto` compile switches of the run's config are decided here, for the run's size (`compile.resolve_auto_compile`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from rich import get_console
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from flashdraft import bundled
from flashdraft.config import RunConfig
from flashdraft.data import FormatConfig, PrepareConfig, TokenizedDataset, prepare_shards
from flashdraft.data.features import FeatureStore, HeadTarget
from flashdraft.devices import resolve_device, resolve_dtype
from flashdraft.distributed import data_parallel
from flashdraft.distributed.job import main_first
from flashdraft.distributed.ranks import world
from flashdraft.drafter import DFlashDraftModel
from flashdraft.drafter.families import is_family_parameter, with_family
from flashdraft.target import FrozenTarget, check_fp8, glue_compile_enabled, load_frozen_target
from flashdraft.telemetry.flops import Peak, describe, device_peak, step_flops
from flashdraft.telemetry.timer import Timer
from flashdraft.train.compile import compile_drafter, resolve_auto_compile
from flashdraft.train.dataloader import DataLoader, sequences_per_step, steps_per_epoch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    device: torch.device
    tokenizer: PreTrainedTokenizerBase | None
    target: FrozenTarget | HeadTarget  # HeadTarget: offline, only the embedding and LM head beside the features
    drafter: DFlashDraftModel
    batches: DataLoader  # the training data, in the order the run reads it
    total_steps: int
    features: FeatureStore | None = None  # when training offline (data.features): read instead of the target
    peak: Peak | None = None  # dense bf16 rate of one device, for MFU (None: unknown, or a CPU)


def setup(cfg: RunConfig, out: Path, console, timer: Timer | None = None) -> Setup:
    """Everything a run needs before its first step. The `auto` compile switches of `cfg` are decided here, for
    this run's size (`compile.resolve_auto_compile`), and set in `cfg`. `timer`: times the target, the data and
    the drafter as phases."""
    timer = timer or Timer()
    device, tokenizer, target, data, features = load_inputs(cfg, out, console, timer=timer)
    with timer.phase("drafter"):
        return _with_drafter(cfg, device, tokenizer, target, data, features)


def _with_drafter(cfg: RunConfig, device, tokenizer, target, data, features) -> Setup:
    drafter = build_drafter(cfg, target, tokenizer).to(device)
    total = steps_per_epoch(cfg, len(data)) * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    peak = device_peak(device, cfg.train.peak_tflops)
    if (line := describe(device, peak)) is not None and world().is_main:
        logger.info("%s", line)
    run_flops = total * planned_step_flops(cfg, target, drafter, sequences_per_step(cfg))
    resolve_auto_compile(cfg, device, run_flops, peak.flops if peak else None)
    if isinstance(target, FrozenTarget):
        target.compile_glue(glue_compile_enabled(cfg.target, device))
    batches = DataLoader.from_config(cfg, data, drafter, device)  # static shapes as the compile switches say
    compile_drafter(drafter, cfg.train, device)  # per layer, before sharding (as torchtitan orders them)
    drafter = data_parallel.parallelize_drafter(drafter, device)
    return Setup(device, tokenizer, target, drafter, batches, total, features, peak=peak)


def planned_step_flops(cfg: RunConfig, target, drafter, sequences: int) -> float:
    """The cost model's FLOPs of one global step of `sequences` sequences, each at data.max_length tokens with
    recipe.num_anchors full blocks: what a step costs at most."""
    tokens = sequences * cfg.data.max_length
    labelled = sequences * min(cfg.recipe.num_anchors, cfg.data.max_length) * drafter.num_drafts
    return step_flops(SimpleNamespace(target=target, drafter=drafter), tokens, labelled)


def load_inputs(cfg: RunConfig, out: Path, console, *, offline: bool | None = None, timer: Timer | None = None):
    """(device, tokenizer, frozen target, tokenised data, features) of `cfg`; also what `flashdraft features` uses.

    Offline (`data.features` set, unless `offline=False`): the features are read from there and the target is only
    its config, embedding and LM head, saved beside them; features is None otherwise. `timer`: times "target" (the
    fast-path probe inside it as its own phase) and "data".
    """
    timer = timer or Timer()
    hf_logging.disable_progress_bar()  # transformers' per-checkpoint tqdm bars would tear the rich progress bar
    offline = bool(cfg.data.features) if offline is None else offline
    layer_ids = captured_layer_ids(cfg)
    device = resolve_device(cfg.train.device, field="train.device")
    dtype = resolve_dtype(cfg.target.dtype, device)
    if cfg.target.precision == "fp8" and not offline:
        check_fp8(device, dtype)  # before minutes of loading
    # target.shard: the whole target never sits on one GPU; it loads into CPU memory and each rank keeps 1/N.
    load_on = torch.device("cpu") if cfg.target.shard and world().size > 1 else device
    torch.manual_seed(cfg.train.seed)
    features = None
    with timer.phase("target"):
        if offline:
            features = FeatureStore(cfg.data.features, device=device, s3=cfg.s3)
            if needs_target_distribution(cfg):
                features.require_final()  # before minutes of tokenising
            target = features.head_target(layer_ids)
        else:
            target = load_frozen_target(
                cfg.target,
                layer_ids=layer_ids,
                device=load_on,
                dtype=dtype,
                num_features=cfg.drafter.num_layers,
                final_hidden=needs_target_distribution(cfg),
            )
            if cfg.target.shard:
                data_parallel.shard_target(target.model, device)
            target.configure(cfg.target)
    if getattr(target, "probe_seconds", None):
        timer.move("target", "fast-path probe", target.probe_seconds)
    with timer.phase("data"):
        tokenizer, data = _tokenized_data(cfg, out, console)
    if features is not None:
        features.check_data(data)
    return device, tokenizer, target, data, features


def _tokenized_data(cfg: RunConfig, out: Path, console):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(cfg), trust_remote_code=cfg.target.trust_remote_code)
    sources = bundled.train_data() if cfg.data.train == [bundled.BUNDLED] else cfg.data.train
    # Rank 0 tokenises (or finds the shards already there); the others then reuse its shards.
    with main_first():
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


def needs_target_distribution(cfg: RunConfig) -> bool:
    """Whether training reads the target's own next-token distributions (its final hidden states and LM head):
    recipe.labels = target, or DSpark's loss."""
    return cfg.recipe.labels == "target" or cfg.drafter.family == "dspark"


def family_fields(cfg: RunConfig) -> dict | None:
    """The family fields of the drafter the config asks for (None for DFlash, which has none)."""
    section = {"dspark": cfg.drafter.dspark, "dflash2": cfg.drafter.dflash2}.get(cfg.drafter.family)
    return None if section is None else asdict(section)


def build_drafter(cfg: RunConfig, target: FrozenTarget | HeadTarget, tokenizer) -> DFlashDraftModel:
    """The drafter to train, in float32: drafter.init_from's (checked against the config and the target; of
    another family, its backbone with the config's family's heads, new), else a new one shaped from the target
    (seeded by train.seed)."""
    if cfg.drafter.init_from:
        source = _init_from_dir(cfg)
        drafter = DFlashDraftModel.from_pretrained(source)
        torch.manual_seed(cfg.train.seed)  # the heads a change of family adds
        drafter = with_family(drafter, cfg.drafter.family, family_fields(cfg), f"drafter.init_from ({source})")
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
        if cfg.drafter.freeze_backbone:  # the optimizer takes only parameters that require gradients
            for name, parameter in drafter.named_parameters():
                parameter.requires_grad_(is_family_parameter(name))
        return drafter.float()
    torch.manual_seed(cfg.train.seed)
    return DFlashDraftModel.from_target(
        target.config,
        num_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=target.target_layer_ids,
        mask_token_id=cfg.drafter.mask_token_id,
        tokenizer=tokenizer,
        family=cfg.drafter.family,
        family_fields=family_fields(cfg),
        **cfg.drafter.overrides,
    ).float()
