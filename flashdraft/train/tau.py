"""The measured τ: real speculative decoding (greedy) of held-out prompts with the drafter being trained, against
the full (untruncated) target — during training (`log.eval_every`) and once at the end of a run.

    tau = measure_tau(cfg, s, out / "measured_tau.json")      # None when there are no held-out prompts

On a GPU the engine decodes from CUDA graphs. They are captured once per run: the engine is sized for the longest
held-out prompt before the first one, and the bf16 copy of the drafter it decodes with is kept on `s` and refreshed
in place (same tensors, new values) at each evaluation, so that every later evaluation replays the same graphs.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from flashdraft import bundled
from flashdraft.config import RunConfig
from flashdraft.devices import autocast
from flashdraft.drafter import DFlashDraftModel
from flashdraft.speculative.engine import session as engine_session
from flashdraft.speculative.evaluate import Tally
from flashdraft.speculative.generate import generate, use_engine
from flashdraft.speculative.prompts import load_prompts
from flashdraft.target import load_causal_lm
from flashdraft.train import data_parallel
from flashdraft.train.setup import Setup


def periodic_tau(cfg: RunConfig, s: Setup) -> float | None:
    """measure_tau during training: every rank gathers the (sharded) drafter, rank 0 decodes, the others go on to
    the next step's collectives and wait there."""
    plain = data_parallel.gather_drafter(s.drafter)
    return None if plain is None else measure_tau(cfg, s, drafter=plain)


def measure_tau(
    cfg: RunConfig, s: Setup, json_out: Path | None = None, drafter: DFlashDraftModel | None = None
) -> float | None:
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
    if s.full_target is None:
        s.full_target = load_causal_lm(
            cfg.target.path, dtype=s.target.dtype, device=s.device, trust_remote_code=cfg.target.trust_remote_code
        )
    full = s.full_target
    drafter = (drafter or s.drafter).eval()
    decoder, precision = drafter, autocast(s.device)
    target_dtype = next(full.parameters()).dtype
    prompts = load_prompts(prompts_path, s.tokenizer, cfg.data.eval_limit)
    if use_engine(full, None) and next(drafter.parameters()).dtype != target_dtype:
        # The engine runs each model in its own dtype, without autocast: decode with a copy of the float32 master
        # weights in the target's dtype. Built from the config, not deep-copied: compiled layers would go on calling
        # the modules they were compiled from.
        if s.tau_decoder is None:
            with torch.device(s.device):
                s.tau_decoder = DFlashDraftModel(drafter.config).to(target_dtype).eval()
        decoder = s.tau_decoder
        decoder.load_state_dict(drafter.state_dict())  # copies into the captured tensors
        precision = contextlib.nullcontext()
        longest = max((p.input_ids.numel() for p in prompts), default=0)
        engine_session.prepare(full, longest + cfg.data.eval_max_new_tokens, decoder.block_size, decoder)
    tally, per_prompt = Tally(), []
    for prompt in prompts:
        # Decoding runs the (train.compile) compiled layers eagerly: its cache and shapes change every round.
        with torch.no_grad(), precision, torch.compiler.set_stance("force_eager"):
            result = generate(full, decoder, prompt.input_ids.to(s.device), cfg.data.eval_max_new_tokens)
        tally.add(result)
        per_prompt.append(result.tau)
    drafter.train()
    # Tokens per target forward over all prompts' rounds, as `flashdraft eval` counts it: a mean of the prompts' own
    # τ would let one prompt that the target repeats (τ near the block size) outweigh the rest.
    tau = tally.tau
    if json_out is not None:
        json_out.write_text(json.dumps({"tau": tau, "per_prompt": per_prompt}))
    return tau
