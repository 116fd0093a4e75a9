"""How many of a round's drafts to verify, from the drafter's predicted acceptance and what a round costs here.

    cost = RoundCost.measure(target, proposer.rehearse, widths=range(1, 18))   # this device, before decoding
    rule = ConfidenceLength(cost)
    n = rule.drafts(confidence, fed_before=1)                            # verify drafts[:n]

A confidence head (DSpark's) predicts c_j, the chance that draft j is accepted once the drafts before it are. The
chance that a round gets past draft j is then P_j = Π_{i≤j} c_i, and a round that verifies n drafts emits
E_n = 1 + Σ_{j≤n} P_j tokens in expectation (the last one the target's own). Its time is the drafting, which does not
depend on n (the whole block is drafted in one pass), plus a target forward over the fed tokens: on a CPU that
grows with every token, on a GPU hardly at all until the forward stops being memory-bound. Verifying draft j pays
when it raises the round's rate E/T.

The rule decides on draft j from c_1 … c_j alone, and c_j is computed from the draft before j, never from draft j
itself: the number verified is a stopping time of the drafts, which keeps sampled decoding exact under token and
block verification both (tests/speculative/test_sampling.py enumerates it; a rule that looks at draft j is not
exact). Greedy output is the target's whatever the rule verifies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashdraft.telemetry.timer import synchronize

VERIFY_LENGTHS = ("full", "confidence")


@dataclass(frozen=True)
class RoundCost:
    """Seconds of one round on this device: `draft_s` (a proposal) + a target forward over w fed tokens,
    `verify_fixed_s + verify_token_s * w`."""

    draft_s: float
    verify_fixed_s: float
    verify_token_s: float

    def round_s(self, width: int) -> float:
        return self.draft_s + self.verify_fixed_s + self.verify_token_s * width

    @classmethod
    @torch.inference_mode()
    def measure(cls, target: torch.nn.Module, draft, widths: Sequence[int], repeats: int = 5) -> RoundCost:
        """Time `draft()` (one proposal) and a target forward over each of `widths` tokens (random tokens, no cache:
        verification's context adds the same to every width), the best of `repeats` sweeps over the widths after a
        warm-up sweep; interleaved, so that a slow spell of the machine does not fall on a few widths alone. The
        forward's cost is the least-squares line through them: single readings are noisy, and a table's flat
        stretches would make every draft on them look free."""
        device = next(target.parameters()).device
        vocab = target.get_output_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (1, max(widths)), generator=torch.Generator().manual_seed(0)).to(device)
        runs = [draft, *[lambda w=w: target(input_ids=ids[:, :w], use_cache=False) for w in widths]]
        best = [math.inf] * len(runs)
        for sweep in range(1 + repeats):
            for i, run in enumerate(runs):
                synchronize(device)
                start = time.perf_counter()
                run()
                synchronize(device)
                if sweep:  # the first sweep warms up
                    best[i] = min(best[i], time.perf_counter() - start)
        fixed, per_token = _line([float(w) for w in widths], best[1:])
        return cls(draft_s=best[0], verify_fixed_s=fixed, verify_token_s=per_token)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope ≥ 0) of the least-squares line through (xs, ys): a forward does not get cheaper with more
    tokens, so a falling fit is noise and is read as flat."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return mean_y - slope * mean_x, slope


class ConfidenceLength:
    """Verify draft j while it raises the round's expected tokens per second (module docstring); at least one."""

    def __init__(self, cost: RoundCost):
        self.cost = cost

    def drafts(self, confidence: Sequence[float], fed_before: int) -> int:
        """How many of the drafts with predicted acceptance `confidence` to verify, when the verification also feeds
        `fed_before` tokens ahead of them (the anchor, and a hybrid target's deferred tokens)."""
        if not confidence:
            return 0
        survive = float(confidence[0])
        expected, count = 1.0 + survive, 1
        rate = expected / self.cost.round_s(fed_before + 1)
        for c in confidence[1:]:
            survive *= float(c)
            longer = (expected + survive) / self.cost.round_s(fed_before + count + 1)
            if longer <= rate:
                break
            expected, rate, count = expected + survive, longer, count + 1
        return count


def validate_verify_length(value: str) -> None:
    if value not in VERIFY_LENGTHS:
        raise ValueError(f"verify_length must be one of {', '.join(VERIFY_LENGTHS)}, got {value!r}")
