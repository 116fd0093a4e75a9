"""The drafter runner drafts what `DFlashDraftModel.forward` drafts over the whole context, round after round
(pending features of 1 .. bs tokens), for full-attention and sliding-window drafters."""

import pytest
import torch

from flashdraft.drafter import DFlashDraftModel
from flashdraft.speculative.engine.drafter_runner import DrafterRunner
from flashdraft.speculative.engine.target_runner import TargetEngine

from .. import MASK, one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from . import ATOL, CONFIGS, HostReads

DRAFTERS = {
    "full": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", list(DRAFTERS))
@torch.inference_mode()
def test_runner_equals_the_drafter_forward(kind, config):
    device, dtype, graphs = config
    target = tiny_target("qwen3_5", seed=5, dtype=dtype).to(device)
    torch.manual_seed(6)
    bs = 6
    drafter = DFlashDraftModel.from_target(
        target.config, num_layers=2, block_size=bs, mask_token_id=MASK, target_layer_ids=[1, 2], **DRAFTERS[kind]
    )
    drafter = drafter.to(device, dtype).eval()
    engine = TargetEngine(target, max_len=64, block_size=bs, feature_layers=[1, 2])
    runner = DrafterRunner(drafter, engine)
    if graphs:
        runner.capture()
    g = torch.Generator().manual_seed(7)
    width = 2 * target.config.hidden_size
    features = torch.randn(60, width, generator=g, dtype=dtype).to(device)
    tokens = torch.randint(0, 255, (60,), generator=g).to(device)
    embed = target.get_input_embeddings()

    context = 11
    runner.prefill(features[:context])
    pending = 0
    for step, new in enumerate([3, 1, bs, 2, bs, 5]):
        runner.block_ids.fill_(MASK)
        runner.block_ids[0] = tokens[context + pending]
        runner.draft()
        context += pending
        block = torch.full((1, bs), MASK, device=device)
        block[0, 0] = tokens[context]
        hidden = drafter(
            position_ids=torch.arange(context + bs, device=device)[None],
            noise_embedding=embed(block),
            target_hidden=features[None, :context],
        )
        expected = drafter.compute_logits(hidden[0, 1:], target.get_output_embeddings())
        atol = ATOL[dtype] * max(1.0, float(expected.abs().max()))
        err = (runner.logits - expected).abs().max().item()
        assert err <= atol, f"round {step}: max error {err:.3g} > {atol:.3g}"
        assert torch.equal(runner.drafts, runner.logits.argmax(dim=-1))
        # The next round: the engine's feature buffer holds `new` verified tokens' features (then garbage).
        engine.features.copy_(torch.randn(bs, width, generator=g, dtype=dtype).to(device))
        engine.features[:new] = features[context : context + new]
        runner.pending.fill_(new)
        pending = new


def test_drafter_must_read_the_engine_features():
    target = tiny_target("qwen3", seed=0)
    drafter = DFlashDraftModel.from_target(
        target.config, num_layers=1, block_size=4, mask_token_id=MASK, target_layer_ids=[1]
    )
    engine = TargetEngine(target, max_len=16, block_size=4, feature_layers=[2])
    with pytest.raises(ValueError, match="target layers"):
        DrafterRunner(drafter.to(torch.float64), engine)


CHAINED = {
    "dspark": ("dspark", {"sample_from_anchor": True}),
    "dspark-dflash-slots": ("dspark", {"sample_from_anchor": False}),
    "dflash2": ("dflash2", {}),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", list(CHAINED))
@torch.inference_mode()
def test_a_chained_runner_walks_what_the_plain_loop_walks(kind, config):
    """A DSpark or DFlash2 drafter's runner: its drafts and logits are the drafter's own walk over `forward`'s block
    (DSpark's anchor slot drafting too, or not; DFlash2's convolutions inside its layers and its selector's rows −inf
    off the candidates), greedy; the engine verifies one token more when the anchor slot drafts."""
    from .. import random_drafter

    device, dtype, graphs = config
    target = tiny_target("qwen3_5", seed=5, dtype=dtype).to(device)
    bs = 5
    family, fields = CHAINED[kind]
    anchor_drafts = bool(fields.get("sample_from_anchor"))
    drafter = random_drafter(target, block_size=bs, seed=6, family=family, **fields)
    drafter = drafter.to(device)
    layers = list(drafter.target_layer_ids)
    engine = TargetEngine(target, max_len=64, block_size=bs + int(anchor_drafts), feature_layers=layers)
    runner = DrafterRunner(drafter, engine)
    if graphs:
        runner.capture()
    g = torch.Generator().manual_seed(7)
    features = torch.randn(20, len(layers) * target.config.hidden_size, generator=g, dtype=dtype).to(device)
    runner.prefill(features)
    runner.block_ids[0] = 17
    runner.draft()
    block = torch.full((1, bs), MASK, device=device)
    block[0, 0] = 17
    hidden = drafter(
        position_ids=torch.arange(20 + bs, device=device)[None],
        noise_embedding=target.get_input_embeddings()(block),
        target_hidden=features[None],
    )
    head = target.get_output_embeddings()
    drafts, logits = drafter.walk(hidden[0, 1 - int(anchor_drafts) :], head, block[0, 0], lambda k, x: x.argmax())
    assert torch.equal(runner.drafts, drafts)
    finite = logits.isfinite()
    assert torch.equal(runner.logits.isfinite(), finite) and finite.sum() > 0
    atol = ATOL[dtype] * max(1.0, float(logits[finite].abs().max()))
    assert (runner.logits[finite] - logits[finite]).abs().max().item() <= atol
    assert runner.drafts.shape[0] == bs - 1 + int(anchor_drafts)


@pytest.mark.parametrize("config", CONFIGS)
@torch.inference_mode()
def test_a_padded_prefill_drafts_what_the_exact_one_drafts(config):
    """After the engine's padded prefill (what its graph replays; on a GPU captured, runner's included) the runner
    caches the prompt's context from the padded buffer: its drafts equal those after an unpadded prefill (an
    engine without graphs), so no padded row is seen."""
    from .. import random_drafter

    device, dtype, graphs = config
    target = tiny_target("qwen3_5", seed=5, dtype=dtype).to(device)
    drafter = random_drafter(target, block_size=5, seed=6).to(device)
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(8)).to(device)
    drafted = []
    for padded in (False, True):
        engine = TargetEngine(target, max_len=64, block_size=5, feature_layers=list(drafter.target_layer_ids))
        runner = DrafterRunner(drafter, engine)
        if graphs and padded:
            engine.capture()
            runner.capture()
        engine.prefill(ids, pad_to=64 if padded else None)
        runner.prefill()
        assert int(runner.context) == 13 and padded == bool(runner.prefill_steps)
        if padded:
            assert all(step.graph is not None for step in runner.prefill_steps.values()) == graphs
        runner.block_ids[0] = 17
        runner.draft()
        drafted.append((runner.logits.clone(), runner.drafts.clone()))
    (exact_logits, exact_drafts), (logits, drafts) = drafted
    assert torch.equal(drafts, exact_drafts)
    atol = ATOL[dtype] * max(1.0, float(exact_logits.abs().max()))
    assert (logits - exact_logits).abs().max().item() <= atol


@pytest.mark.parametrize("kind, temperature", [("dflash", 0.0), *[(kind, t) for kind in CHAINED for t in (0.0, 1.0)]])
@torch.no_grad()
def test_the_captured_draft_step_reads_nothing_on_the_host(kind, temperature):
    """What a GPU captures in a CUDA graph, the draft step (a chained head's draws included), reads no device value
    on the host: its eager run on the CPU, under `HostReads`, finds none. (Under inference mode CPU tensors read
    their values without dispatch, so the step runs under no_grad here.)"""
    from .. import random_drafter

    target = tiny_target("qwen3_5", seed=5, dtype=torch.float32)
    bs = 5
    family, fields = CHAINED.get(kind, ("dflash", {}))
    drafter = random_drafter(target, block_size=bs, seed=6, family=family, **fields)
    anchor_drafts = bool(fields.get("sample_from_anchor"))
    layers = list(drafter.target_layer_ids)
    engine = TargetEngine(target, max_len=64, block_size=bs + int(anchor_drafts), feature_layers=layers)
    runner = DrafterRunner(drafter, engine, sampling=(temperature, 1.0, 0), generator=torch.Generator().manual_seed(1))
    runner.prefill(torch.randn(20, len(layers) * target.config.hidden_size))
    runner.block_ids[0] = 17
    engine.features.normal_()
    runner.pending.fill_(2)
    if runner.noise is not None:
        runner.noise.exponential_().log_().neg_()  # Gumbel noise, as `draft` draws it before the step
    with HostReads() as reads:
        runner.step.fn()
    assert reads.found == []
    assert runner.drafts.shape[0] == bs - 1 + int(anchor_drafts)
