"""speculators 0.9 (vLLM's format library) reads flashdraft's DFlash, DSpark and DFlash2 exports with its own model
classes, and computes the logits flashdraft's drafter computes on the same inputs (float32, 1e-5 relative).

speculators pins torch <= 2.14.1 and transformers <= 5.19, so it runs in an interpreter of its own, named by
FLASHDRAFT_SPECULATORS_PYTHON (`.ci/run` installs one); flashdraft writes the exports and the inputs here, and
speculators_logits.py, run by that interpreter, writes back what speculators computes, the context features from the
verifier the export names at the layers speculators reads from it. Without the variable the tests skip and say so.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft import bundled, export
from flashdraft.drafter import DFlashDraftModel, select_context_features
from flashdraft.drafter.families import with_family
from flashdraft.speculative.prompts import load_prompts
from flashdraft.target import load_causal_lm

SPECULATORS_PYTHON = os.environ.get("FLASHDRAFT_SPECULATORS_PYTHON")
SCRIPT = Path(__file__).with_name("speculators_logits.py")
pytestmark = pytest.mark.skipif(
    not SPECULATORS_PYTHON,
    reason="FLASHDRAFT_SPECULATORS_PYTHON is not set: no interpreter with speculators 0.9 to read the exports",
)


@pytest.fixture(scope="module")
def target():
    return load_causal_lm(bundled.BUNDLED, device="cpu", dtype=torch.float32)


def dspark_drafter(kind: str) -> DFlashDraftModel:
    """A DSpark drafter for the bundled target: the shipped DFlash backbone with random heads, made strong enough
    that the Markov bias moves the logits."""
    shipped = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float32)
    config = shipped.config.to_dict()
    config["architectures"] = ["DSparkDraftModel"]
    config["dflash_config"] = {**config["dflash_config"], "markov_rank": 32, "markov_head_type": kind}
    torch.manual_seed(1)
    drafter = DFlashDraftModel(type(shipped.config).from_dict(config))
    drafter.load_state_dict(shipped.state_dict(), strict=False)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.mul_(30)
        drafter.markov_head.markov_w2.weight.mul_(30)
    return drafter.eval()


def dflash2_drafter() -> DFlashDraftModel:
    """A DFlash2 drafter for the bundled target: the shipped DFlash backbone with random convolutions and selector,
    strong enough to move the hidden states and the candidates' scores."""
    shipped = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float32)
    torch.manual_seed(2)
    fields = {"conv_group_size": 16, "selector_rank": 32, "selector_top_k": 8}
    drafter = with_family(shipped, "dflash2", fields)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "candidate_selector" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return drafter.eval()


@torch.no_grad()
def compare(drafter, target, tmp_path: Path) -> dict:
    """Export `drafter` in speculators' layout, compute its logits here and in speculators; the largest relative
    differences."""
    checkpoint = tmp_path / "drafter"
    drafter.save_pretrained(checkpoint)
    out = export.export_drafter(checkpoint, tmp_path / "export", target=bundled.target_dir(), layout="speculators")
    prompt = load_prompts(bundled.eval_prompts(), bundled.load_tokenizer(), 1)[0].input_ids
    context, tokens = prompt[:, :-16], prompt[0, -16:]
    features = select_context_features(
        target(context, output_hidden_states=True).hidden_states, drafter.target_layer_ids
    )
    block = torch.full((1, drafter.block_size), drafter.mask_token_id)
    block[0, 0] = tokens[0]
    hidden = drafter(
        position_ids=torch.arange(context.shape[1] + drafter.block_size)[None],
        noise_embedding=target.get_input_embeddings()(block),
        target_hidden=features,
    )
    start = 1 - drafter.draft_offset
    slots = hidden[:, start:]
    prev = tokens[None, : slots.shape[1]]  # the true tokens before each drafted one (the anchor first)
    inputs = {"context_ids": context, "block_ids": block, "first_slot": torch.tensor(start)}
    head = target.get_output_embeddings()
    expected = {"logits": drafter.draft_logits(slots, head, prev)}
    if drafter.family == "dspark":
        inputs["prev_ids"] = prev
        expected["confidence"] = drafter.confidence_logits(slots, prev)
    if drafter.family == "dflash2":  # the selector's top-k and their scores after each true previous token
        inputs["selector_prev_ids"] = prev
        scores, candidates = drafter.candidate_selector.scores(expected["logits"], slots, prev)
        expected.update(selector_scores=scores, candidates=candidates.float())
    save_file({k: v.contiguous() for k, v in inputs.items()}, tmp_path / "inputs.safetensors")
    subprocess.run(
        [SPECULATORS_PYTHON, str(SCRIPT), str(out), str(tmp_path / "inputs.safetensors"), str(tmp_path / "got")],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    got = load_file(tmp_path / "got")
    assert set(got) == set(expected) and all(got[k].shape == v.shape for k, v in expected.items())
    return {name: ((got[name] - want).abs().max() / want.abs().max()).item() for name, want in expected.items()}


def test_speculators_reads_the_shipped_dflash_drafter(target, tmp_path):
    drafter = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float32).eval()
    errors = compare(drafter, target, tmp_path)
    assert errors["logits"] <= 1e-5, errors


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_speculators_reads_a_dspark_drafter(target, tmp_path, kind):
    errors = compare(dspark_drafter(kind), target, tmp_path)
    assert errors["logits"] <= 1e-5 and errors["confidence"] <= 1e-5, errors


def test_speculators_reads_a_dflash2_drafter(target, tmp_path):
    drafter = dflash2_drafter()
    errors = compare(drafter, target, tmp_path)
    assert errors["candidates"] == 0, errors  # the same top-k, in the same order
    assert errors["logits"] <= 1e-5 and errors["selector_scores"] <= 1e-5, errors
