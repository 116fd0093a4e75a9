"""What one decoding run returns, whichever loop decoded it (`generate`'s plain loop or the engine)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    """New tokens and the statistics of one decoding run."""

    tokens: list[int]
    # Per verification round: tokens emitted (accepted drafts + the target's own token; cut at a stop token).
    acceptance_lengths: list[int] = field(default_factory=list)
    # position_accepted[i]: rounds in which draft i + 1 of the block was accepted; position_offered[i]: rounds
    # in which it was drafted and verified (the last rounds may offer fewer than bs - 1 drafts).
    position_accepted: list[int] = field(default_factory=list)
    position_offered: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # Target forwards: prefill + one per round + the rare commit of a long deferred run (see `max_deferred`).
    num_target_forwards: int = 0
    time_to_first_token: float = 0.0
    total_time: float = 0.0
    # Per round: wall seconds from the end of the previous round (the first token, for the first) to the host
    # holding this round's tokens. Both loops read each round's result on the host once (the round's one
    # synchronisation), so a clock read there costs nothing and times the device work too; work enqueued after
    # that read (a cache rollback, the commit of a deferred run) counts in the next round. Their sum is the decode
    # time, `total_time - time_to_first_token`, up to the last round's trailing work.
    round_times: list[float] = field(default_factory=list)
    # Per round: drafts the target accepted, before any cut at a stop token (0 in a round without drafts).
    drafts_accepted: list[int] = field(default_factory=list)
    # Per round, for a drafter with a confidence head (DSpark's; empty otherwise): its predicted acceptance
    # c_k = sigmoid(confidence logit) of each verified draft k, given the drafts before it. Only reported:
    # verification does not read it.
    confidences: list[list[float]] = field(default_factory=list)
    stopped: bool = False
    # What decoded: "plain" (transformers forwards, this module), "engine" or "engine+graphs" (flashdraft.speculative.engine).
    backend: str = "plain"

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification round (NaN when no round ran)."""
        return sum(self.acceptance_lengths) / self.num_rounds if self.num_rounds else float("nan")

    @property
    def time_per_output_token(self) -> float:
        """Decode time (after the first token) per further token; 0.0 with fewer than two tokens."""
        if len(self.tokens) < 2:
            return 0.0
        return (self.total_time - self.time_to_first_token) / (len(self.tokens) - 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.total_time if self.total_time > 0 else 0.0

    @property
    def first_round_time(self) -> float:
        """Seconds of the first round (NaN when no round ran): it may pay for one-off work the others do not."""
        return self.round_times[0] if self.round_times else float("nan")

    @property
    def steady_round_time(self) -> float:
        """Median seconds per round after the first (NaN with fewer than two rounds)."""
        return statistics.median(self.round_times[1:]) if len(self.round_times) > 1 else float("nan")

    @property
    def position_acceptance_rate(self) -> list[float]:
        return [
            a / o if o else float("nan") for a, o in zip(self.position_accepted, self.position_offered, strict=True)
        ]
