"""The DFlash training loop: frozen target → context features → packed blocks → drafter → chunked loss.

    flashdraft train                                     # the bundled default: a laptop CPU, a few minutes
    flashdraft train --config examples/tiny.yaml --out runs/tiny train.max_steps=50
    flashdraft train --config examples/qwen3.5-27b.yaml --resume

Everything a step needs is derived from the step number (data order and anchors are seeded by (seed, epoch,
sample)), so a resumed run repeats an uninterrupted one exactly. Many processes (torchrun): see
flashdraft/train/distributed.py; the loop calls it in a few places and is otherwise the same.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import operator
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft import bundled
from flashdraft.config import RunConfig, to_dict
from flashdraft.drafter import DFlashDraftModel
from flashdraft.hub import NO_HUB_KERNELS
from flashdraft.train import distributed
from flashdraft.train.blocks import anchor_generator, build_blocks, sample_anchors
from flashdraft.train.checkpoint import CheckpointManager
from flashdraft.train.compile import compile_drafter, static_shapes
from flashdraft.train.loss import dflash_loss
from flashdraft.train.masks import attention_kind, drafter_mask
from flashdraft.train.metrics import MetricsLogger, check_trackers, draw_training_curve
from flashdraft.train.optim import build_optimizer, build_scheduler
from flashdraft.train.peak_flops import Peak, describe, device_peak
from flashdraft.train.stop import GracefulStop

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a non-finite loss); the message names the last good checkpoint."""


@dataclass
class TrainResult:
    out: Path
    steps: int
    loss: float
    sim_tau: float
    measured_tau: float | None
    checkpoint: Path | None
    curve: Path | None
    stopped_by: str | None = None  # the signal that ended the run early (SIGTERM, SIGINT), if one did


@dataclass
class Setup:
    device: torch.device
    tokenizer: object
    target: object  # FrozenTarget
    drafter: DFlashDraftModel
    data: object  # TokenizedDataset
    steps_per_epoch: int
    total_steps: int
    features: object = None  # FeatureStore when training offline (data.features): read instead of the target
    full_target: object = None  # the untruncated target, loaded on the first real-τ measurement
    peak: Peak | None = None  # dense bf16 rate of one device, for MFU (None: unknown, or a CPU)


def train(cfg: RunConfig, resume: bool = False, console=None) -> TrainResult:
    out = Path(cfg.log.out)
    check_trackers(cfg.log.trackers)  # before minutes of loading
    # Decided before config.json is written: it is what tells this run's OUT from another run's.
    restart = resume and restart_without_checkpoint(out, cfg)
    out.mkdir(parents=True, exist_ok=True)
    if distributed.world().is_main:
        _write_atomically(out / "config.json", json.dumps(to_dict(cfg), indent=1))
    s = setup(cfg, out, console)
    optimizer = build_optimizer(s.drafter.parameters(), cfg.optim, s.device)
    scheduler = build_scheduler(optimizer, cfg.optim, s.total_steps)
    checkpoints = CheckpointManager(out, keep=cfg.log.keep_checkpoints)
    start, latest = 0, None
    if restart:
        logger.warning("--resume: %s holds this run's config but no checkpoint yet (it stopped before the first); "
                       "starting from step 0, the steps it logged are dropped", out)  # fmt: skip
    elif resume:
        latest = checkpoints.latest()
        if latest is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
        start = checkpoints.load(latest, s.drafter, optimizer, scheduler)["step"]
        logger.info("resumed from %s (step %d)", latest, start)
    metrics = MetricsLogger(out, total_steps=s.total_steps, trackers=cfg.log.trackers, config=to_dict(cfg),
                            console=console, resume_from_step=start if resume else None,
                            enabled=distributed.world().is_main)  # fmt: skip
    # The checkpoint resumed from, not a second latest(): that would hash every checkpoint again and repeat the
    # warning about each damaged one it skips.
    last_ckpt, timer = latest, _Timer(s.device)
    # Loss, accuracy and τ of a log line are over the last log.every steps: the line after a run's last full window
    # (a run that does not end on a multiple of log.every, or a stop) reaches back into the window before it rather
    # than report one or two steps' worth of sequences.
    window: deque = deque(maxlen=cfg.log.every)
    skipped, stopped_by = 0, None
    with metrics.progress(), GracefulStop() as stop:
        metrics.advance(start)
        for step in range(start, s.total_steps):
            stats, tokens, finite = train_step(s, cfg, optimizer, step)
            if not finite:
                if cfg.train.on_nonfinite == "stop":
                    raise TrainingError(f"non-finite loss or gradient at step {step + 1}; nothing of it was applied. "
                                        f"Last good checkpoint: {last_ckpt or 'none'} (resume with --resume, or set "
                                        "train.on_nonfinite=skip)")  # fmt: skip
                skipped += 1
                logger.warning("step %d: non-finite loss or gradient, update skipped (%d so far)", step + 1, skipped)
            scheduler.step()
            window.append(stats)
            timer.add(tokens, stats.valid.sum())
            metrics.advance()
            done = step + 1
            # A stop logs the steps since the last log line too, so none is lost from the metrics.
            halt = stop.requested(s.device)
            if done % cfg.log.every == 0 or done == s.total_steps or halt:
                row = summarize(functools.reduce(operator.add, window), timer.take(), s, scheduler.get_last_lr()[0])
                row["skipped"] = skipped
                if cfg.log.eval_every and done % cfg.log.eval_every == 0 and done < s.total_steps and not halt:
                    row["tau"] = _periodic_tau(cfg, s)
                    timer.take()  # decoding time is not training throughput
                metrics.log(done, row)
            if done % cfg.log.checkpoint_every == 0 or done == s.total_steps or halt:
                last_ckpt = checkpoints.save(done, s.drafter, optimizer, scheduler, {"step": done})
            if halt:
                stopped_by = stop.signal_name or "another rank's signal"
                logger.warning("%s: stopped after step %d of %d; checkpoint %s (continue with --resume)",
                               stopped_by, done, s.total_steps, last_ckpt)  # fmt: skip
                break
    metrics.close()
    if stopped_by is not None:
        # No final τ measurement: a stopped job should leave within its grace period.
        main = distributed.world().is_main  # the stop logged a metrics row (above)
        curve = draw_training_curve(out / "metrics.jsonl", out / "training_curve.png") if main else None
        return TrainResult(out, done, float("nan"), float("nan"), None, last_ckpt, curve, stopped_by)
    # Decoding (the measured τ) and the report are rank 0's, on a plain copy of the (sharded) drafter.
    s.drafter = distributed.gather_drafter(s.drafter)
    if s.drafter is None:
        return TrainResult(out, s.total_steps, float("nan"), float("nan"), None, last_ckpt, None)
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]
    measured = measure_tau(cfg, s, out / "measured_tau.json")
    curve = draw_training_curve(out / "metrics.jsonl", out / "training_curve.png", final_tau=measured)
    return TrainResult(out, s.total_steps, final["loss"], final["sim_tau"], measured, last_ckpt, curve)


def restart_without_checkpoint(out: Path, cfg: RunConfig) -> bool:
    """Whether `--resume` starts from step 0: OUT has no checkpoint yet but this same run's config.json (a job
    stopped before its first checkpoint, restarted with its command line). False when OUT has a checkpoint; a
    FileNotFoundError naming the difference when OUT has neither, or another run's config."""
    if CheckpointManager(out).checkpoints():
        return False
    saved = out / "config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'} and no run started in {out} "
                                "(nothing to resume)")  # fmt: skip
    try:
        before = json.loads(saved.read_text())
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}, and {saved} is unreadable "
                                f"({exc})") from None  # fmt: skip
    difference = _first_difference(json.loads(json.dumps(to_dict(cfg))), before)
    if difference is not None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'}, and {saved} is another run's "
                                f"config ({difference}): give this run another --out, or drop --resume to start it "
                                "over there")  # fmt: skip
    return True


def _first_difference(now, before, prefix: str = "") -> str | None:
    """'train.max_steps: 8 now, 6 there' for the first key whose value differs; None when equal."""
    if isinstance(now, dict) and isinstance(before, dict):
        for key in dict.fromkeys([*now, *before]):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in now or key not in before:
                return (f"{name}: {repr(now[key]) if key in now else 'missing'} now, "
                        f"{repr(before[key]) if key in before else 'missing'} there")  # fmt: skip
            if (found := _first_difference(now[key], before[key], name)) is not None:
                return found
        return None
    return None if now == before else f"{prefix}: {now!r} now, {before!r} there"


def _write_atomically(path: Path, text: str) -> None:
    """Other ranks may read the file meanwhile (`restart_without_checkpoint`): never a half-written one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def train_step(s: Setup, cfg: RunConfig, optimizer, step: int, mark=None):
    """One optimizer step over `grad_accum` micro-batches; the loss is normalised over the whole step.

    Returns (loss stats, sequence tokens, finite). A non-finite loss or gradient norm applies no update.
    `mark(phase)` (benchmarks: `flashdraft.train.bench`) is called as each phase has been queued: "target",
    "drafter_fwd", "loss", "drafter_bwd" per micro-batch, then "optimizer".
    """
    mark = mark or _no_mark
    attention = attention_kind(cfg.train.attention, s.device)
    # Static shapes: the drafter sees data.max_length positions and recipe.num_anchors blocks in every micro-batch
    # (the target still runs on the real width; its features are padded after).
    width = cfg.data.max_length if static_shapes(cfg.train.static_shapes, cfg.train.compile, s.device) else None
    indices = step_indices(s, cfg, step)
    micro = [_collate(s.data, idx, s.device) for idx in indices]
    epoch = step // s.steps_per_epoch
    batches = [
        _blocks(s, cfg, ids, mask, idx, epoch, width) for (ids, mask, _), idx in zip(micro, indices, strict=True)
    ]
    # Over the whole global step (every micro-batch of every rank): each token weighs the same whatever the split.
    denominator = distributed.all_sum(sum(b.weights.sum() for b in batches)).clamp(min=1e-6)
    # Counted before the GPU work is queued: a host sync later would stall the queue between micro-batches.
    tokens = sum(int(attn.sum()) for _, _, attn in micro)
    total = None
    for (ids, _, attn), batch, idx in zip(micro, batches, indices, strict=True):
        features = s.target.capture(ids, attn) if s.features is None else s.features.batch(idx, ids.shape[1])
        if width is not None:
            features = pad_positions(features, width)
        mark("target")
        with _autocast(s.device):
            hidden = s.drafter(
                position_ids=batch.position_ids,
                attention_mask=drafter_mask(batch, s.drafter.config, attention),
                noise_embedding=s.target.embed(batch.block_ids),
                target_hidden=features,
            )
        mark("drafter_fwd")
        loss, stats = dflash_loss(hidden, s.target.lm_head_weight, batch.labels, batch.weights,
                                  block_size=batch.block_size, denominator=denominator)  # fmt: skip
        mark("loss")
        loss.backward()
        mark("drafter_bwd")
        total = stats if total is None else total + stats
    grad_norm = distributed.clip_grad_norm_(s.drafter.parameters(), cfg.optim.grad_clip)
    total, tokens = distributed.sum_stats(total, tokens)
    # One host sync per step: applying a NaN update would poison every later step and checkpoint.
    finite = bool(torch.isfinite(total.loss_sum) & torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("optimizer")
    return total, tokens, finite


def _no_mark(phase: str) -> None:
    pass


def step_indices(s: Setup, cfg: RunConfig, step: int) -> list[list[int]]:
    """Sample indices of this rank's micro-batches of `step`: a fixed function of (seed, step, rank, world)."""
    per_step = cfg.train.batch_size * cfg.train.grad_accum * distributed.world().size
    epoch, offset = divmod(step, s.steps_per_epoch)
    order = _epoch_order(s.data, epoch, cfg.train.seed)
    chunk = order[offset * per_step : (offset + 1) * per_step]
    b = cfg.train.batch_size
    return distributed.rank_share([chunk[i : i + b] for i in range(0, per_step, b)])


_ORDER_CACHE: dict = {}


def _epoch_order(data, epoch: int, seed: int) -> list[int]:
    key = (id(data), epoch, seed)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE.clear()
        _ORDER_CACHE[key] = data.epoch_order(epoch, seed)
    return _ORDER_CACHE[key]


def _collate(data, indices: list[int], device: torch.device):
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
        raise ValueError(f"a micro-batch of {t.shape[1]} positions is longer than data.max_length = {width}: prepare "
                         "the data with this max_length, or set train.static_shapes=false")  # fmt: skip
    pad = [0, 0] * (t.ndim - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def _blocks(s: Setup, cfg: RunConfig, ids, mask, indices: list[int], epoch: int, width: int | None = None):
    anchors = [
        sample_anchors(
            mask[row].cpu(),
            cfg.recipe.num_anchors,
            s.drafter.block_size,
            anchor_generator(cfg.train.seed, epoch, index),
        )  # fmt: skip
        for row, index in enumerate(indices)
    ]
    num_blocks = None
    if width is not None:
        ids, mask, num_blocks = pad_positions(ids, width), pad_positions(mask, width), cfg.recipe.num_anchors
    return build_blocks(ids, mask, anchors, s.drafter.block_size, s.drafter.mask_token_id, cfg.recipe.gamma,
                        num_blocks)  # fmt: skip


def _autocast(device: torch.device):
    # bf16 compute on the GPU with float32 master weights; plain float32 on the CPU.
    return (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )


class _Timer:
    """Sequence tokens, labelled (drafted) positions and seconds since the last `take`."""

    def __init__(self, device: torch.device):
        self.device, self.tokens, self.drafted, self.start = device, 0, 0, time.perf_counter()

    def add(self, tokens: int, drafted) -> None:
        self.tokens += tokens
        self.drafted = self.drafted + drafted  # a device tensor: read at `take`, not one host sync per step

    def take(self) -> tuple[int, int, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        out = (self.tokens, int(self.drafted), now - self.start)
        self.tokens, self.drafted, self.start = 0, 0, now
        return out


def summarize(stats, timing: tuple[int, int, float], s: Setup, lr: float) -> dict:
    """A metrics row: loss, accuracy and τ of `stats` (summed over the steps of a log window: token-weighted means
    over it); speed and MFU of `timing` (sequence tokens, drafted positions, seconds since the last row). "mfu" is
    None on a GPU of unknown peak, absent on a CPU."""
    tokens, drafted, seconds = timing
    acc = stats.accuracy()
    row = {
        "loss": float(stats.loss_sum / stats.weight_sum.clamp(min=1e-12)),
        "sim_tau": float(stats.tau()),
        "block_tau": float(stats.block_tau()),
        "acc": [round(float(a), 4) for a in acc],
        "tok_s": tokens / seconds,
        "draft_tok_s": drafted / seconds,
        "mem_gib": torch.cuda.max_memory_allocated() / 2**30 if s.device.type == "cuda" else None,
        "lr": lr,
    }
    if s.device.type == "cuda":
        # Tokens and positions are every rank's (the global steps'): against every rank's peak.
        peak = s.peak.flops * distributed.world().size if s.peak else None
        row["mfu"] = step_flops(s, tokens, drafted) / seconds / peak if peak else None
    return row


def step_flops(s: Setup, seq_tokens: int, labelled: int) -> float:
    """FLOPs of a training step (the cost model MFU is measured with; attention excluded): 2 x params for the target
    forward up to the last captured layer over the sequence tokens, 6 x params for the drafter's forward and backward
    (fc over the sequence tokens, the rest over the block positions), 4 x vocab x width for the LM-head loss (its
    forward and input gradient) over the labelled positions."""
    target_params = sum(
        p.numel() for n, p in s.target.model.named_parameters() if "embed" not in n and "lm_head" not in n
    )
    fc_params = s.drafter.fc.weight.numel()  # fc runs over the context tokens, every other weight over the blocks
    drafter_params = sum(p.numel() for p in s.drafter.parameters()) - fc_params
    vocab, width = s.target.lm_head_weight.shape
    blocks_tokens = labelled * s.drafter.block_size / max(1, s.drafter.block_size - 1)
    return (2 * target_params * seq_tokens + 6 * drafter_params * blocks_tokens + 6 * fc_params * seq_tokens
            + 4 * vocab * width * labelled)  # fmt: skip


def setup(cfg: RunConfig, out: Path, console) -> Setup:
    device, tokenizer, target, data, features = load_inputs(cfg, out, console)
    drafter = _drafter(cfg, target, tokenizer).to(device)
    compile_drafter(drafter, cfg.train, device)  # per layer, before sharding (as torchtitan orders them)
    drafter = distributed.parallelize_drafter(drafter, device)
    # The global step: every rank takes batch_size x grad_accum of its sequences (distributed.py).
    per_step = cfg.train.batch_size * cfg.train.grad_accum * distributed.world().size
    steps_per_epoch = len(data) // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"data: {len(data)} samples, fewer than one step needs (train.batch_size x train.grad_accum "
                         f"x {distributed.world().size} processes = {per_step})")  # fmt: skip
    total = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    peak = device_peak(device, cfg.train.peak_tflops)
    if (line := describe(device, peak)) is not None and distributed.world().is_main:
        logger.info("%s", line)
    return Setup(device, tokenizer, target, drafter, data, steps_per_epoch, total, features, peak=peak)


def load_inputs(cfg: RunConfig, out: Path, console, *, offline: bool | None = None):
    """(device, tokenizer, frozen target, tokenised data, features) of `cfg`; also what `flashdraft features` uses.

    Offline (`data.features` set, unless `offline=False`): the features are read from there and the target is only
    its config, embedding and LM head, saved beside them; features is None otherwise.
    """
    from rich import get_console
    from transformers.utils import logging as hf_logging

    from flashdraft.data import FormatConfig, PrepareConfig, TokenizedDataset, prepare_shards
    from flashdraft.target import FrozenTarget, load_target

    hf_logging.disable_progress_bar()  # transformers' per-checkpoint tqdm bars would tear the rich progress bar
    offline = bool(cfg.data.features) if offline is None else offline
    layer_ids = captured_layer_ids(cfg)
    device = _device(cfg.train.device)
    dtype = _dtype(cfg.target.dtype, device)
    # target.shard: the whole target never sits on one GPU; it loads into CPU memory and each rank keeps 1/N.
    load_on = torch.device("cpu") if cfg.target.shard and distributed.world().size > 1 else device
    torch.manual_seed(cfg.train.seed)
    features = None
    if cfg.target.path == bundled.BUNDLED:
        tokenizer_path = cfg.data.tokenizer or str(bundled.tokenizer_dir())
    else:
        tokenizer_path = cfg.data.tokenizer or cfg.target.path
    if offline:
        from flashdraft.data.features import FeatureStore

        features = FeatureStore(cfg.data.features, device=device, s3=cfg.s3)
        target = features.head_target(layer_ids)
    elif cfg.target.path == bundled.BUNDLED:
        model = bundled.build_target(dtype=dtype, device=load_on)
        ids = layer_ids or _default_ids(model.config.num_hidden_layers, cfg.drafter.num_layers)
        target = FrozenTarget.from_model(model, ids)
    else:
        target = load_target(cfg.target.path, target_layer_ids=layer_ids, dtype=dtype,
                             device=load_on, trust_remote_code=cfg.target.trust_remote_code,
                             attn_implementation=cfg.target.attn_implementation)  # fmt: skip
    if cfg.target.shard and not offline:
        distributed.shard_target(target.model, device)
    if not offline:
        target.configure(cfg.target)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=cfg.target.trust_remote_code)
    sources = bundled.train_data() if cfg.data.train == [bundled.BUNDLED] else cfg.data.train
    # Rank 0 tokenises (or finds the shards already there); the others then reuse its shards.
    with distributed.main_first():
        prepared = prepare_shards(
            PrepareConfig(data=sources, tokenizer=tokenizer_path, out=cfg.data.shards or str(out / "shards"),
                          format=FormatConfig(format=cfg.data.format, drop_thinking=cfg.data.drop_thinking),
                          max_length=cfg.data.max_length, overlong=cfg.data.overlong, skip_bad=cfg.data.skip_bad,
                          s3=cfg.s3, progress=(console or get_console()).is_terminal),  # a bar in a log file: a torn line
            tokenizer=tokenizer, console=console,
        )  # fmt: skip
    data = TokenizedDataset(prepared.path)
    if features is not None:
        features.check_data(data)
    return device, tokenizer, target, data, features


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


def _drafter(cfg: RunConfig, target, tokenizer) -> DFlashDraftModel:
    if cfg.drafter.init_from:
        source = _init_from_dir(cfg)
        drafter = DFlashDraftModel.from_pretrained(source)
        for name, want, got in (("block_size", cfg.drafter.block_size, drafter.block_size),
                                ("num_layers", cfg.drafter.num_layers, len(drafter.layers))):  # fmt: skip
            if want != got:
                raise ValueError(f"drafter.{name} = {want}, but the drafter of drafter.init_from ({source}) was "
                                 f"trained with {got}: set drafter.{name}: {got}, or drafter.init_from: null")  # fmt: skip
        if list(drafter.target_layer_ids) != list(target.target_layer_ids):
            raise ValueError(f"drafter.init_from: its target_layer_ids {drafter.target_layer_ids} differ from the "
                             f"target's captured layers {target.target_layer_ids}")  # fmt: skip
        return drafter.float()
    torch.manual_seed(cfg.train.seed)
    return DFlashDraftModel.from_target(
        target.config, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
        target_layer_ids=target.target_layer_ids, mask_token_id=cfg.drafter.mask_token_id, tokenizer=tokenizer,
        **cfg.drafter.overrides,
    ).float()  # fmt: skip


def _default_ids(num_layers: int, n: int) -> list[int]:
    from flashdraft.drafter.config import build_target_layer_ids

    return build_target_layer_ids(num_layers, n)


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device = cuda, but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _periodic_tau(cfg: RunConfig, s: Setup) -> float | None:
    """measure_tau during training: every rank gathers the (sharded) drafter, rank 0 decodes, the others go on to
    the next step's collectives and wait there."""
    plain = distributed.gather_drafter(s.drafter)
    return None if plain is None else measure_tau(cfg, s, drafter=plain)


def measure_tau(cfg: RunConfig, s: Setup, json_out: Path | None = None, drafter=None) -> float | None:
    """τ of real speculative decoding (greedy) on held-out prompts, against the full (untruncated) target.

    None when there are no held-out prompts. The full target is loaded once per run and kept on `s`. `drafter`:
    a plain (unsharded) drafter to decode with, default `s.drafter`.
    """
    prompts_path = cfg.data.eval_prompts
    if prompts_path == bundled.BUNDLED:
        if cfg.data.train != [bundled.BUNDLED]:
            return None
        prompts_path = str(bundled.eval_prompts())
    if prompts_path is None:
        return None
    from flashdraft import fastpath
    from flashdraft.speculative.generate import generate, use_engine
    from flashdraft.speculative.prompts import load_prompts

    if s.full_target is None:
        if cfg.target.path == bundled.BUNDLED:
            full = bundled.build_target(dtype=s.target.dtype, device=s.device)
        else:
            from transformers import AutoModelForCausalLM

            full = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=s.target.dtype,
                                                        trust_remote_code=cfg.target.trust_remote_code,
                                                        **NO_HUB_KERNELS).to(s.device)  # fmt: skip
        fastpath.enable(full, strict=False)
        s.full_target = full.eval()
    full = s.full_target
    drafter = (drafter or s.drafter).eval()
    decoder, precision = drafter, _autocast(s.device)
    target_dtype = next(full.parameters()).dtype
    if use_engine(full, None) and next(drafter.parameters()).dtype != target_dtype:
        # The engine runs each model in its own dtype, without autocast: decode with a copy of the float32 master
        # weights in the target's dtype. Built from the config, not deep-copied: compiled layers would go on calling
        # the modules they were compiled from.
        with torch.device(s.device):
            decoder = DFlashDraftModel(drafter.config).to(target_dtype).eval()
        decoder.load_state_dict(drafter.state_dict())
        precision = contextlib.nullcontext()
    taus = []
    for prompt in load_prompts(prompts_path, s.tokenizer, cfg.data.eval_limit):
        # Decoding runs the (train.compile) compiled layers eagerly: its cache and shapes change every round.
        with torch.no_grad(), precision, torch.compiler.set_stance("force_eager"):
            result = generate(full, decoder, prompt.input_ids.to(s.device), cfg.data.eval_max_new_tokens)
        taus.append(result.tau)
    drafter.train()
    tau = sum(taus) / len(taus)
    if json_out is not None:
        json_out.write_text(json.dumps({"tau": tau, "per_prompt": taus}))
    return tau
