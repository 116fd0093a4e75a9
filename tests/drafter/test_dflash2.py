"""DFlash2 on the backbone: the convolution and the selector against their float64 references (every element,
gradients too), the identity start, left-to-right drafting, the in-block attention, the family's fields, checkpoints."""

import json

import pytest
import torch

from flashdraft.drafter import DFlashDraftModel
from flashdraft.drafter.conv import GroupedDynamicConv, reference_conv
from flashdraft.drafter.families import with_family
from flashdraft.drafter.selector import CandidateSelector, reference_scores
from flashdraft.target.tiny import tiny_config

FIELDS = {"conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}


def tiny_dflash2(seed=0, block_size=4, num_layers=2, **fields) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = tiny_config("qwen3", num_layers=8, vocab_size=96)
    return DFlashDraftModel.from_target(
        config,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=5,
        family="dflash2",
        family_fields={**FIELDS, **fields},
    ).double()


def _randomise(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _grads(output: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    probe = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed), dtype=output.dtype)
    return torch.autograd.grad((output * probe).sum(), inputs)


@pytest.mark.parametrize("q_len, taps", [(8, 2), (3, 2), (8, 3)])
def test_conv_equals_its_elementwise_reference_with_gradients(q_len, taps):
    """Two packed blocks of 4 (block-local taps), a truncated block of 3, three taps; a random conv and sublayer."""
    conv = GroupedDynamicConv(hidden_size=16, kernel_size=taps, group_size=4, block_size=4).double()
    sublayer = torch.nn.Linear(16, 16).double()
    _randomise(conv, 1)
    _randomise(sublayer, 2)
    u = torch.randn(2, q_len, 16, dtype=torch.float64, requires_grad=True)
    got = conv(lambda x: torch.tanh(sublayer(x)), u)
    want = reference_conv(conv, lambda x: torch.tanh(sublayer(x)), u, block=4 if q_len % 4 == 0 else q_len)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [u, conv.base_kernel, conv.kernel_projection.weight, sublayer.weight]
    for a, b in zip(_grads(got, inputs, 3), _grads(want, inputs, 3), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_new_conv_is_the_identity_and_a_new_dflash2_backbone_computes_dflash():
    conv = GroupedDynamicConv(hidden_size=16, kernel_size=2, group_size=4, block_size=4).double()
    u = torch.randn(1, 8, 16, dtype=torch.float64)
    assert torch.equal(conv(torch.sin, u), torch.sin(u))
    drafter = tiny_dflash2()
    dflash = with_family(drafter, "dflash", None).double()
    assert not any("conv" in n or "selector" in n for n, _ in dflash.named_parameters())
    kwargs = dict(
        position_ids=torch.arange(10)[None],
        noise_embedding=torch.randn(1, 4, 64, dtype=torch.float64),
        target_hidden=torch.randn(1, 6, 64 * len(drafter.target_layer_ids), dtype=torch.float64),
    )
    torch.testing.assert_close(drafter(**kwargs), dflash(**kwargs), rtol=1e-12, atol=1e-12)
    _randomise(drafter.layers[0].mlp_conv, 4, scale=0.1)  # the check can fail: a trained conv changes the output
    assert not torch.allclose(drafter(**kwargs), dflash(**kwargs))


def test_selector_scores_equal_their_elementwise_reference_with_gradients():
    selector = CandidateSelector(vocab_size=12, hidden_size=8, rank=3, top_k=4).double()
    _randomise(selector, 5)
    logits = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    prev = torch.tensor([0, 7, 7, 11, 3])
    got, ids = selector.scores(logits, hidden, prev)
    want, want_ids = reference_scores(selector, logits, hidden, prev)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [logits, hidden, *selector.parameters()]
    for a, b in zip(_grads(got, inputs, 6), _grads(want, inputs, 6), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_walking_left_to_right_gives_the_teacher_forced_scores_of_its_own_path():
    """`walk` (as drafting runs) puts S(x_{t-1}, ·) on the candidates and -inf elsewhere; with the walk's own drafts
    as the teacher-forced predecessors, `scores` (as training runs) computes the same; the codebooks are strong
    enough to change the path, so the drafts depend on each other."""
    drafter = tiny_dflash2(seed=1)
    selector = drafter.candidate_selector
    _randomise(selector, 7, scale=3.0)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 64, generator=g, dtype=torch.float64)
    head = torch.randn(96, 64, generator=g, dtype=torch.float64)
    first = torch.tensor(11)
    drafts, rows = drafter.walk(hidden, head, first, lambda k, row: row.argmax())
    prev = torch.cat([first.view(1), drafts[:-1]])
    scores, ids = selector.scores(hidden @ head.t(), hidden, prev)
    torch.testing.assert_close(rows.gather(1, ids), scores, rtol=1e-12, atol=1e-12)
    assert torch.isinf(rows).sum() == 6 * (96 - 5)  # supported on the 5 candidates only
    assert torch.equal(drafts, ids.gather(1, scores.argmax(-1, keepdim=True))[:, 0])
    assert not torch.equal(drafts, (hidden @ head.t()).argmax(-1))  # the selector changed some drafts


def test_a_new_selector_drafts_what_its_backbone_drafts():
    drafter = tiny_dflash2()
    hidden, head = torch.randn(3, 64, dtype=torch.float64), torch.randn(96, 64, dtype=torch.float64)
    drafts, rows = drafter.walk(hidden, head, torch.tensor(2), lambda k, row: row.argmax())
    logits = hidden @ head.t()
    assert torch.equal(drafts, logits.argmax(-1))
    top = logits.topk(5).indices
    torch.testing.assert_close(rows.gather(1, top), logits.gather(1, top))


def test_the_block_attends_both_ways_and_the_conv_reads_backwards_only():
    """The published layers are sliding with `is_causal: false`: a later block position changes an earlier one's
    hidden state. With attention off (o_proj = 0), only the causal conv mixes positions: then it cannot."""
    drafter = tiny_dflash2(seed=2, num_layers=1)
    assert drafter.config.is_causal is False and drafter.config.layer_types == ["sliding_attention"]
    _randomise(drafter.layers[0].attention_conv, 3, scale=0.2)
    _randomise(drafter.layers[0].mlp_conv, 4, scale=0.2)
    noise = torch.randn(1, 4, 64, dtype=torch.float64)
    changed = noise.clone()
    changed[0, 3] += 1.0
    features = torch.randn(1, 6, 64 * len(drafter.target_layer_ids), dtype=torch.float64)
    run = lambda block: drafter(position_ids=torch.arange(10)[None], noise_embedding=block, target_hidden=features)  # noqa: E731
    assert not torch.allclose(run(noise)[0, 1], run(changed)[0, 1])
    with torch.no_grad():
        drafter.layers[0].self_attn.o_proj.weight.zero_()
    torch.testing.assert_close(run(noise)[0, :3], run(changed)[0, :3], rtol=0, atol=0)
    assert not torch.allclose(run(noise)[0, 3], run(changed)[0, 3])


def test_a_checkpoint_keeps_the_family_its_fields_and_weights(tmp_path):
    drafter = tiny_dflash2(selector_top_k=7)
    _randomise(drafter.candidate_selector, 8)
    drafter.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in config
    assert config["dflash_config"]["selector_top_k"] == 7 and config["is_causal"] is False
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float64)
    assert loaded.family == "dflash2" and loaded.num_drafts == 3 and loaded.chains
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(conv_group_size=7), "conv_group_size 7 must divide hidden_size 64"),
        (dict(conv_kernel_size=5), "conv_kernel_size 5 must be <= block_size 4"),
        (dict(conv_kernel_size=0), "conv_kernel_size must be an integer >= 1"),
        (dict(selector_rank=2.5), "selector_rank must be an integer >= 1"),
        (dict(selector_top_k=97), "selector_top_k 97 must be <= vocab_size 96"),
        (dict(markov_rank=3), "has no field markov_rank"),
    ],
)
def test_bad_family_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_dflash2(**fields)


def _published_names(layers: int) -> set[str]:
    """The tensor names of z-lab's published DFlash2 checkpoints (no embedding, no LM head)."""
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"{c}.{p}" for c in ("attention_conv", "mlp_conv") for p in ("base_kernel", "kernel_projection.weight")),
    ]
    selector = [f"candidate_selector.{n}" for n in ("predecessor_codebook", "successor_codebook")]
    return {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        *(f"layers.{i}.{n}" for i in range(layers) for n in per_layer),
        *selector,
        "candidate_selector.hidden_projection.weight",
    }


def test_the_reference_export_is_the_published_layout(tmp_path):
    from safetensors.torch import load_file

    from flashdraft.drafter.layouts import check_layout, write_layout

    drafter = tiny_dflash2()
    assert check_layout("dflash2", None) == "reference"
    write_layout(drafter, tmp_path, "reference", None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert "block_size" not in config and config["is_causal"] is False and config["sliding_window"] == 2048
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["num_target_layers"] == 8
    assert config["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": 5,
        "target_layer_ids": drafter.target_layer_ids,
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 6,
        "selector_top_k": 5,
    }
    weights = load_file(tmp_path / "model.safetensors")
    assert set(weights) == _published_names(2)
    assert weights["layers.1.mlp_conv.base_kernel"].shape == (2, 2, 64)
    assert weights["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 64 // 8, 64)
    assert weights["candidate_selector.successor_codebook"].shape == (96, 6)


def test_a_checkpoint_in_the_published_format_loads_and_drafts_alike(tmp_path):
    """A checkpoint written the way z-lab publishes one (its config keys, bare codebook names, no top-level
    block_size, output_multiplier and softcapping in dflash_config) loads with every weight and drafts the same."""
    from safetensors.torch import save_file

    source = tiny_dflash2(seed=3)
    _randomise(source, 9, scale=0.1)
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "dtype": "float32",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": source.config.intermediate_size,
        "num_hidden_layers": 2,
        "num_attention_heads": source.config.num_attention_heads,
        "num_key_value_heads": source.config.num_key_value_heads,
        "head_dim": source.config.head_dim,
        "attention_bias": False,
        "is_causal": False,
        "layer_types": ["sliding_attention"] * 2,
        "use_sliding_window": True,
        "max_window_layers": 2,
        "sliding_window": 3,
        "vocab_size": 96,
        "num_target_layers": 8,
        "max_position_embeddings": 512,
        "rms_norm_eps": source.config.rms_norm_eps,
        "tie_word_embeddings": False,
        "rope_parameters": source.config.rope_parameters,
        "dflash_config": {
            "block_size": 4,
            "conv_group_size": 8,
            "conv_kernel_size": 2,
            "mask_token_id": 5,
            "selector_rank": 6,
            "selector_top_k": 5,
            "target_layer_ids": source.target_layer_ids,
            "output_multiplier": 0.5,
            "final_logit_softcapping": 3.0,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.float().contiguous() for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    loaded = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert loaded.family == "dflash2" and loaded.block_size == 4 and loaded.candidate_selector.top_k == 5
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.float().double()), name
    hidden, head = torch.randn(3, 64, dtype=torch.float64), torch.randn(96, 64, dtype=torch.float64)
    logits = loaded.compute_logits(hidden, head)
    torch.testing.assert_close(logits, torch.tanh(0.5 * (hidden @ head.t()) / 3.0) * 3.0)
    drafts, rows = loaded.walk(hidden, head, torch.tensor(1), lambda k, row: row.argmax())
    assert rows.isfinite().sum(-1).eq(5).all()  # the softcapped logits' candidates
