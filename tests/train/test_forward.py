"""A DSpark drafter's training forward on the bundled target (CPU): what reaches its loss (the target's final states
before each label, the true previous tokens, the heads' features), that every head learns, a DFlash drafter's
backbone as its start, and exact resume."""

import json
import shutil

import torch
from safetensors.torch import load_file

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.drafter import DFlashDraftModel
from flashdraft.target import load_causal_lm
from flashdraft.train import forward, loop
from tests.train.test_loop import _batch, _NoUpdate, _Ragged

# On the shipped DFlash drafter's backbone (its heads new), at its fine-tuning learning rate.
DSPARK = [
    "drafter.family=dspark",
    "drafter.init_from=bundled",
    "optim.lr=3e-4",
    "drafter.dspark.markov_rank=16",
    "drafter.dspark.markov_head_type=rnn",
]
SMALL = ["data.max_length=40", "recipe.num_anchors=3", "train.batch_size=2", "train.grad_accum=2", "train.device=cpu"]


def _setup(*extra):
    from flashdraft.benchmarks import train_step as bench

    cfg = load_config(bundled.ASSETS / "train.yaml", [*SMALL, *DSPARK, *extra])
    target, tokenizer = bench.load_bench_target(cfg)
    return cfg, target, bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=2)


def test_dspark_step_reads_the_targets_final_states_and_the_true_previous_tokens(monkeypatch):
    """Each labelled slot (the anchor's too: offset 1) is taught against the whole target's final state one
    position before its label, and its heads read the true token there; the loss moves every head's weights."""
    cfg, target, s = _setup()
    assert len(target.decoder.layers) == target.num_target_layers  # the whole target runs
    data = _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0])
    seen, real_capture, real_loss = [], target.capture, forward.dspark_loss

    def capture(ids, attn=None, **kwargs):
        seen.append({"ids": ids, "attn": attn})
        return real_capture(ids, attn, **kwargs)

    def loss(hidden, head, teacher, labels, weights, **kwargs):
        seen[-1].update(teacher=teacher, labels=labels, kwargs=kwargs)
        return real_loss(hidden, head, teacher, labels, weights, **kwargs)

    monkeypatch.setattr(target, "capture", capture)
    monkeypatch.setattr(forward, "dspark_loss", loss)

    class Keep(_NoUpdate):
        def step(self):
            self.grads = {n: p.grad.clone() for n, p in self.drafter.named_parameters() if p.grad is not None}

    keep = Keep(s.drafter)
    batch = _batch(cfg, s, data)
    _, _, finite = loop.train_step(s, cfg, keep, batch)
    assert finite and len(seen) == 2
    full = load_causal_lm(bundled.BUNDLED, dtype=torch.float32, device="cpu")
    checked = 0
    for call, micro in zip(seen, batch, strict=True):
        ids, labels, kwargs = call["ids"], call["labels"], call["kwargs"]
        assert kwargs["offset"] == 1 and kwargs["markov"] is not None and kwargs["confidence_logits"] is not None
        with torch.no_grad():
            final = full(input_ids=ids, attention_mask=call["attn"], output_hidden_states=True).hidden_states[-1]
        label_positions = micro.blocks.label_positions
        prev = s.drafter.markov_head.embed(ids.gather(1, (label_positions - 1).clamp(0, ids.shape[1] - 1)), final)
        for b, q in (labels != -100).nonzero().tolist():
            pos = int(label_positions[b, q])
            assert ids[b, pos] == labels[b, q] and call["attn"][b, pos] == 1
            torch.testing.assert_close(call["teacher"][b, q], final[b, pos - 1], rtol=1e-4, atol=1e-4)
            checked += 1
        assert prev.shape[:2] == labels.shape
    assert checked >= 4 * 3 * 12
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.joint_proj.weight"):
        assert keep.grads[name].abs().sum() > 0, name
    assert keep.grads["confidence_head.proj.weight"].abs().sum() > 0
    assert keep.grads["layers.0.mlp.down_proj.weight"].abs().sum() > 0


def test_a_dflash_drafter_starts_a_dspark_one_with_its_backbone():
    """drafter.init_from a DFlash drafter with drafter.family = dspark: the shipped backbone, new heads."""
    cfg, _, s = _setup("drafter.dspark.sample_from_anchor=false")
    shipped = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float32)
    drafter = s.drafter
    assert drafter.family == "dspark" and drafter.draft_offset == 0 and drafter.markov_head.kind == "rnn"
    for name, tensor in shipped.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


def test_a_frozen_backbone_stays_bit_for_bit_and_only_the_heads_learn(tmp_path):
    """drafter.freeze_backbone: two optimizer steps from the shipped DFlash backbone leave every backbone tensor as
    it was and move every head's; the optimizer holds the heads alone."""
    run = [
        "drafter.freeze_backbone=true",
        "drafter.dspark.sample_from_anchor=false",
        "train.max_steps=2",
        "recipe.num_anchors=8",
        "data.eval_prompts=null",
        f"log.out={tmp_path}",
    ]
    cfg = load_config(bundled.ASSETS / "train.yaml", [*DSPARK, *run])
    result = loop.train(cfg)
    trained = load_file(result.checkpoint / "drafter" / "model.safetensors")
    shipped = DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float32).state_dict()
    heads = sorted(set(trained) - set(shipped))
    assert heads and all(name.startswith(("markov_head.", "confidence_head.")) for name in heads)
    for name, tensor in shipped.items():
        assert torch.equal(trained[name], tensor), name
    _, _, s = _setup("drafter.freeze_backbone=true", "drafter.dspark.sample_from_anchor=false")
    new_heads = s.drafter.state_dict()  # the heads as this seed starts them
    assert all(not torch.equal(trained[name], new_heads[name]) for name in heads)
    assert {n for n, p in s.drafter.named_parameters() if p.requires_grad} == set(heads)


def test_a_frozen_backbone_needs_one_to_start_from_and_heads_to_train():
    import pytest

    from flashdraft.config.schema import ConfigError

    with pytest.raises(ConfigError, match="drafter.freeze_backbone.*needs drafter.init_from"):
        load_config(bundled.ASSETS / "train.yaml", ["drafter.freeze_backbone=true"])
    with pytest.raises(ConfigError, match="drafter.freeze_backbone.*needs drafter.family dspark or dflash2"):
        load_config(
            bundled.ASSETS / "train.yaml",
            ["drafter.freeze_backbone=true", "drafter.family=dflash", "drafter.init_from=bundled"],
        )


def test_a_dspark_run_resumes_exactly(tmp_path):
    """Four steps with a checkpoint after two; the run cut after that checkpoint and resumed gives the same losses
    and the same heads."""
    short = [
        *DSPARK,
        "train.max_steps=4",
        "log.every=1",
        "log.checkpoint_every=2",
        "recipe.num_anchors=8",
        "data.eval_prompts=null",
        "log.eval_every=0",
    ]
    cfg = lambda out: load_config(bundled.ASSETS / "train.yaml", [*short, f"log.out={out}"])  # noqa: E731
    losses = lambda out: {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }  # noqa: E731
    whole = tmp_path / "whole"
    loop.train(cfg(whole))
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000004")  # as if killed after the step-2 checkpoint
    loop.train(cfg(cut), resume=True)
    assert losses(cut) == losses(whole) and len(losses(whole)) == 4
    a = load_file(whole / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors")
    b = load_file(cut / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors")
    assert "markov_head.joint_proj.weight" in a and all(torch.equal(a[k], b[k]) for k in a)


def test_with_the_anchor_slot_drafting_nothing_the_rnn_chain_starts_where_drafting_starts(monkeypatch):
    """sample_from_anchor = false (offset 0): block slot 0 holds the anchor and drafts nothing. The rnn Markov
    head's state must start at slot 1, from zero, as `MarkovHead.walk` starts it when drafting; slot 0 gets no
    features. (Run across slot 0 first, training would teach a state that drafting never has.)"""
    cfg, target, s = _setup("drafter.dspark.sample_from_anchor=false")
    data = _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0])
    seen, real_loss = [], forward.dspark_loss

    def loss(hidden, head, teacher, labels, weights, **kwargs):
        seen.append((hidden.detach(), kwargs["markov"].detach(), kwargs["offset"]))
        return real_loss(hidden, head, teacher, labels, weights, **kwargs)

    monkeypatch.setattr(forward, "dspark_loss", loss)
    batch = _batch(cfg, s, data)
    loop.train_step(s, cfg, _NoUpdate(s.drafter), batch)
    head, k = s.drafter.markov_head, cfg.drafter.block_size
    for (hidden, markov, offset), micro in zip(seen, batch, strict=True):
        assert offset == 0
        prev = forward.before_labels(micro.input_ids, micro.blocks)
        with torch.no_grad():
            for b in range(hidden.shape[0]):
                for first in range(0, hidden.shape[1], k):
                    assert markov[b, first].abs().max() == 0
                    state = None
                    for q in (first + 1, first + 2):
                        expected, state = head.step(prev[b, q], hidden[b, q], state)
                        torch.testing.assert_close(markov[b, q], expected, rtol=1e-5, atol=1e-6)


def test_a_dflash2_step_feeds_the_selector_the_true_previous_tokens_and_trains_every_part(monkeypatch):
    """DFlash's slots (offset 0); the selector's predecessor of each label is the data token before it; the step
    moves the backbone, both convolutions and the selector (its successor codebook starts at 0). The data are random
    tokens, rarely among the candidates: injected, they are learned."""
    family = ["drafter.family=dflash2", "drafter.dflash2.selector_rank=8", "drafter.dflash2.selector_top_k=4"]
    family.append("recipe.dflash2.absent=inject")
    cfg, target, s = _setup(*family)
    assert s.drafter.family == "dflash2" and s.drafter.draft_offset == 0
    seen, real_loss = [], forward.dflash2_loss

    def loss(hidden, head, labels, weights, prev, selector, **kwargs):
        seen.append((labels, prev, kwargs))
        return real_loss(hidden, head, labels, weights, prev, selector, **kwargs)

    monkeypatch.setattr(forward, "dflash2_loss", loss)

    class Keep(_NoUpdate):
        def step(self):
            self.grads = {n: p.grad.clone() for n, p in self.drafter.named_parameters() if p.grad is not None}

    keep = Keep(s.drafter)
    batch = _batch(cfg, s, _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0]))
    _, _, finite = loop.train_step(s, cfg, keep, batch)
    assert finite and len(seen) == 2
    for (labels, prev, kwargs), micro in zip(seen, batch, strict=True):
        assert kwargs["offset"] == 0 and kwargs["loss_weights"].absent == "inject"
        positions = micro.blocks.label_positions
        for b, q in (labels != -100).nonzero().tolist():
            assert prev[b, q] == micro.input_ids[b, int(positions[b, q]) - 1]
    # B = 0 at the start: the first step moves B alone of the pair score's factors.
    assert not keep.grads["candidate_selector.hidden_projection.weight"].any()
    for name in (
        "candidate_selector.successor_codebook",
        "layers.0.attention_conv.kernel_projection.weight",
        "layers.0.mlp_conv.base_kernel",
        "layers.0.mlp.down_proj.weight",
    ):
        assert keep.grads[name].abs().sum() > 0, name
