"""DFlashDraftModel: sizes from the target, validation, attention pattern, KV injection, cache, checkpoints."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache, Qwen3_5Config, Qwen3_5TextConfig

from flashdraft.drafter import DFlashDraftModel, build_target_layer_ids, select_context_features
from flashdraft.target.tiny import tiny_config

HIDDEN = 64  # tiny_config's hidden size


def qwen35_27b_config() -> Qwen3_5Config:
    """The Qwen3.5-27B config (its config.json on the Hub), multimodal wrapper included; no weights."""
    text = Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        intermediate_size=17408,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        attn_output_gate=True,
    )
    return Qwen3_5Config(text_config=text.to_dict())


def tiny_drafter(seed=0, **kwargs) -> DFlashDraftModel:
    kwargs = {"num_layers": 2, "block_size": 4, "mask_token_id": 5, **kwargs}
    torch.manual_seed(seed)
    return DFlashDraftModel.from_target(tiny_config("qwen3", num_layers=8), **kwargs).eval()


def inputs(model, batch=2, ctx=5, q=4, start=0, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = len(model.target_layer_ids)
    target_hidden = torch.randn(batch, ctx, n * HIDDEN, generator=g)
    noise = torch.randn(batch, q, HIDDEN, generator=g)
    positions = torch.arange(start, start + ctx + q)[None].expand(batch, -1)
    return {"position_ids": positions, "noise_embedding": noise, "target_hidden": target_hidden}


# ---- sizes and defaults -----------------------------------------------------------------------------------------


def test_from_target_qwen35_27b_shapes():
    with torch.device("meta"):
        model = DFlashDraftModel.from_target(qwen35_27b_config())
    cfg = model.config
    assert model.target_layer_ids == [1, 16, 31, 46, 61]
    assert (model.block_size, model.mask_token_id, model.num_target_layers) == (16, 248070, 64)
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers == 5
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (5120, 24, 4, 256)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (17408, 248320, 262144)
    # Full rotary over 1-D positions, no output gate: the drafter's layers are plain Qwen3 layers.
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    assert not hasattr(cfg, "attn_output_gate")
    assert cfg.layer_types == ["full_attention"] * 5
    assert model.fc.weight.shape == (5120, 5 * 5120)
    assert model.layers[0].self_attn.q_proj.weight.shape == (24 * 256, 5120)
    assert model.layers[0].self_attn.k_proj.weight.shape == (4 * 256, 5120)


def test_from_target_accepts_text_config_and_overrides():
    text = qwen35_27b_config().text_config
    with torch.device("meta"):
        model = DFlashDraftModel.from_target(
            text,
            num_layers=3,
            block_size=10,
            intermediate_size=8192,
            layer_types=["sliding_attention"] * 3,
            sliding_window=2048,
        )
    cfg = model.config
    assert model.target_layer_ids == build_target_layer_ids(64, 3) == [1, 31, 61]
    assert (model.block_size, cfg.intermediate_size) == (10, 8192)
    assert (cfg.sliding_window, cfg.use_sliding_window) == (2048, True)
    assert model.layers[0].self_attn.sliding_window == 2048 and model.layers[0].self_attn.is_causal


def test_moe_target_without_dense_mlp_gets_3x_hidden():
    model = DFlashDraftModel.from_target(tiny_config("qwen3_5_moe", num_layers=8), num_layers=2, mask_token_id=1)
    assert model.config.intermediate_size == 3 * HIDDEN


@pytest.mark.parametrize(
    "num_target_layers, n, expected",
    [(64, 5, [1, 16, 31, 46, 61]), (36, 5, [1, 9, 17, 25, 33]), (32, 1, [16]), (24, 2, [1, 21])],
)
def test_default_target_layer_ids(num_target_layers, n, expected):
    assert build_target_layer_ids(num_target_layers, n) == expected


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 1}, "block_size"),
        ({"target_layer_ids": [1, 8]}, "target_layer_ids"),
        ({"target_layer_ids": [-1, 3]}, "target_layer_ids"),
        ({"target_layer_ids": [5, 2]}, "sorted"),
        ({"target_layer_ids": [2, 2]}, "unique"),
        ({"mask_token_id": 256}, "mask_token_id"),
        ({"mask_token_id": -1}, "mask_token_id"),
        ({"sliding_window": 16}, "sliding_window"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny_drafter(**kwargs)


def test_default_ids_too_few_target_layers_says_what_to_do():
    with pytest.raises(ValueError, match="pass target_layer_ids explicitly"):
        DFlashDraftModel.from_target(tiny_config("qwen3", num_layers=4), num_layers=5, mask_token_id=1)


# ---- attention pattern and KV injection ------------------------------------------------------------------------


@torch.no_grad()
def test_block_attention_is_bidirectional():
    model = tiny_drafter()
    x = inputs(model)
    out = model(**x)
    x["noise_embedding"] = x["noise_embedding"].clone()
    x["noise_embedding"][:, -1] += 1.0
    changed = model(**x)
    assert not torch.allclose(out[:, 0], changed[:, 0]), "the first block position must see the last one"


@torch.no_grad()
def test_sliding_layers_are_causal_within_the_block():
    model = tiny_drafter(layer_types=["sliding_attention"] * 2, sliding_window=64)
    x = inputs(model)
    out = model(**x)
    x["noise_embedding"] = x["noise_embedding"].clone()
    x["noise_embedding"][:, -1] += 1.0
    changed = model(**x)
    torch.testing.assert_close(out[:, :-1], changed[:, :-1], rtol=0, atol=0)
    assert not torch.allclose(out[:, -1], changed[:, -1])


@torch.no_grad()
def test_sliding_window_hides_old_context():
    model = tiny_drafter(layer_types=["sliding_attention"] * 2, sliding_window=3)
    x = inputs(model, ctx=6)
    out = model(**x)
    # With window 3 the block (positions 6..9) reaches back to position 4 at most: context 0..3 is invisible.
    x["target_hidden"] = x["target_hidden"].clone()
    x["target_hidden"][:, :4] = torch.randn_like(x["target_hidden"][:, :4])
    torch.testing.assert_close(model(**x), out, rtol=0, atol=0)


@torch.no_grad()
def test_context_enters_only_through_keys_and_values():
    model = tiny_drafter()
    x = inputs(model, ctx=7, q=4)
    seen: dict[str, set[int]] = {}

    def record(name):
        return lambda module, args: seen.setdefault(name.split(".", 1)[-1], set()).add(args[0].shape[1])

    for name, module in model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(record(name))
    out = model(**x)
    assert out.shape == (2, 4, HIDDEN)
    for name, lengths in seen.items():
        expected = {7, 4} if name in ("self_attn.k_proj", "self_attn.v_proj") else {4}
        assert lengths == expected, name
    x["target_hidden"] = x["target_hidden"] + 1.0
    assert not torch.allclose(model(**x), out), "the context must reach the block"


@torch.no_grad()
def test_dense_mask_true_means_attend():
    model = tiny_drafter()
    x = inputs(model, ctx=5, q=4)
    everything = torch.ones(1, 1, 4, 9, dtype=torch.bool)
    torch.testing.assert_close(model(**x, attention_mask=everything), model(**x), rtol=1e-6, atol=1e-6)
    # Hide the context: the output must no longer depend on it.
    block_only = everything.clone()
    block_only[..., :5] = False
    out = model(**x, attention_mask=block_only)
    x["target_hidden"] = torch.randn_like(x["target_hidden"])
    torch.testing.assert_close(model(**x, attention_mask=block_only), out, rtol=0, atol=0)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
@torch.no_grad()
def test_cached_drafting_equals_full_recompute(layer_types):
    """The inference loop: draft, crop the cache to the context, append accepted tokens' features, draft again."""
    extra = {} if layer_types is None else {"layer_types": layer_types, "sliding_window": 3}
    model = tiny_drafter(**extra).double()
    g = torch.Generator().manual_seed(3)
    features = torch.randn(1, 12, 2 * HIDDEN, generator=g, dtype=torch.float64)
    blocks = torch.randn(3, 1, 4, HIDDEN, generator=g, dtype=torch.float64)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    start = 0
    for step, accepted in enumerate([6, 3, 2]):  # the prompt, then the tokens accepted after each draft
        new = features[:, start : start + accepted]
        start += accepted
        positions = torch.arange(start - accepted, start + 4)[None]
        cached = model(position_ids=positions, noise_embedding=blocks[step], target_hidden=new, past_key_values=cache)
        cache.crop(-(cache.get_seq_length() - start))
        full = model(
            position_ids=torch.arange(start + 4)[None], noise_embedding=blocks[step], target_hidden=features[:, :start]
        )
        torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)


def test_logits_from_lm_head_module_or_weight():
    model = tiny_drafter()
    head = torch.nn.Linear(HIDDEN, 256, bias=False)
    hidden = torch.randn(2, 3, HIDDEN)
    torch.testing.assert_close(model.compute_logits(hidden, head), model.compute_logits(hidden, head.weight))
    assert model.compute_logits(hidden, head).shape == (2, 3, 256)


def test_select_context_features_skips_the_embedding_output():
    states = [torch.full((1, 2, 3), float(i)) for i in range(9)]
    features = select_context_features(states, [1, 5])
    assert features.shape == (1, 2, 6)
    assert features[0, 0].tolist() == [2.0] * 3 + [6.0] * 3


def test_forward_input_errors():
    model = tiny_drafter()
    x = inputs(model)
    with pytest.raises(TypeError, match="attn_mask"):
        model(**x, attn_mask=None)
    with pytest.raises(ValueError, match="features per token"):
        model(**{**x, "target_hidden": x["target_hidden"][..., :HIDDEN]})
    with pytest.raises(ValueError, match="position_ids cover"):
        model(**{**x, "position_ids": x["position_ids"][:, 1:]})


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradients_reach_every_parameter(checkpointing):
    model = tiny_drafter().train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model(**inputs(model)).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ---- checkpoints -----------------------------------------------------------------------------------------------


@torch.no_grad()
def test_save_load_roundtrip_is_atomic_and_exact(tmp_path):
    model = tiny_drafter(layer_types=["full_attention", "sliding_attention"], sliding_window=3)
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier save")
    model.save_pretrained(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"], "no temporary directories left behind"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = DFlashDraftModel.from_pretrained(out).eval()
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids) == (4, 5, [1, 5])
    x = inputs(model, ctx=6)
    torch.testing.assert_close(loaded(**x), model(**x), rtol=0, atol=0)
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 3


def test_save_keeps_bfloat16(tmp_path):
    tiny_drafter().to(torch.bfloat16).save_pretrained(tmp_path / "d")
    assert DFlashDraftModel.from_pretrained(tmp_path / "d").fc.weight.dtype == torch.bfloat16


def test_refuses_pickle_weights(tmp_path):
    model = tiny_drafter()
    model.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors only"):
        DFlashDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors only"):
        DFlashDraftModel.from_pretrained(tmp_path, use_safetensors=False)


def test_refuses_a_dflash_checkpoint_labelled_dflash2_naming_the_missing_weights(tmp_path):
    model = tiny_drafter()
    model.config.architectures = ["DFlash2DraftModel"]
    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"\(a dflash2 drafter\): missing \['candidate_selector"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "family, fields",
    [
        ("dflash", {}),
        *[("dspark", {"markov_head_type": kind}) for kind in ("vanilla", "gated", "rnn")],
        ("dflash2", {}),
    ],
)
def test_walk_reads_nothing_on_the_host_so_a_cuda_graph_can_capture_it(family, fields):
    """`walk` is what the engine captures in a CUDA graph, which refuses any read of a device value on the host
    (`.item()`, a 0-d tensor used as a Python index). On the meta device every such read fails at once: each family
    walks a block there, its previous token a 0-d tensor as the engine passes it."""
    with torch.device("meta"):
        drafter = DFlashDraftModel.from_target(
            tiny_config("qwen3", num_layers=8, vocab_size=96),
            num_layers=1,
            mask_token_id=5,
            family=family,
            family_fields=fields,
        )
        hidden, head, first = torch.randn(4, 64), torch.randn(96, 64), torch.tensor(3)
    drafts, logits = drafter.walk(hidden, head, first, lambda k, row: row.argmax())
    assert drafts.shape == (4,) and logits.shape == (4, 96) and drafts.is_meta
