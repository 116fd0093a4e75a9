"""Lossless speculative decoding with a DFlash drafter, batch 1.

    from flashdraft.speculative import generate
    result = generate(target, drafter, input_ids, max_new_tokens=256)          # greedy: the target's own output
    result = generate(target, drafter, input_ids, 256, temperature=0.7)        # sampled: the target's distribution
    print(result.tau, result.tokens_per_second)

One round: the block `[last token, MASK x (bs - 1)]` goes through the drafter once; the target verifies the
drafts in one forward; the longest acceptable prefix plus one target token are emitted. The target's cache is
rolled back exactly (`flashdraft.speculative.rollback`): a plain attention cache is cropped to the accepted prefix; a
hybrid (Gated DeltaNet) cache is restored to its pre-verification snapshot and the accepted tokens are fed again
at the front of the *next* verification — its states then advance over exactly the accepted tokens, inside a
forward that happens anyway. The drafter's context features of those tokens come from the verification itself
(the target is causal, so they are already exact).

Deferred tokens accumulate while rounds keep ending in a rejection (each restore goes back to before all of
them), so a verification is `deferred + bs` tokens wide. On a GPU the extra width is nearly free while the forward
stays memory-bound (reading the weights, not computing on the tokens, sets its time), which holds for a few times
the block at batch 1; past `max_deferred` (default 4 x bs) one forward of their own commits them.

Invariants of the loop (n = number of tokens so far, prompt included):
- the target's cache holds tokens [0, committed); tokens [committed, n) are fed by the next verification;
- the drafter has context features of tokens [0, n - 1): every token but the last has been through the target.

The same loop runs the baselines (`flashdraft.speculative.baselines`): autoregressive decoding proposes nothing,
prompt lookup proposes n-gram continuations.
"""

from __future__ import annotations

import time

import torch

from flashdraft import fastpath
from flashdraft.drafter import select_context_features
from flashdraft.speculative import rollback
from flashdraft.speculative.engine import session as engine_session
from flashdraft.speculative.proposer import DFlashProposer, Proposer, validate_refine
from flashdraft.speculative.result import GenerationResult
from flashdraft.speculative.sampling import (
    next_token,
    rejection_sample,
    sampling_probs,
    validate_request,
    validate_verify,
)
from flashdraft.speculative.verify_length import ConfidenceLength, RoundCost, validate_verify_length
from flashdraft.versions import cache_kwargs


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _features(output, layers: list[int], start: int, stop: int) -> torch.Tensor:
    """Context features of the fed tokens [start, stop) of a target forward."""
    return select_context_features([h[:, start:stop] for h in output.hidden_states], layers)


@torch.inference_mode()
def speculative_decode(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    proposer: Proposer | None,
    max_new_tokens: int,
    num_drafts: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    max_deferred: int | None = None,
    verify: str = "block",
    verify_length: ConfidenceLength | None = None,
) -> GenerationResult:
    """The verification loop shared by DFlash, prompt lookup (`proposer`) and autoregressive decoding (None).

    num_drafts: most drafts per round (bs - 1). verify: how sampled drafts are verified, block or token
    (`flashdraft.speculative.sampling`). max_deferred: most accepted tokens a hybrid cache may leave to
    the next verification (default 4 x (num_drafts + 1)); beyond it they are committed by a forward of their
    own, so a long run of partial acceptances cannot make verifications ever wider. verify_length: verify only as
    many of each round's drafts as it says from the proposer's `confidence` (`flashdraft.speculative.verify_length`);
    None: all of them.
    """
    validate_request(input_ids, max_new_tokens, temperature, top_p, top_k)
    validate_verify(verify)
    fastpath.ensure(target)  # a user's hybrid target runs its linear-attention layers with device-aware kernels
    device = next(target.parameters()).device
    prompt = input_ids.reshape(-1).to(device)
    result = GenerationResult(tokens=[], num_prompt_tokens=prompt.shape[0])
    if max_new_tokens == 0:
        return result
    max_deferred = 4 * (num_drafts + 1) if max_deferred is None else max_deferred
    stops = set(stop_token_ids or ())
    layers = proposer.feature_layers if proposer is not None else None
    result.position_accepted, result.position_offered = [0] * num_drafts, [0] * num_drafts

    def forward(ids: torch.Tensor, keep_logits: int, features: bool = True):
        result.num_target_forwards += 1
        return target(
            input_ids=ids[None],
            **cache_kwargs(cache),
            use_cache=True,
            logits_to_keep=keep_logits,
            output_hidden_states=features and layers is not None,
        )

    start = _now(device)
    cache = rollback.new_cache(target)
    out = forward(prompt, 1)
    # A buffer for prompt + output; `n` tokens of it are valid.
    seq = torch.empty(prompt.shape[0] + max_new_tokens, dtype=torch.long, device=device)
    seq[: prompt.shape[0]] = prompt
    first = int(next_token(out.logits[0, -1], temperature, top_p, top_k, generator))
    seq[prompt.shape[0]] = first
    n, committed = prompt.shape[0] + 1, prompt.shape[0]
    result.tokens.append(first)
    if layers is not None:
        proposer.observe(_features(out, layers, 0, prompt.shape[0]))
    tick = _now(device)
    result.time_to_first_token = tick - start
    result.stopped = first in stops
    snapshot = None
    predicts = getattr(proposer, "predicts_acceptance", False)

    while len(result.tokens) < max_new_tokens and not result.stopped:
        want = min(num_drafts, max_new_tokens - len(result.tokens) - 1)
        drafts, draft_probs = (None, None)
        if proposer is not None and want > 0:
            drafts, draft_probs = proposer.propose(seq[:n], want)
            if verify_length is not None and drafts is not None:
                keep = verify_length.drafts(proposer.confidence.tolist(), fed_before=n - committed)
                drafts, draft_probs = drafts[:keep], None if draft_probs is None else draft_probs[:keep]
        k = 0 if drafts is None else drafts.shape[0]
        fed = seq[committed:n] if k == 0 else torch.cat([seq[committed:n], drafts.to(device)])
        deferred = n - 1 - committed
        if k > 0:
            snapshot = rollback.take_snapshot(cache, reuse=snapshot)
        out = forward(fed, k + 1)
        logits = out.logits[0]
        draft_list = [] if k == 0 else drafts.tolist()
        if temperature <= 0:
            choice = logits.argmax(dim=-1).tolist()  # the one host sync of a greedy round
            accepted = next((i for i in range(k) if draft_list[i] != choice[i]), k)
            bonus = choice[accepted]
        else:
            target_probs = sampling_probs(logits, temperature, top_p, top_k)
            accepted, bonus = rejection_sample(drafts if k else seq[:0], draft_probs, target_probs, generator, verify)
        if predicts:  # read now, before more work is enqueued behind it
            result.confidences.append(proposer.confidence[:k].tolist() if k else [])
        result.drafts_accepted.append(accepted)
        for i in range(k):
            result.position_offered[i] += 1
            result.position_accepted[i] += i < accepted
        if layers is not None:
            proposer.observe(_features(out, layers, deferred, deferred + accepted + 1))
        if k > 0:
            committed += rollback.rollback(cache, snapshot, keep=deferred + 1 + accepted, appended=fed.shape[0])
        else:
            committed = n

        new = draft_list[:accepted] + [bonus]
        for j, token in enumerate(new):
            if token in stops:
                new, result.stopped = new[: j + 1], True
                break
        seq[n : n + len(new)] = torch.tensor(new, dtype=torch.long, device=device)
        n += len(new)
        result.tokens.extend(new)
        result.acceptance_lengths.append(len(new))

        if n - 1 - committed > max_deferred and not result.stopped and len(result.tokens) < max_new_tokens:
            forward(seq[committed : n - 1], 1, features=False)
            committed = n - 1
        # The round's tokens were read on the host above (its synchronisation): the clock needs no other.
        now = time.perf_counter()
        result.round_times.append(now - tick)
        tick = now
    result.total_time = _now(device) - start
    return result


def use_engine(
    target: torch.nn.Module,
    engine: bool | None,
    drafter: torch.nn.Module | None = None,
    refine: tuple[int, ...] = (),
    temperature: float = 0.0,
    verify_length: str = "full",
) -> bool:
    """Whether to decode with `flashdraft.speculative.engine`: None (auto) = on a CUDA target the engine supports;
    True = always (a ValueError says why it cannot); False = never (this module's plain loop).

    The engine computes in the models' own dtypes (static caches, no autocast), so a `drafter` whose dtype is not
    the target's (float32 master weights beside a bf16 target, during training) takes the plain loop, and so
    does sampling (`temperature` > 0) with drafts made in several passes (`refine`): the engine refines greedily.
    The engine verifies every draft of a block: `verify_length` "confidence" takes the plain loop."""
    if engine is False or (engine is None and next(target.parameters()).device.type != "cuda"):
        return False
    reason = engine_session.engine_available(target)
    if reason is None and refine and temperature > 0:
        reason = "the engine drafts in passes only greedily (refine when sampling needs the plain loop)"
    if reason is None and verify_length != "full":
        reason = "the engine verifies every draft of a block (verify_length=confidence runs in the plain loop)"
    if reason is None and drafter is not None:
        target_dtype, drafter_dtype = next(target.parameters()).dtype, next(drafter.parameters()).dtype
        if drafter_dtype != target_dtype:
            reason = (
                f"the drafter is {drafter_dtype} and the target {target_dtype} (cast the drafter to the target's dtype)"
            )
    if engine is None:
        return reason is None
    if reason is not None:
        raise ValueError(f"engine=True, but the engine cannot run this target: {reason}")
    return True


def generate(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
    max_deferred: int | None = None,
    engine: bool | None = None,
    refine: tuple[int, ...] = (),
    verify: str = "block",
    verify_length: str = "full",
) -> GenerationResult:
    """Decode up to `max_new_tokens` after `input_ids` (batch 1) with DFlash speculative decoding.

    Greedy (temperature 0) output equals the target's own greedy decoding token for token; with sampling, the
    output is distributed exactly as the target's sampling with the same temperature / top-p / top-k.
    block_size: drafted block incl. the anchor (default: the drafter's); stop_token_ids: stop after emitting one.
    engine: None (default) decodes with `flashdraft.speculative.engine` (static caches, CUDA graphs) on a CUDA target it
    supports and with this module's loop otherwise; True / False force one of them. max_deferred: plain loop only.
    refine: draft each block in several passes (`DFlashProposer`; the engine does so at temperature 0), for a
    drafter trained with `recipe.reveal`. verify: when sampling, how a block of drafts is verified: block (default;
    block verification, more tokens per round) or token (token by token, as most servers do); both are lossless
    (`flashdraft.speculative.sampling`). verify_length: full (every draft) or confidence (a drafter with a
    confidence head: as many as raise the round's expected tokens per second on this device,
    `flashdraft.speculative.verify_length`; the plain loop); lossless either way.
    """
    validate_verify_length(verify_length)
    if verify_length == "confidence" and getattr(drafter, "confidence_head", None) is None:
        raise ValueError("verify_length=confidence needs a drafter with a confidence head (DSpark's)")
    block_size = int(drafter.block_size if block_size is None else block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    common = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, generator=generator)
    refine = validate_refine(refine, block_size) if refine else ()
    if refine and getattr(drafter, "chains", False):
        raise ValueError("drafting in passes (refine) needs independent drafts: DSpark and DFlash2 chain theirs")
    if use_engine(target, engine, drafter if block_size > 1 else None, refine, temperature, verify_length):
        drafter = drafter if block_size > 1 else None
        return engine_session.engine_decode(
            target,
            input_ids,
            max_new_tokens,
            drafter=drafter,
            block_size=block_size,
            refine=refine,
            verify=verify,
            **common,
        )
    proposer = DFlashProposer(drafter, target, block_size, temperature, top_p, top_k, generator, refine)
    num_drafts = block_size - 1 + drafter.draft_offset
    rule = None
    if verify_length == "confidence" and block_size > 1:
        rule = ConfidenceLength(_round_cost(target, drafter, proposer, num_drafts))
    return speculative_decode(
        target,
        input_ids,
        proposer if block_size > 1 else None,
        max_new_tokens,
        num_drafts=num_drafts,
        max_deferred=max_deferred,
        verify=verify,
        verify_length=rule,
        **common,
    )


def _round_cost(target: torch.nn.Module, drafter: torch.nn.Module, proposer: DFlashProposer, num_drafts: int):
    """The `RoundCost` of `drafter`'s rounds on `target`, measured once and kept on the target (a decode of many
    prompts measures it before the first)."""
    kept = target.__dict__.setdefault("_flashdraft_round_costs", {})
    key = (id(drafter), proposer.block_size)
    if key not in kept:
        kept[key] = RoundCost.measure(target, proposer.rehearse, widths=range(1, num_drafts + 2))
    return kept[key]
