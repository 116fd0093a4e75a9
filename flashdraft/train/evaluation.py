"""How well the drafter drafts, scored the same way at step 0, at every evaluation (`log.eval_every`) and at the
end of a run, on a fixed held-out set: what a run changed is the difference.

    evaluator = Evaluator(cfg, s, out)         # evaluator.enabled: whether the run has held-out prompts
    scores = evaluator.evaluate()              # collective; rank 0 gets the scores, the other ranks None
    scores = evaluator.evaluate(measure=False) # the held-out loss alone (`log.heldout_every`): no decoding

The held-out set is `data.eval_prompts` (the first `data.eval_limit`; `bundled` with the bundled training data
only) and, for the loss, each prompt followed by the target's own greedy continuation of it
(`data.eval_max_new_tokens` tokens). The first evaluation gets those continuations for free: greedy speculative
decoding is lossless, so the decoding that measures τ emits exactly the target's greedy tokens. They are kept in
OUT/heldout.json, so a resumed run scores the same rows. Each evaluation gives:

- `tau`: the measured τ, real greedy speculative decoding of the prompts with the drafter against the full
  (untruncated) target: tokens per target forward over all prompts' rounds, as `flashdraft eval` counts it (a mean of
  the prompts' own τ would let one prompt that the target repeats outweigh the rest); also in OUT/measured_tau.json.
- `heldout_loss`, `heldout_sim_tau`: the training objective (train/forward.py) on the held-out rows and the
  simulated τ of its per-position accuracies (1 + Σ_k Π_{j≤k} acc_j), over fixed blocks: anchored at every position
  whose next token is a continuation token (the first is the prompt's last token, where decoding starts), at most
  `recipe.num_anchors` per row spread evenly, none revealed. No randomness: the same blocks every time. The target's
  context features come from the full target's hidden states, so the set is scored alike online, offline
  (`data.features`) and with a sharded target; loss and τ are thus about the same text.
- `heldout_prompts`: how many prompts.

Under torchrun every rank gathers the (sharded) drafter and rank 0 alone scores it while the others wait for it
in a barrier through the job's store (not in a collective, whose timeout is train.collective_timeout_s). On a GPU the decoding engine runs from CUDA graphs captured once per run:
it is sized for the longest prompt at the first evaluation, and the bf16 copy of the drafter it decodes with is
refreshed in place (same tensors, new values) at each one, so every later evaluation replays the same graphs.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from flashdraft import bundled
from flashdraft.config import RunConfig
from flashdraft.devices import autocast
from flashdraft.distributed import ranks
from flashdraft.distributed.data_parallel import gather_drafter
from flashdraft.drafter import DFlashDraftModel, select_context_features
from flashdraft.io.atomic import atomic_write_text
from flashdraft.speculative.engine import session as engine_session
from flashdraft.speculative.generate import generate, use_engine
from flashdraft.speculative.prompts import load_prompts
from flashdraft.speculative.tally import Tally
from flashdraft.target import load_causal_lm
from flashdraft.train.blocks import build_blocks
from flashdraft.train.dataloader import MicroBatch, collate
from flashdraft.train.forward import Drafting
from flashdraft.train.setup import Setup

logger = logging.getLogger(__name__)

HELDOUT = "heldout.json"
MEASURED_TAU = "measured_tau.json"


def eval_prompts_path(cfg: RunConfig) -> str | None:
    """The held-out prompts of `cfg`: data.eval_prompts (`bundled`: the bundled prompts, with the bundled training
    data only); None: the run has none."""
    if cfg.data.eval_prompts == bundled.BUNDLED:
        return str(bundled.eval_prompts()) if cfg.data.train == [bundled.BUNDLED] else None
    return cfg.data.eval_prompts


class Evaluator:
    """Scores the drafter on the held-out set (the module docstring says how). It owns what that takes beside the
    run's Setup: the prompts, the held-out rows, the full target and the drafter's copy the decoding engine runs."""

    def __init__(self, cfg: RunConfig, s: Setup, out: Path) -> None:
        self.cfg, self.s, self.out = cfg, s, Path(out)
        self.path = eval_prompts_path(cfg)
        self.prompts = None  # loaded at the first evaluation, as the full target and the rows
        self.rows: list[tuple[list[int], list[int]]] | None = None  # (prompt, continuation) token ids
        self.full_target = None
        self.decoder: DFlashDraftModel | None = None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def evaluate(self, measure: bool = True) -> dict | None:
        """{"heldout_loss", "heldout_sim_tau", "tau", "heldout_prompts"} of the drafter as it is now, on rank 0
        (`measure=False`: without "tau", when the held-out rows exist already); None on the other ranks and without
        held-out prompts. Collective under torchrun: every rank calls it, and the others wait for rank 0 through the
        job's store (no collective timeout: decoding may take minutes)."""
        if not self.enabled:
            return None
        drafter = gather_drafter(self.s.drafter)
        scores = self._score(drafter, measure) if drafter is not None else None
        ranks.barrier()
        return scores

    def _score(self, drafter: DFlashDraftModel, measure: bool) -> dict:
        self._load()
        drafter.eval()
        tau = None
        try:
            if measure or self.rows is None:  # the rows' continuations come from the first decoding
                tau, continuations = self.measure_tau(drafter)
            if self.rows is None:
                self.rows = [
                    (p.input_ids.reshape(-1).tolist(), c) for p, c in zip(self.prompts, continuations, strict=True)
                ]
                self._save_rows()
            stats = self.heldout_stats(drafter)
        finally:
            drafter.train()
        loss = float(stats.loss_sum / stats.weight_sum.clamp(min=1e-12))
        scores = {"heldout_loss": loss, "heldout_sim_tau": float(stats.tau()), "heldout_prompts": len(self.rows)}
        return scores | ({"tau": tau} if tau is not None else {})

    # ---- measured τ ------------------------------------------------------------------------------------------

    def measure_tau(self, drafter: DFlashDraftModel) -> tuple[float, list[list[int]]]:
        """(τ of greedy speculative decoding of the prompts with `drafter`, each prompt's continuation); writes
        OUT/measured_tau.json."""
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
        tally, per_prompt, continuations = Tally(), [], []
        for prompt in self.prompts:
            # Decoding runs the (train.compile) compiled layers eagerly: its cache and shapes change every round.
            with torch.no_grad(), precision, torch.compiler.set_stance("force_eager"):
                result = generate(full, decoder, prompt.input_ids.to(s.device), cfg.data.eval_max_new_tokens)
            tally.add(result)
            per_prompt.append(result.tau)
            continuations.append([int(t) for t in result.tokens])
        atomic_write_text(self.out / MEASURED_TAU, json.dumps({"tau": tally.tau, "per_prompt": per_prompt}))
        return tally.tau, continuations

    # ---- held-out loss ---------------------------------------------------------------------------------------

    def heldout_stats(self, drafter: DFlashDraftModel):
        """The LossStats of the training objective on the held-out rows, summed over them."""
        drafting = Drafting.of(self.cfg, self.s).eager(_FullTargetFeatures(self.full_target, self.s.target), drafter)
        b = self.cfg.train.batch_size
        batch = [self._micro_batch(self.rows[i : i + b], drafter) for i in range(0, len(self.rows), b)]
        denominator = drafting.normaliser(batch).clamp(min=1e-6)
        total = None
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for micro in batch:
                _, stats = drafting.loss(micro, denominator)
                total = stats if total is None else total + stats
        return total

    def _micro_batch(self, rows: list[tuple[list[int], list[int]]], drafter) -> MicroBatch:
        samples = [(prompt + cont, [0] * len(prompt) + [1] * len(cont)) for prompt, cont in rows]
        ids, mask, attn = collate(samples)
        anchors = [heldout_anchors(len(p), len(p) + len(c), self.cfg.recipe.num_anchors) for p, c in rows]
        device = self.s.device
        ids, mask, attn = ids.to(device), mask.to(device), attn.to(device)
        blocks = build_blocks(
            ids,
            mask,
            anchors,
            drafter.block_size,
            drafter.mask_token_id,
            self.cfg.recipe.gamma,
            offset=drafter.draft_offset,
        )
        return MicroBatch(ids, attn, blocks, [], int(attn.sum()))

    # ---- what it loads ---------------------------------------------------------------------------------------

    def _load(self) -> None:
        s, cfg = self.s, self.cfg
        if self.prompts is None:
            self.prompts = load_prompts(self.path, s.tokenizer, cfg.data.eval_limit)
            self.rows = self._saved_rows()
        if self.full_target is None:
            self.full_target = load_causal_lm(
                cfg.target.path, dtype=s.target.dtype, device=s.device, trust_remote_code=cfg.target.trust_remote_code
            )

    def _key(self) -> dict:
        return {
            "eval_prompts": self.path,
            "max_new_tokens": self.cfg.data.eval_max_new_tokens,
            "prompts": [p.input_ids.reshape(-1).tolist() for p in self.prompts],
        }

    def _saved_rows(self) -> list[tuple[list[int], list[int]]] | None:
        """The rows of OUT/heldout.json when they are this run's prompts and length; None otherwise (the next
        evaluation decodes them anew)."""
        path = self.out / HELDOUT
        try:
            saved = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("%s is unreadable (%s): the held-out rows are decoded again", path, exc)
            return None
        if {k: saved.get(k) for k in self._key()} != self._key():
            logger.warning(
                "%s holds other prompts or lengths than this run's: the held-out rows are decoded again", path
            )
            return None
        return [(prompt, cont) for prompt, cont in zip(saved["prompts"], saved["continuations"], strict=True)]

    def _save_rows(self) -> None:
        continuations = [cont for _, cont in self.rows]
        atomic_write_text(self.out / HELDOUT, json.dumps({**self._key(), "continuations": continuations}))


def heldout_anchors(prompt_length: int, length: int, most: int) -> torch.Tensor:
    """The fixed anchors of a held-out row of `length` tokens whose continuation starts at `prompt_length`: every
    position whose next token is a continuation token, from the prompt's last one; at most `most` of them, evenly
    spread over the row from its first to its last."""
    candidates = torch.arange(max(prompt_length - 1, 0), length - 1)
    if candidates.numel() <= most:
        return candidates
    return candidates[torch.linspace(0, candidates.numel() - 1, most).round().long()].unique()


class _FullTargetFeatures:
    """The context features (and final hidden states) of the training target's captured layers, from the full
    target's `output_hidden_states`; the embedding and LM head of the training target (`head`)."""

    def __init__(self, full, head) -> None:
        self.full, self.head = full, head
        self.layer_ids = list(head.target_layer_ids)

    def capture(self, input_ids: torch.Tensor, attention_mask=None, *, final: bool = False):
        # Without the mask, as the training target runs: the layers are causal, no token reads the padding after it.
        states = self.full(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states
        features = select_context_features(states, self.layer_ids)
        return (features, states[-1]) if final else features

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.head.lm_head_weight
