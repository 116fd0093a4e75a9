"""Speculative decoding: DFlash generation, exact cache rollback, baselines and the `flashdraft eval` harness.

from flashdraft.speculative import generate, autoregressive_generate, prompt_lookup_generate
result = generate(target, drafter, input_ids, max_new_tokens=256)
print(result.tau, result.tokens_per_second)
"""

from flashdraft.speculative.baselines import PromptLookupProposer, autoregressive_generate, prompt_lookup_generate
from flashdraft.speculative.generate import DFlashProposer, generate, speculative_decode
from flashdraft.speculative.result import GenerationResult
from flashdraft.speculative.sampling import rejection_sample, sampling_probs

__all__ = [
    "DFlashProposer",
    "GenerationResult",
    "PromptLookupProposer",
    "autoregressive_generate",
    "generate",
    "prompt_lookup_generate",
    "rejection_sample",
    "sampling_probs",
    "speculative_decode",
]
