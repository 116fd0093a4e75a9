"""How far sampling lets a block-parallel drafter go: τ when every block position is drafted from its exact marginal.

    python tools/parallel_ceiling.py --limit 64 --samples 1024 --json ceiling.json

A DFlash drafter fills a block in one forward and draws each position k from its own distribution q_k, independently
of the other drafts, while the target's distribution at position k depends on the k - 1 tokens before it. At
temperature 0 this costs nothing (the target's greedy continuation is one sequence, and a drafter could draft all of
it), but when sampling, even a drafter whose q_k is exactly the target's marginal P(x_k | context, anchor) sees a
draft rejected whenever the tokens before it were drawn otherwise than the target would have. Training towards the
marginals is what cross-entropy on sampled continuations does, so this is the τ such training can approach.

Per context (a held-out prompt, followed by a continuation of random length, 0 to --context-tokens, that the target
samples itself, so that the contexts spread over a generation the way verification rounds do) and its sampled anchor
token: sample --samples continuations of bs - 1 tokens from the target (the marginals, estimated by their
frequencies), draw as many blocks from those marginals, and verify each with speculative sampling against the
target's exact conditionals. Reported: acceptance at each draft position (the share of blocks whose drafts up to
there were all accepted) and τ = 1 + their sum, the target's own token counted as `flashdraft eval` counts it. With
finitely many samples the estimated marginals are a little off the exact ones, so the figure is slightly low.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="bundled", help="target directory, or 'bundled' (default)")
    p.add_argument("--prompts", type=Path, default=None, help="held-out prompts (default: the package's 64)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--samples", type=int, default=1024, help="continuations per context (and blocks verified)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--context-tokens", type=int, default=112, help="most tokens the target adds to a prompt")
    p.add_argument("--seed", type=int, default=0, help="context i draws from seed + i")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.samples < 1 or a.block_size < 2 or a.temperature <= 0 or a.context_tokens < 0:
        p.error("--samples must be >= 1, --block-size >= 2, --temperature > 0 and --context-tokens >= 0")
    if a.limit is not None and a.limit < 1:
        p.error("--limit must be >= 1")
    return a


class Target:
    """Next-token distributions of a transformers target at one temperature, through its cache."""

    def __init__(self, model: torch.nn.Module, temperature: float):
        from flashdraft import fastpath

        fastpath.ensure(model)  # linear-attention layers on device-aware kernels (the torch chunk on a CPU)
        self.model, self.temperature = model, temperature

    def new_cache(self):
        from flashdraft.speculative import rollback

        return rollback.new_cache(self.model)

    def probs(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Feed `ids` `[B, n]` after what `cache` holds; the distributions after each fed token `[B, n, V]`."""
        from flashdraft.speculative.sampling import sampling_probs
        from flashdraft.versions import cache_kwargs

        logits = self.model(input_ids=ids, use_cache=True, **cache_kwargs(cache)).logits
        return sampling_probs(logits.double(), self.temperature)

    def start(self, context: torch.Tensor, copies: int):
        """A cache holding `context` `[L]` in `copies` rows, and the distribution after it `[copies, V]`."""
        cache = self.new_cache()
        after = self.probs(context[None], cache)[:, -1]
        cache.reorder_cache(torch.zeros(copies, dtype=torch.long, device=context.device))  # 1 row -> copies
        return cache, after.expand(copies, -1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from each row of `probs` `[..., V]` -> `[...]`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def sample_tokens(target: Target, cache, after: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """`n` tokens the target samples in each row after what `cache` holds (`after`: the next distribution)."""
    tokens = [draw(after, generator)]
    for _ in range(n - 1):
        tokens.append(draw(target.probs(tokens[-1][:, None], cache)[:, -1], generator))
    return torch.stack(tokens, dim=1)


def marginal_acceptance(
    target: Target, context: torch.Tensor, samples: int, num_drafts: int, generator: torch.Generator
) -> torch.Tensor:
    """Per draft position, the share of `samples` blocks drawn from the estimated marginals after `context` (which
    ends with the anchor) whose drafts up to that position are all accepted by speculative sampling `[num_drafts]`."""
    sampled = sample_tokens(target, *target.start(context, samples), num_drafts, generator)  # [samples, drafts]
    marginals = torch.zeros(num_drafts, target.model.config.vocab_size, dtype=torch.float64)
    marginals.scatter_add_(1, sampled.T, torch.ones(num_drafts, samples, dtype=torch.float64))
    marginals /= samples
    blocks = draw(marginals[:, None].expand(-1, samples, -1), generator).T  # [samples, num_drafts], independent
    cache, first = target.start(context, samples)
    # The target's distribution for draft k, given the drafts before it: row k - 1 of this forward (k >= 2).
    conditionals = torch.cat([first[:, None], target.probs(blocks[:, :-1], cache)], dim=1)
    p = conditionals.gather(2, blocks[..., None])[..., 0]
    q = marginals.gather(1, blocks.T).T
    u = torch.rand(p.shape, generator=generator, dtype=torch.float64)
    return (u * q < p).long().cumprod(dim=1).double().mean(dim=0)


def sampled_context(target: Target, prompt: torch.Tensor, extra: int, generator: torch.Generator) -> torch.Tensor:
    """The prompt, `extra` tokens the target samples after it, and the anchor it samples next."""
    return torch.cat([prompt, sample_tokens(target, *target.start(prompt, 1), extra + 1, generator)[0]])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress

    from flashdraft import bundled
    from flashdraft.speculative.prompts import load_prompts
    from flashdraft.target import load_causal_lm

    console = Console(stderr=True)
    if a.target == bundled.BUNDLED:
        tokenizer = bundled.load_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.target)
    target = Target(load_causal_lm(a.target, dtype=torch.float32, device="cpu").eval(), a.temperature)
    prompts = load_prompts(a.prompts or bundled.eval_prompts(), tokenizer, limit=a.limit)
    num_drafts = a.block_size - 1
    total = torch.zeros(num_drafts, dtype=torch.float64)
    with torch.inference_mode(), Progress(console=console, transient=True) as progress:
        task = progress.add_task("contexts", total=len(prompts))
        for i, prompt in enumerate(prompts):
            generator = torch.Generator().manual_seed(a.seed + i)
            extra = int(torch.randint(0, a.context_tokens + 1, (1,), generator=generator))
            context = sampled_context(target, prompt.input_ids.view(-1), extra, generator)
            total += marginal_acceptance(target, context, a.samples, num_drafts, generator)
            progress.advance(task)
    acceptance = (total / len(prompts)).tolist()
    tau = 1 + sum(acceptance)
    print(
        f"parallel-drafting ceiling at T={a.temperature:g}, block {a.block_size}, {len(prompts)} contexts, "
        f"{a.samples} samples each: τ {tau:.2f}"
    )
    print("acceptance by draft position: " + " ".join(f"{x:.2f}" for x in acceptance))
    if a.json:
        report = {
            "tau": tau,
            "per_position_acceptance": acceptance,
            "temperature": a.temperature,
            "block_size": a.block_size,
            "num_contexts": len(prompts),
            "samples": a.samples,
            "context_tokens": a.context_tokens,
            "seed": a.seed,
            "target": a.target,
            "prompts": str(a.prompts or "bundled"),
        }
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
