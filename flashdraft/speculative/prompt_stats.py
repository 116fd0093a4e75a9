"""Where `flashdraft eval`'s time goes prompt by prompt, and how well a confidence head predicts acceptance.

    rows = [prompt_row(i, prompt.category, "dflash", result), ...]     # one per prompt and method
    slow = slow_prompts(rows)                                          # steady rounds > 2 x the method's median
    calibration = Calibration(); calibration.add(result); calibration.table()

A prompt's time is split into its prefill (time to the first token), its first round (which may pay for one-off
work: a kernel's autotuning, a cache's first growth) and its steady rounds (the median of the rounds after the
first, `GenerationResult.round_times`: one clock read per round, where the loop reads the round's tokens anyway).
A prompt whose steady rounds are much slower than the other prompts' was decoded differently, not just longer:
graphs captured again for it, a fallback to the plain loop, a host synchronisation per token, a cache that grows.
"""

from __future__ import annotations

import math
import statistics

from flashdraft.speculative.result import GenerationResult

# A prompt is slow when its steady round time exceeds this many times the median over its method's prompts.
SLOW_FACTOR = 2.0
SLOW_HINT = (
    "a steady round much slower than the other prompts' points at how the prompt was decoded, not at its length: "
    "CUDA graphs captured again (an engine rebuilt for it), a fallback to the plain loop (see the backend), a host "
    "synchronisation per token, or a cache that grows with every round"
)


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def prompt_row(
    index: int, category: str, method: str, result: GenerationResult, context_length: int | None = None
) -> dict:
    """One prompt decoded by one method: its size, its time per phase (milliseconds), its rounds and tau."""
    row = {
        "prompt": index,
        "method": method,
        "category": category,
        "prompt_tokens": result.num_prompt_tokens,
        "new_tokens": len(result.tokens),
        "prefill_ms": _ms(result.time_to_first_token),
        "first_round_ms": _ms(result.first_round_time),
        "steady_round_ms": _ms(result.steady_round_time),
        "rounds": result.num_rounds,
        "tau": result.tau,
        "backend": result.backend,
    }
    if context_length is not None:
        row["context_length"] = context_length
    return row


def slow_prompts(rows: list[dict], factor: float = SLOW_FACTOR) -> list[dict]:
    """The rows whose steady round time exceeds `factor` x the median of their method's rows (rows without a
    steady round, fewer than two rounds, neither count nor are flagged), each with `median_steady_round_ms` and
    `times_median` added; slowest first."""
    by_method: dict[str, list[dict]] = {}
    for row in rows:
        if not math.isnan(row["steady_round_ms"]):
            by_method.setdefault(row["method"], []).append(row)
    flagged = []
    for method_rows in by_method.values():
        median = statistics.median(r["steady_round_ms"] for r in method_rows)
        for row in method_rows:
            if median > 0 and row["steady_round_ms"] > factor * median:
                ratio = row["steady_round_ms"] / median
                flagged.append({**row, "median_steady_round_ms": median, "times_median": ratio})
    return sorted(flagged, key=lambda r: -r["times_median"])


class Calibration:
    """A confidence head's predictions (`GenerationResult.confidences`) against what verification accepted.

    Position k of a round is *reached* when every draft before it was accepted. Per position: the mean predicted
    c_k over the rounds that reached it against the fraction of them that accepted it; and the mean predicted
    survival prod_{j<=k} c_j over the rounds that drafted it against the fraction of them that accepted drafts
    1 .. k. Counts come from the verification itself (`drafts_accepted`), before any cut at a stop token."""

    def __init__(self):
        self.reached: list[int] = []
        self.accepted: list[int] = []
        self.predicted: list[float] = []
        self.offered: list[int] = []
        self.predicted_survival: list[float] = []

    def add(self, result: GenerationResult) -> None:
        """The rounds of `result`; nothing from a drafter without a confidence head (no predictions)."""
        if not result.confidences:
            return
        for confidence, accepted in zip(result.confidences, result.drafts_accepted, strict=True):
            survival = 1.0
            for k, c in enumerate(confidence):
                if k == len(self.offered):
                    for column in (self.reached, self.accepted, self.offered):
                        column.append(0)
                    self.predicted.append(0.0)
                    self.predicted_survival.append(0.0)
                survival *= c
                self.offered[k] += 1
                self.predicted_survival[k] += survival
                if accepted >= k:  # every draft before this one accepted: position k + 1 reached
                    self.reached[k] += 1
                    self.accepted[k] += accepted > k
                    self.predicted[k] += c

    def table(self) -> list[dict]:
        """Per draft position (1-based): predicted, observed, rounds (that reached it); predicted_survival,
        observed_survival, survival_rounds (that drafted it). NaN where no round counts."""

        def ratio(a: float, b: int) -> float:
            return a / b if b else math.nan

        # A round that accepted draft k accepted every draft before it: its survival count is accepted[k].
        return [
            {
                "position": k + 1,
                "predicted": ratio(self.predicted[k], self.reached[k]),
                "observed": ratio(self.accepted[k], self.reached[k]),
                "rounds": self.reached[k],
                "predicted_survival": ratio(self.predicted_survival[k], self.offered[k]),
                "observed_survival": ratio(self.accepted[k], self.offered[k]),
                "survival_rounds": self.offered[k],
            }
            for k in range(len(self.offered))
        ]
