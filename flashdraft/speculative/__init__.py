"""Speculative decoding: DFlash generation, exact cache rollback, baselines (the target's own MTP layer among
them) and the `flashdraft eval` harness.

from flashdraft.speculative import generate, autoregressive_generate, mtp_generate, prompt_lookup_generate
result = generate(target, drafter, input_ids, max_new_tokens=256)
print(result.tau, result.tokens_per_second)
"""

from flashdraft.speculative.baselines import (
    MTPProposer,
    PromptLookupProposer,
    autoregressive_generate,
    mtp_generate,
    prompt_lookup_generate,
)
from flashdraft.speculative.generate import generate, speculative_decode
from flashdraft.speculative.proposer import DFlashProposer
from flashdraft.speculative.result import GenerationResult
from flashdraft.speculative.sampling import rejection_sample, sampling_probs

__all__ = [
    "DFlashProposer",
    "GenerationResult",
    "MTPProposer",
    "PromptLookupProposer",
    "autoregressive_generate",
    "generate",
    "mtp_generate",
    "prompt_lookup_generate",
    "rejection_sample",
    "sampling_probs",
    "speculative_decode",
]
