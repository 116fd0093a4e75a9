"""`flashdraft bench train-step` on the CPU: it times the trainer's own step, and its FLOP count is the cost model's."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashdraft import bundled
from flashdraft.benchmarks import train_step as bench
from flashdraft.config import load_config
from flashdraft.drafter import DFlashDraftModel
from flashdraft.telemetry.flops import step_flops
from tests import SHIPPED_DRAFTER

TINY = ["data.max_length=48", "recipe.num_anchors=5", "train.batch_size=2", "train.grad_accum=2"]


def test_synthetic_sequences_are_seeded_and_all_response():
    data = bench.SyntheticSequences(3, 17, 100, seed=4)
    ids, mask = data[1]
    assert ids.shape == (17,) and mask.tolist() == [1] * 17 and 0 <= ids.min() and ids.max() < 100
    assert np.array_equal(bench.SyntheticSequences(3, 17, 100, seed=4)[1][0], ids)
    assert not np.array_equal(data[2][0], ids)
    assert len(data) == 3 and data.epoch_order(5, 0) == [0, 1, 2]


def test_run_train_step_times_every_phase():
    cfg = load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *TINY])
    target, tokenizer = bench.load_bench_target(cfg)
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=3)
    result = bench.run_train_step(s, cfg, warmup=1, steps=2)
    assert result["finite"] and result["attention"] == "sdpa" and not result["compiled"]
    assert result["seq_tokens"] == 2 * 2 * 48  # batch x accum x length
    assert result["labelled"] == 2 * 2 * 5 * (s.drafter.block_size - 1)  # every block position is a response token
    assert set(result["phases_ms"]) == set(bench.PHASES) and all(v > 0 for v in result["phases_ms"].values())
    assert len(result["steps_s"]) == 2 and result["step_s"] >= sum(result["phases_ms"].values()) / 1e3 * 0.5
    assert len(result["warmup_steps_s"]) == 1 and result["warmup_steps_s"][0] > 0  # the untimed step, kept apart
    first = result["first_step_phases_ms"]  # where a first step's compiles went: its own phases
    assert set(first) == set(bench.PHASES) and all(v > 0 for v in first.values())
    assert sum(first.values()) / 1e3 <= result["warmup_steps_s"][0]
    assert result["flops"] == step_flops(s, result["seq_tokens"], result["labelled"])
    assert result["mfu"] is None and result["peak_gib"] is None  # no CUDA: no peak rate or memory to report


def test_cost_model_at_27b_scale():
    """88 GFLOP per sequence token at seq 3072 (a 27B target, a 5-layer drafter, 512 anchors x 16), checked against
    weights counted by hand from the config's numbers, not from the model's parameters."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=62,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(62)],
    )
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
        drafter = DFlashDraftModel.from_target(
            cfg, num_layers=5, block_size=16, target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=248070
        )
    s = SimpleNamespace(target=SimpleNamespace(model=model, lm_head_weight=model.lm_head.weight), drafter=drafter)
    seq, anchors, bs, hidden, vocab = 3072, 512, 16, 5120, 248320
    mlp_and_norms = 3 * hidden * 17408 + 2 * hidden
    # Gated attention: q_proj also yields the output gate (2 x 24 heads x 256); k, v: 4 heads x 256; o: 24 x 256;
    # q and k norms (256 each).
    full = hidden * (2 * 24 * 256) + 2 * hidden * (4 * 256) + (24 * 256) * hidden + 2 * 256 + mlp_and_norms
    # Gated DeltaNet: q, k (16 heads x 128) and v (48 x 128) in one projection, z (48 x 128), b and a (48 each), out;
    # the depthwise conv (width 4) over q, k, v; decay A and dt bias (48 each); the gated norm (128).
    linear = (
        hidden * (2 * 16 * 128 + 48 * 128)
        + hidden * (48 * 128)
        + 2 * hidden * 48
        + (48 * 128) * hidden
        + 4 * (2 * 16 * 128 + 48 * 128)
        + 2 * 48
        + 128
        + mlp_and_norms
    )
    # Layers 3, 7, .., 59 are full attention; the final norm; embedding and LM head excluded.
    target = 15 * full + 47 * linear + hidden
    # The drafter: plain attention (no gate) with q and k norms; its final norm and the norm after fc.
    drafter_layer = hidden * (24 * 256) + 2 * hidden * (4 * 256) + (24 * 256) * hidden + 2 * 256 + mlp_and_norms
    fc = 5 * hidden * hidden  # 5 captured layers -> hidden, over the context tokens
    by_hand = (
        2 * target * seq
        + 6 * (5 * drafter_layer + 2 * hidden) * anchors * bs
        + 6 * fc * seq
        + 4 * hidden * vocab * anchors * (bs - 1)
    )
    flops = step_flops(s, seq, anchors * (bs - 1))
    assert flops == pytest.approx(by_hand, rel=1e-9)
    assert 85 < flops / seq / 1e9 < 91


@pytest.mark.parametrize("family", [[], ["drafter.family=dspark"]], ids=["dflash", "dspark"])
def test_step_flops_count_what_a_step_multiplies(family):
    """One real training step on the CPU under torch's FlopCounterMode: its matrix multiplications (mm, addmm: the
    target's forward, the drafter's forward and backward, the LM-head loss; for DSpark the whole target, the
    target's distributions and the Markov bias too) are DESIGN.md's cost model, but for attention (bmm / SDPA,
    excluded by definition) and two simplifications of the model, each ~0.3% at 27B scale: fc's input gradient
    (counted, but the frozen features need none) and the drafter's K/V projections of the context tokens (computed
    in every layer, not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    from flashdraft.train import loop
    from flashdraft.train.optim import build_optimizer

    overrides = ["data.max_length=32", "recipe.num_anchors=3", "train.batch_size=1", "train.grad_accum=1", *family]
    cfg = load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *overrides])
    target, tokenizer = bench.load_bench_target(cfg)
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=1)
    optimizer = build_optimizer(s.drafter.parameters(), cfg.optim, s.device)
    with FlopCounterMode(display=False) as counter:
        stats, tokens, _ = loop.train_step(s, cfg, optimizer, s.batches.batch(0))
    counted = counter.get_flop_counts()["Global"]
    matmul = sum(n for op, n in counted.items() if str(op) in ("aten.mm", "aten.addmm"))
    labelled = int(stats.valid.sum())
    assert tokens == 32 and labelled == 3 * s.drafter.num_drafts
    context_kv = sum(
        layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel() for layer in s.drafter.layers
    )
    model = step_flops(s, tokens, labelled) - 2 * s.drafter.fc.weight.numel() * tokens + 6 * context_kv * tokens
    assert model == pytest.approx(matmul, rel=5e-3)
