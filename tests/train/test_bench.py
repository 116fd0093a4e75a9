"""`flashdraft bench train-step` on the CPU: it times the trainer's own step, and its FLOP count is the cost model's."""

import json
from types import SimpleNamespace

import numpy as np
import torch

from flashdraft import cli, embedded
from flashdraft.config import load_config
from flashdraft.drafter import DFlashDraftModel
from flashdraft.train import bench
from flashdraft.train.loop import step_flops

TINY = ["data.max_length=48", "recipe.num_anchors=5", "train.batch_size=2", "train.grad_accum=2"]


def test_synthetic_sequences_are_seeded_and_all_response():
    data = bench.SyntheticSequences(3, 17, 100, seed=4)
    ids, mask = data[1]
    assert ids.shape == (17,) and mask.tolist() == [1] * 17 and 0 <= ids.min() and ids.max() < 100
    assert np.array_equal(bench.SyntheticSequences(3, 17, 100, seed=4)[1][0], ids)
    assert not np.array_equal(data[2][0], ids)
    assert len(data) == 3 and data.epoch_order(5, 0) == [0, 1, 2]


def test_run_train_step_times_every_phase():
    cfg = load_config(embedded.ASSETS / "train.yaml", TINY)
    target, tokenizer = bench.load_bench_target(cfg)
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=3)
    result = bench.run_train_step(s, cfg, warmup=1, steps=2)
    assert result["finite"] and result["attention"] == "sdpa" and not result["compiled"]
    assert result["seq_tokens"] == 2 * 2 * 48  # batch x accum x length
    assert result["labelled"] == 2 * 2 * 5 * (s.drafter.block_size - 1)  # every block position is a response token
    assert set(result["phases_ms"]) == set(bench.PHASES) and all(v > 0 for v in result["phases_ms"].values())
    assert len(result["steps_s"]) == 2 and result["step_s"] >= sum(result["phases_ms"].values()) / 1e3 * 0.5
    assert result["flops"] == step_flops(s, result["seq_tokens"], result["labelled"])
    assert result["mfu"] is None and result["peak_gib"] is None  # no CUDA: no peak rate or memory to report


def test_cost_model_at_27b_scale():
    """88 GFLOP per sequence token at seq 3072 (a 27B target, a 5-layer drafter, 512 anchors x 16), the same as the
    count written out term by term: fc runs over the context, the other drafter weights over the blocks."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=62,
                            num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(62)])  # fmt: skip
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
        drafter = DFlashDraftModel.from_target(cfg, num_layers=5, block_size=16, target_layer_ids=[1, 16, 31, 46, 61],
                                               mask_token_id=248070)  # fmt: skip
    s = SimpleNamespace(target=SimpleNamespace(model=model, lm_head_weight=model.lm_head.weight), drafter=drafter)
    seq, anchors, bs, hidden, vocab = 3072, 512, 16, 5120, 248320
    flops = step_flops(s, seq, anchors * (bs - 1))
    layers = sum(p.numel() for p in model.model.layers.parameters())
    fc = drafter.fc.weight.numel()
    by_hand = (2 * layers * seq + 6 * (sum(p.numel() for p in drafter.parameters()) - fc) * anchors * bs
                      + 6 * fc * seq + 4 * hidden * vocab * anchors * (bs - 1))  # fmt: skip
    assert abs(flops / by_hand - 1) < 1e-6
    assert 85 < flops / seq / 1e9 < 91


def test_cli_bench_train_step_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "train-step", "--warmup", "0", "--steps", "1", "--seq", "40", "--json", str(out),
                     "recipe.num_anchors=4", "train.batch_size=1"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "FLOPs per step" in printed and "flashdraft" in printed and "drafter_bwd" in printed
    report = json.loads(out.read_text())
    assert report["machine"]["torch"] == torch.__version__
    (row,) = report["results"]
    assert row["seq"] == 40 and row["seq_tokens"] == 40 and row["step_s"] > 0


def test_cli_bench_bad_input_names_the_option(capsys):
    assert cli.main(["bench", "train-step", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
