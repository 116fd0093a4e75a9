"""The run config's dataclasses, one section each; every field is documented by the docstring right under it.

`RunConfig.validate()` checks the values a type cannot express and raises `ConfigError` naming the dotted field.
Reading YAML and dotted overrides into these classes lives in `flashdraft.config.load`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from flashdraft.config import commands
from flashdraft.config.commands import COMMAND_CHOICES, command_checks, either, field_value, is_switch
from flashdraft.config.families import (
    FAMILY_CHOICES,
    DFlash2Loss,
    DFlash2Parts,
    DSparkHeads,
    DSparkLoss,
    family_checks,
)

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or impossible; the message names the field and the fix.

    `field` is the dotted field at fault when there is one (used to say whether the YAML file or an override set it).
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


# The values a field of a fixed set of words takes: what validate() accepts and what a command-line shortcut offers.
CHOICES: dict[str, tuple[str, ...]] = {
    "target.dtype": ("auto", "bfloat16", "float16", "float32"),
    "data.format": ("auto", "chat", "sharegpt", "text", "tokenized"),
    "data.overlong": ("truncate", "drop"),
    **FAMILY_CHOICES,
    **COMMAND_CHOICES,
}


@dataclass(kw_only=True)
class TargetConfig:
    path: str = "bundled"
    """Target model: a local HF directory, a hub id (read from the hub cache; downloaded only when HF_HUB_OFFLINE=0),
    or "bundled" (the package's tiny trained target)."""
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32."""
    trust_remote_code: bool = False
    """Run code shipped with the target checkpoint. Off unless you trust its author."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation of the target."""
    cudnn_attention: bool = False
    """Training: the target's SDPA attention layers try cuDNN's attention kernel before flash attention. cuDNN plans
    each new sequence shape once, so it can only pay off when every batch has the same length (train.static_shapes);
    leave it off otherwise. GPU only."""
    compile: bool | str = "auto"
    """Training: torch.compile the torch code between the target's fast kernels (its RMSNorms and dense MLPs), fusing
    their many small operations; worth it on a GPU, most at long sequences. true | false | auto (on CUDA unless
    target.shard). The first batch of each of the first two lengths compiles (seconds)."""
    precision: str = "bf16"
    """Training: bf16 | fp8. fp8 runs the target's linear layers (attention, Gated DeltaNet and MLP projections) as
    FP8 GEMMs with a scale per token and per output channel: weights quantized once at load (half the memory),
    activations per step. The embedding, LM head, norms and gate projections stay bf16; the per-layer probe proves
    the FP8 linears. Needs an FP8 GPU (compute capability 8.9+: Ada, Hopper) and a bf16 target; the features move
    by a few percent (docs/training.md, "FP8 target"). The measured τ always decodes with the bf16 target."""
    shard: bool = False
    """Under torchrun: shard the target's decoder layers over the ranks with FSDP2 (each GPU holds 1/N of them and
    gathers one layer at a time) instead of a whole copy per GPU; for targets that do not fit one GPU. The target
    then loads into CPU memory first."""


@dataclass(kw_only=True)
class DrafterConfig:
    num_layers: int = 5
    """Drafter decoder layers (paper: 5)."""
    block_size: int = 16
    """Tokens per drafted block, the anchor included (paper: 16)."""
    target_layer_ids: list[int] | None = None
    """Target layers whose hidden states condition the drafter; default uniform between 1 and L-3."""
    mask_token_id: int | None = None
    """Token id of MASK; default chosen from the tokenizer's unused ids (see flashdraft.drafter.mask_token)."""
    init_from: str | None = None
    """An existing drafter checkpoint to fine-tune instead of a fresh initialisation ('bundled': the shipped one,
    trained for the bundled target)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Qwen3 config fields of the drafter that differ from the target's (e.g. intermediate_size)."""
    family: str = "dflash"
    """dflash (the backbone alone) | dspark (the backbone with DSpark's Markov and confidence heads, drafter.dspark;
    its loss, recipe.dspark) | dflash2 (the backbone with DFlash2's convolutions and candidate selector,
    drafter.dflash2; its loss, recipe.dflash2; its layers sliding, window 2048, both ways inside the block, unless
    drafter.overrides choose). With drafter.init_from of another family, its backbone is kept and the heads start
    new."""
    freeze_backbone: bool = False
    """Train only what the family adds (its heads, DFlash2's convolutions) on drafter.init_from's backbone, kept."""
    dspark: DSparkHeads = field(default_factory=DSparkHeads)
    dflash2: DFlash2Parts = field(default_factory=DFlash2Parts)


@dataclass(kw_only=True)
class DataConfig:
    train: list[str] = field(default_factory=lambda: ["bundled"])
    """Training data: JSONL/Parquet paths, globs or s3:// URLs, or "bundled" (the package's small dataset)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the target's."""
    format: str = "auto"
    """auto | chat | sharegpt | text | tokenized."""
    max_length: int = 3072
    """Longest training sequence in tokens."""
    overlong: str = "truncate"
    """What to do with longer samples: truncate | drop (counted and reported either way)."""
    skip_bad: bool = False
    """Skip malformed records (counted and reported) instead of stopping at the first."""
    drop_thinking: bool = False
    """Remove <think> content from assistant turns before templating."""
    shards: str | None = None
    """Where tokenised shards are written once and reused; default: OUT/shards."""
    features: str | None = None
    """Offline training: a directory (local or s3://) of target features written by `flashdraft features`; train
    reads them instead of running the target (which is then not loaded). Null: online (the target runs)."""
    eval_prompts: str | None = "bundled"
    """JSONL of held-out prompts ({"prompt"} or {"messages"}): those of the measured τ at the end of training, and
    what `flashdraft eval` decodes. "bundled": the package's held-out prompts, for the bundled data and target (with
    other training data the measured τ is skipped); null skips the measured τ."""
    eval_limit: int = 4
    """Held-out prompts decoded for the measured τ."""
    eval_max_new_tokens: int = 48
    """Tokens generated per held-out prompt for the measured τ."""


@dataclass(kw_only=True)
class RecipeConfig:
    num_anchors: int = 512
    """Anchor positions (blocks) sampled per sequence and epoch (paper: 512). At most: a sequence with fewer response
    positions uses all of them, so a value above data.max_length only warns (it is clamped, not an error)."""
    anchor_sampling: str = "uniform"
    """How anchors are drawn among a sequence's candidate positions: uniform (distinct positions uniformly at random,
    the paper's) | stratified (the candidates cut into num_anchors equal runs, one position drawn in each: the
    blocks spread over the whole response)."""
    gamma: float | None = None
    """Loss decay over block positions, w_k = exp(-(k-1)/gamma), for loss_weighting exp; default by block size
    (16: 7, 10: 5, 8: 4)."""
    loss_weighting: str = "exp"
    """Weights of the block positions: exp (w_k = exp(-(k-1)/gamma), the paper's; loss = Σ w·ℓ / Σ w) | dpace
    (D-PACE: each position weighs what its acceptance adds to the expected accepted length, from the drafter's
    current confidences, w_j = Σ_{m>=j} Π_{i<=m} ((1-dpace_alpha)·q_i + dpace_alpha); loss = Σ w·ℓ / blocks)."""
    dpace_alpha: float = 0.5
    """D-PACE's smoothing of the confidences, in (0, 1]: the floor of each factor; 1 ignores the confidences."""
    loss: str = "ce"
    """Token loss ℓ: ce (cross-entropy of the label) | lk (LK^λ with the label as a one-hot target:
    λ·CE + (1-λ)·(1-q), λ = exp(-lk_eta·q) held constant, q the drafter's probability of the label)."""
    labels: str = "token"
    """What each block position learns: token (the data's next token, the paper's) | target (the target's whole
    next-token distribution p there, from its final hidden state and LM head: ce becomes KL(p || q) and lk uses the
    acceptance rate Σ min(p, q) for q; the whole target runs, not only up to the last captured layer, and it needs
    the live target, not data.features)."""
    lk_eta: float = 3.0
    """η of the lk loss (>= 0; 0 is cross-entropy): how fast λ moves the weight from CE to 1 - q as q grows."""
    reveal: float = 0.0
    """Fraction of blocks (in [0, 1)) that show the drafter a prefix of their true tokens: after the anchor, r of
    the bs − 1 drafted positions hold their labels instead of MASK (r uniform in 1 … bs − 2) and only the positions
    after them are learned, weighted as if the block started there. A drafter trained so can draft a block in
    several passes, each re-drafting the positions after the drafts it keeps (`flashdraft eval --refine`);
    0 (the paper's) trains single-pass drafting only."""
    dspark: DSparkLoss = field(default_factory=DSparkLoss)
    dflash2: DFlash2Loss = field(default_factory=DFlash2Loss)


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 6e-4
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    warmup_ratio: float = 0.04
    """Fraction of steps of linear warm-up before the cosine decay."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = 6
    """Passes over the data (paper: 6)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs when smaller)."""
    batch_size: int = 1
    """Sequences per micro-batch per rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step and rank. One step takes batch_size x grad_accum x ranks sequences: to
    repeat a run on twice the GPUs, halve grad_accum."""
    seed: int = 0
    """Seed of initialisation, data order and anchors."""
    attention: str = "auto"
    """The drafter's attention in training: flex (compiled FlexAttention with a block-sparse mask, CUDA only) | sdpa
    (a dense boolean mask) | auto (flex on CUDA, sdpa on the CPU). Same mask, same result up to rounding."""
    compile: bool | str = "auto"
    """torch.compile the drafter's layers: true | false | auto (on CUDA, off on the CPU). The first step compiles
    (about a minute)."""
    static_shapes: bool | str = "auto"
    """Pad every micro-batch to data.max_length positions and recipe.num_anchors blocks (padding is masked out: the
    same loss and gradients), so the compiled layers see one shape and compile once, with no dynamic shapes (a
    compiled run whose shapes changed stopped at step 2 on the H200). true | false | auto (on when compiled)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    on_nonfinite: str = "stop"
    """A NaN/inf loss or gradient: stop (the run ends, naming the last good checkpoint) | skip (that step's update
    is dropped, counted and reported)."""
    collective_timeout_s: float = 300.0
    """Many processes (torchrun): the longest a rank waits for the others in one collective of a step (the process
    group's timeout: gloo raises, NCCL's watchdog ends the process), and the longest a rank's heartbeat may be silent
    (its process stopped or hung, its node lost) before the job stops with an error naming that rank. Waits on the
    work of one rank alone (tokenising, evaluating, writing a checkpoint) are not bounded by it."""
    peak_tflops: float | None = None
    """Dense bf16 TFLOP/s of one GPU, the denominator of the logged MFU. null: from flashdraft's table of known GPUs
    (flashdraft/telemetry/flops.py); on a GPU missing from it MFU is reported as unknown."""


@dataclass(kw_only=True)
class LogConfig:
    out: str = "runs/default"
    """Output directory: checkpoints, metrics.jsonl, training_curve.png."""
    every: int = 10
    """Log every N optimizer steps."""
    checkpoint_every: int = 200
    """Write a checkpoint every N optimizer steps (and at the end)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept."""
    eval_every: int = 0
    """Measure real τ (greedy speculative decoding of data.eval_prompts, data.eval_limit prompts) every N steps, as
    `tau` in that step's metrics; a multiple of log.every. 0: only once, at the end. Loads the full target once."""
    heldout_every: int = 0
    """Score the held-out loss and simulated τ every N steps besides (one forward pass of the held-out rows, far
    cheaper than decoding them), so the curve shows their course between the measured τ; a multiple of log.every.
    0: only with each measured τ."""
    trackers: list[str] = field(default_factory=list)
    """Optional trackers: wandb, tensorboard, trackio. A tracker named here must be installed (the run refuses to
    start otherwise)."""


@dataclass(kw_only=True)
class S3Config:
    connect_timeout: float = 5.0
    """Seconds to wait for an s3:// endpoint to accept a connection. A reachable endpoint accepts in well under a
    second; 5 s leaves room for two lost SYNs (TCP resends them after 1 and 3 s)."""
    read_timeout: float = 8.0
    """Seconds an open s3:// connection may stay silent before the request counts as failed (the longest gap
    between two received bytes, not the time for a whole transfer). S3 and MinIO answer within a second; raise it
    for a slow or distant store."""
    attempts: int = 3
    """Tries per s3:// request, the first included (botocore's "standard" retries: connection errors, timeouts,
    throttling and 5xx answers, with exponential back-off; a transfer cut mid-body is read again too). With the
    defaults an endpoint that never answers fails within 3 x 8 s plus at most 3 s of back-off, where the libraries'
    own defaults (5 x 5 attempts of 15 s) take minutes."""


@dataclass(kw_only=True)
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    s3: S3Config = field(default_factory=S3Config)
    # The sections of the other commands (config/commands.py); training reads none of them.
    eval: commands.EvalCommand = field(default_factory=commands.EvalCommand)
    regenerate: commands.RegenerateCommand = field(default_factory=commands.RegenerateCommand)
    prepare: commands.PrepareCommand = field(default_factory=commands.PrepareCommand)
    export: commands.ExportCommand = field(default_factory=commands.ExportCommand)
    doctor: commands.DoctorCommand = field(default_factory=commands.DoctorCommand)
    bench: commands.BenchCommand = field(default_factory=commands.BenchCommand)

    def validate(self) -> RunConfig:
        checks = [
            ("drafter.num_layers", self.drafter.num_layers >= 1, "must be >= 1"),
            (
                "drafter.overrides",
                not (self.drafter.overrides and self.drafter.init_from),
                "cannot change a drafter loaded from drafter.init_from (set drafter.init_from: null to train a new one)",
            ),
            ("drafter.block_size", self.drafter.block_size >= 2, "must be >= 2 (the anchor plus one drafted token)"),
            ("data.max_length", self.data.max_length >= self.drafter.block_size, "must be >= drafter.block_size"),
            ("data.overlong", self.data.overlong in CHOICES["data.overlong"], "must be 'truncate' or 'drop'"),
            ("data.format", self.data.format in CHOICES["data.format"], f"must be {either(CHOICES['data.format'])}"),
            ("data.train", bool(self.data.train), "needs at least one path"),
            ("data.eval_limit", self.data.eval_limit >= 1, "must be >= 1"),
            ("data.eval_max_new_tokens", self.data.eval_max_new_tokens >= 1, "must be >= 1"),
            ("recipe.num_anchors", self.recipe.num_anchors >= 1, "must be >= 1"),
            ("recipe.gamma", self.recipe.gamma is None or self.recipe.gamma > 0, "must be > 0"),
            (
                "recipe.anchor_sampling",
                self.recipe.anchor_sampling in ("uniform", "stratified"),
                "must be uniform or stratified",
            ),
            ("recipe.loss_weighting", self.recipe.loss_weighting in ("exp", "dpace"), "must be exp or dpace"),
            ("recipe.dpace_alpha", 0 < self.recipe.dpace_alpha <= 1, "must be in (0, 1] (0.5 is D-PACE's default)"),
            (
                "recipe.gamma",
                self.recipe.gamma is None or self.recipe.loss_weighting == "exp",
                "is the exp weighting's decay, unused with recipe.loss_weighting = dpace: set it to null",
            ),
            ("recipe.loss", self.recipe.loss in ("ce", "lk"), "must be ce or lk"),
            ("recipe.labels", self.recipe.labels in ("token", "target"), "must be token or target"),
            ("recipe.reveal", 0 <= self.recipe.reveal < 1, "must be in [0, 1) (0: every block all MASK, the paper's)"),
            ("recipe.lk_eta", self.recipe.lk_eta >= 0, "must be >= 0 (0 is cross-entropy; 3 is the LK paper's)"),
            ("optim.lr", self.optim.lr > 0, "must be > 0"),
            ("optim.warmup_ratio", 0 <= self.optim.warmup_ratio < 1, "must be in [0, 1)"),
            ("optim.grad_clip", self.optim.grad_clip > 0, "must be > 0"),
            (
                "optim.betas",
                len(self.optim.betas) == 2 and all(0 <= b < 1 for b in self.optim.betas),
                "must be two numbers in [0, 1)",
            ),
            ("train.epochs", self.train.epochs >= 1, "must be >= 1"),
            ("train.max_steps", self.train.max_steps is None or self.train.max_steps >= 1, "must be >= 1"),
            ("train.batch_size", self.train.batch_size >= 1, "must be >= 1"),
            ("train.grad_accum", self.train.grad_accum >= 1, "must be >= 1"),
            ("train.device", self.train.device in ("auto", "cpu", "cuda"), "must be auto, cpu or cuda"),
            ("train.on_nonfinite", self.train.on_nonfinite in ("stop", "skip"), "must be stop or skip"),
            ("train.collective_timeout_s", self.train.collective_timeout_s > 0, "must be > 0 (seconds)"),
            ("train.attention", self.train.attention in ("auto", "flex", "sdpa"), "must be auto, flex or sdpa"),
            ("train.static_shapes", is_switch(self.train.static_shapes), "must be auto, true or false"),
            ("train.compile", is_switch(self.train.compile), "must be auto, true or false"),
            ("train.peak_tflops", self.train.peak_tflops is None or self.train.peak_tflops > 0, "must be > 0 or null"),
            ("target.compile", is_switch(self.target.compile), "must be auto, true or false"),
            ("target.precision", self.target.precision in ("bf16", "fp8"), "must be bf16 or fp8"),
            (
                "target.precision",
                not (self.target.precision == "fp8" and self.target.shard),
                "fp8 cannot be combined with target.shard (FSDP2 shards the bf16 weights; an FP8 target is half "
                "the size: try it unsharded)",
            ),
            (
                "target.precision",
                not (self.target.precision == "fp8" and self.target.dtype in ("float16", "float32")),
                f"fp8 needs a bfloat16 target (the FP8 GEMM writes bf16), not target.dtype = {self.target.dtype}",
            ),
            (
                "target.dtype",
                self.target.dtype in CHOICES["target.dtype"],
                f"must be {either(CHOICES['target.dtype'])}",
            ),
            ("log.every", self.log.every >= 1, "must be >= 1"),
            ("log.checkpoint_every", self.log.checkpoint_every >= 1, "must be >= 1"),
            ("log.keep_checkpoints", self.log.keep_checkpoints >= 1, "must be >= 1"),
            ("s3.connect_timeout", self.s3.connect_timeout > 0, "must be > 0 (seconds)"),
            ("s3.read_timeout", self.s3.read_timeout > 0, "must be > 0 (seconds)"),
            ("s3.attempts", self.s3.attempts >= 1, "must be >= 1 (the first try included)"),
            (
                "log.eval_every",
                self.log.eval_every >= 0 and self.log.eval_every % self.log.every == 0,
                f"must be 0 or a multiple of log.every ({self.log.every}): τ is reported in that step's metrics",
            ),
            (
                "log.heldout_every",
                self.log.heldout_every >= 0 and self.log.heldout_every % self.log.every == 0,
                f"must be 0 or a multiple of log.every ({self.log.every}): the scores are in that step's metrics",
            ),
            *family_checks(self),
            *command_checks(self, COMMAND_CHOICES),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"{name} = {field_value(self, name)!r}: {why}", field=name)
        ids = self.drafter.target_layer_ids
        if ids is not None and (len(set(ids)) != len(ids) or any(i < 0 for i in ids)):
            raise ConfigError(
                f"drafter.target_layer_ids = {ids}: must be distinct, non-negative layer indices",
                field="drafter.target_layer_ids",
            )
        if self.recipe.num_anchors > self.data.max_length:
            # Not an error: anchors are drawn per sequence from its response positions, all of them when fewer.
            logger.warning(
                "recipe.num_anchors = %d exceeds data.max_length = %d: every sequence will use all of its "
                "response positions as anchors (clamped per sequence)",
                self.recipe.num_anchors,
                self.data.max_length,
            )
        return self
