"""The generations of one decoding method, summed: τ, tokens per second, round times, acceptance by position."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from flashdraft.speculative.result import GenerationResult


@dataclass
class Tally:
    """The generations of one method, and the sums and means over them."""

    results: list[GenerationResult] = field(default_factory=list)

    def add(self, result: GenerationResult) -> None:
        self.results.append(result)

    def _sum(self, value) -> float:
        return sum(value(r) for r in self.results)

    @property
    def tokens(self) -> int:
        return self._sum(lambda r: len(r.tokens))

    @property
    def seconds(self) -> float:
        return self._sum(lambda r: r.total_time)

    @property
    def rounds(self) -> int:
        """Verification rounds (decode steps for autoregressive decoding)."""
        return self._sum(lambda r: r.num_rounds)

    @property
    def decode_seconds(self) -> float:
        """Seconds after the first token (prefill excluded)."""
        return self._sum(lambda r: r.total_time - r.time_to_first_token)

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first (decoded by rounds)."""
        return self._sum(lambda r: max(len(r.tokens) - 1, 0))

    @property
    def acceptance_lengths(self) -> list[int]:
        return [n for r in self.results for n in r.acceptance_lengths]

    def _per_position(self, name: str) -> list[int]:
        total: list[int] = []
        for r in self.results:
            counts = getattr(r, name)
            total.extend([0] * (len(counts) - len(total)))
            for i, value in enumerate(counts):
                total[i] += value
        return total

    @property
    def position_accepted(self) -> list[int]:
        return self._per_position("position_accepted")

    @property
    def position_offered(self) -> list[int]:
        return self._per_position("position_offered")

    @property
    def drafts_verified(self) -> float:
        """Drafts the target verified per round, on average (fewer than drafted with `verify_length`)."""
        return sum(self.position_offered) / self.rounds if self.rounds else math.nan

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the decode phase: after the first token, prefill excluded."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else math.nan

    @property
    def prefill_ms(self) -> float:
        """Mean milliseconds to the first token."""
        prefills = [r.time_to_first_token for r in self.results]
        return 1e3 * statistics.fmean(prefills) if prefills else math.nan

    @property
    def first_round_ms(self) -> float:
        firsts = [r.first_round_time for r in self.results if r.num_rounds]
        return 1e3 * statistics.fmean(firsts) if firsts else math.nan

    @property
    def steady_round_ms(self) -> float:
        """The median over generations of each one's steady round time (the median of its rounds after the first)."""
        steady = [r.steady_round_time for r in self.results if r.num_rounds > 1]
        return 1e3 * statistics.median(steady) if steady else math.nan

    @property
    def round_ms(self) -> float:
        """Mean milliseconds per round (per decode step for autoregressive decoding)."""
        return 1e3 * self.decode_seconds / self.rounds if self.rounds else math.nan

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else math.nan

    @property
    def p95(self) -> float:
        if not self.acceptance_lengths:
            return math.nan
        return float(torch.quantile(torch.tensor(self.acceptance_lengths, dtype=torch.float64), 0.95))

    @property
    def position_acceptance(self) -> list[float]:
        return [a / o if o else math.nan for a, o in zip(self.position_accepted, self.position_offered, strict=True)]


__all__ = ["Tally"]
