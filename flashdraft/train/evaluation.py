"""The measured τ: real speculative decoding (greedy) of held-out prompts with the drafter being trained, against
the full (untruncated) target — during training (`log.eval_every`) and once at the end of a run.

    evaluator = Evaluator(cfg, s, out)         # evaluator.enabled: whether the run has held-out prompts
    tau = evaluator.evaluate(final=True)       # collective; rank 0 gets τ (and OUT/measured_tau.json), the others None

The prompts are `data.eval_prompts` (the first `data.eval_limit`; `bundled` with the bundled training data only). τ
is tokens per target forward over all prompts' rounds, as `flashdraft eval` counts it: a mean of the prompts' own τ
would let one prompt that the target repeats (τ near the block size) outweigh the rest. The evaluator owns what
decoding takes beside the run's Setup: the prompts, the full target and the drafter's copy the engine runs.

Under torchrun every rank gathers the (sharded) drafter and rank 0 alone decodes while the others go on to the next
step's collectives and wait there. On a GPU the engine decodes from CUDA graphs captured once per run: it is sized
for the longest prompt at the first evaluation, and the bf16 copy of the drafter it decodes with is refreshed in
place (same tensors, new values) at each one, so every later evaluation replays the same graphs.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from flashdraft import bundled
from flashdraft.config import RunConfig
from flashdraft.devices import autocast
from flashdraft.distributed.data_parallel import gather_drafter
from flashdraft.drafter import DFlashDraftModel
from flashdraft.io.atomic import atomic_write_text
from flashdraft.speculative.engine import session as engine_session
from flashdraft.speculative.evaluate import Tally
from flashdraft.speculative.generate import generate, use_engine
from flashdraft.speculative.prompts import load_prompts
from flashdraft.target import load_causal_lm
from flashdraft.train.setup import Setup

MEASURED_TAU = "measured_tau.json"


def eval_prompts_path(cfg: RunConfig) -> str | None:
    """The held-out prompts of `cfg`: data.eval_prompts (`bundled`: the bundled prompts, with the bundled training
    data only); None: the run has none."""
    if cfg.data.eval_prompts == bundled.BUNDLED:
        return str(bundled.eval_prompts()) if cfg.data.train == [bundled.BUNDLED] else None
    return cfg.data.eval_prompts


class Evaluator:
    """Measures τ (the module docstring says how). It owns what that takes beside the run's Setup: the prompts, the
    full target and the drafter's copy the decoding engine runs."""

    def __init__(self, cfg: RunConfig, s: Setup, out: Path) -> None:
        self.cfg, self.s, self.out = cfg, s, Path(out)
        self.path = eval_prompts_path(cfg)
        self.prompts = None  # loaded at the first evaluation, as the full target
        self.full_target = None
        self.decoder: DFlashDraftModel | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def evaluate(self, final: bool = False) -> float | None:
        """τ of the drafter as it is now, on rank 0 (`final`: also written to OUT/measured_tau.json); None on the
        other ranks and without held-out prompts. Collective under torchrun: every rank calls it."""
        if not self.enabled:
            return None
        drafter = gather_drafter(self.s.drafter)
        if drafter is None:
            return None
        self._load()
        drafter.eval()
        try:
            return self.measure_tau(drafter, self.out / MEASURED_TAU if final else None)
        finally:
            drafter.train()

    # ---- measured τ ------------------------------------------------------------------------------------------

    def measure_tau(self, drafter: DFlashDraftModel, json_out: Path | None = None) -> float:
        """τ of greedy speculative decoding of the prompts with `drafter`; also written to `json_out`, with each
        prompt's own τ."""
        s, cfg, full = self.s, self.cfg, self.full_target
        decoder, precision = drafter, autocast(s.device)
        target_dtype = next(full.parameters()).dtype
        if use_engine(full, None) and next(drafter.parameters()).dtype != target_dtype:
            # The engine runs each model in its own dtype, without autocast: decode with a copy of the float32
            # master weights in the target's dtype. Built from the config, not deep-copied: compiled layers would
            # go on calling the modules they were compiled from.
            if self.decoder is None:
                with torch.device(s.device):
                    self.decoder = DFlashDraftModel(drafter.config).to(target_dtype).eval()
            decoder = self.decoder
            decoder.load_state_dict(drafter.state_dict())  # copies into the captured tensors
            precision = contextlib.nullcontext()
            longest = max(p.input_ids.numel() for p in self.prompts)
            engine_session.prepare(full, longest + cfg.data.eval_max_new_tokens, decoder.block_size, decoder)
        tally, per_prompt = Tally(), []
        for prompt in self.prompts:
            # Decoding runs the (train.compile) compiled layers eagerly: its cache and shapes change every round.
            with torch.no_grad(), precision, torch.compiler.set_stance("force_eager"):
                result = generate(full, decoder, prompt.input_ids.to(s.device), cfg.data.eval_max_new_tokens)
            tally.add(result)
            per_prompt.append(result.tau)
        if json_out is not None:
            atomic_write_text(json_out, json.dumps({"tau": tally.tau, "per_prompt": per_prompt}))
        return tally.tau

    # ---- what it loads ---------------------------------------------------------------------------------------

    def _load(self) -> None:
        s, cfg = self.s, self.cfg
        if self.prompts is None:
            self.prompts = load_prompts(self.path, s.tokenizer, cfg.data.eval_limit)
        if self.full_target is None:
            self.full_target = load_causal_lm(
                cfg.target.path, dtype=s.target.dtype, device=s.device, trust_remote_code=cfg.target.trust_remote_code
            )
