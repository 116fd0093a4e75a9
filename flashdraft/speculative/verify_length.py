"""How many of a round's drafts to verify, from the drafter's predicted acceptance and what a round costs here.

    cost = RoundCost.measure(target, proposer, widths=range(1, 18))     # this device, before decoding
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

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

VERIFY_LENGTHS = ("full", "confidence")


@dataclass(frozen=True)
class RoundCost:
    """Seconds of one round on this device: `draft_s` (a proposal) + `verify_s[w]`, a target forward over w tokens
    (w ≥ 1; widths past the table grow as its last step)."""

    draft_s: float
    verify_s: tuple[float, ...]  # verify_s[w - 1]: w fed tokens

    def round_s(self, width: int) -> float:
        table = self.verify_s
        if width <= len(table):
            return self.draft_s + table[width - 1]
        step = table[-1] - table[-2] if len(table) > 1 else table[-1]
        return self.draft_s + table[-1] + step * (width - len(table))

    @classmethod
    @torch.inference_mode()
    def measure(cls, target: torch.nn.Module, draft, widths: Sequence[int], repeats: int = 3) -> RoundCost:
        """Time `draft()` (one proposal) and a target forward over each of 1 … max(widths) tokens, the best of
        `repeats` after one warm-up each; on random tokens without a cache (verification's context adds the same
        to every width)."""
        device = next(target.parameters()).device
        vocab = target.get_output_embeddings().weight.shape[0]
        ids = torch.randint(0, vocab, (1, max(widths)), generator=torch.Generator().manual_seed(0)).to(device)

        def best(run) -> float:
            run()
            times = []
            for _ in range(repeats):
                start = _clock(device)
                run()
                times.append(_clock(device) - start)
            return min(times)

        verify = [best(lambda w=w: target(input_ids=ids[:, :w], use_cache=False)) for w in range(1, max(widths) + 1)]
        # A forward's time does not fall as tokens are added: a smaller reading is noise.
        for w in range(1, len(verify)):
            verify[w] = max(verify[w], verify[w - 1])
        return cls(draft_s=best(draft), verify_s=tuple(verify))


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


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
