"""Our drafter against the reference `dflash==0.1.0`: checkpoints load both ways and give the same logits.

CI installs the reference with `pip install --no-deps dflash==0.1.0`; a missing package fails these tests.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache, Qwen3Config
from transformers.cache_utils import DynamicSlidingWindowLayer

from flashdraft.drafter import DFlashDraftModel, build_target_layer_ids
from flashdraft.target.tiny import random_tiny_model, tiny_config

HIDDEN, VOCAB, BLOCK = 64, 256, 4
# transformers 5.15 taught a sliding-window cache layer to roll back past its window (activate_past_recording);
# before, the reference loop's `cache.crop` fails there, for the reference and for ours alike.
SLIDING_CROP = hasattr(DynamicSlidingWindowLayer, "activate_past_recording")
LAYER_TYPES = {
    "full": None,
    "sliding": ["sliding_attention", "full_attention"],  # one causal sliding-window layer, one bidirectional
}


@pytest.fixture(scope="module")
def ref():
    try:
        import dflash.model
    except ImportError:
        pytest.fail("the reference package is missing: pip install --no-deps dflash==0.1.0", pytrace=False)
    return dflash.model


def expected_keys(num_layers: int) -> set[str]:
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    layers = {f"layers.{i}.{name}" for i in range(num_layers) for name in per_layer}
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | layers


def ours(kind: str, seed: int = 0) -> DFlashDraftModel:
    extra = {} if LAYER_TYPES[kind] is None else {"layer_types": LAYER_TYPES[kind], "sliding_window": 3}
    torch.manual_seed(seed)
    model = DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=8), num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1, **extra
    )
    # Norm weights are initialised to ones; perturb them so a swapped or missing norm cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def draft_logits(model, lm_head, steps, cache=None):
    """Run the inference loop's drafter calls: per step, new context features then one block; logits per step."""
    if cache is not None:
        cache.activate_past_recording()
    start, out = 0, []
    for features, block in steps:
        if cache is None:  # recompute from the whole context
            context = torch.cat([f for f, _ in steps[: len(out) + 1]], dim=1)
        else:
            context = features
        start += features.shape[1]
        positions = torch.arange(start - context.shape[1], start + BLOCK)[None]
        hidden = model(
            position_ids=positions, noise_embedding=block, target_hidden=context, past_key_values=cache, use_cache=True
        )
        if cache is not None:
            cache.crop(-(cache.get_seq_length() - start))
        out.append(model.compute_logits(hidden[:, 1:], lm_head))
    return out


def random_steps(n_features: int, accepted=(7, 3, 1), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, a, n_features * HIDDEN, generator=g), torch.randn(1, BLOCK, HIDDEN, generator=g))
        for a in accepted
    ]


@pytest.mark.parametrize("kind", sorted(LAYER_TYPES))
@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "cache"])
@torch.no_grad()
def test_ours_saved_loads_in_reference_with_identical_logits(ref, tmp_path, kind, use_cache):
    if use_cache and kind == "sliding" and not SLIDING_CROP:
        pytest.skip("this transformers cannot roll a sliding-window cache back past its window (5.15+ can)")
    original = ours(kind)
    original.save_pretrained(tmp_path)
    reference = ref.DFlashDraftModel.from_pretrained(tmp_path).eval()
    assert reference.target_layer_ids == original.target_layer_ids
    assert (reference.block_size, reference.mask_token_id) == (original.block_size, original.mask_token_id)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    steps = random_steps(len(original.target_layer_ids))
    cache = (lambda m: DynamicCache(config=m.config)) if use_cache else (lambda m: None)
    want = draft_logits(reference, head, steps, cache(reference))
    for a, b in zip(draft_logits(original, head, steps, cache(original)), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # Bitwise against our model loaded from the same file: tensors mmapped from safetensors sit at other memory
    # alignments than freshly allocated ones, which alone moves a CPU matrix-vector product by an ulp.
    loaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    for a, b in zip(draft_logits(loaded, head, steps, cache(loaded)), want, strict=True):
        assert torch.equal(a, b), "same operations in the same order on the same weights: expected bitwise equality"


@pytest.mark.parametrize("kind", sorted(LAYER_TYPES))
@torch.no_grad()
def test_reference_saved_loads_in_ours_with_identical_logits(ref, tmp_path, kind):
    source = ours(kind, seed=7)  # only for a config with the reference's fields
    torch.manual_seed(7)
    reference = ref.DFlashDraftModel(Qwen3Config.from_dict(source.config.to_dict())).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    reference.save_pretrained(tmp_path)
    model = DFlashDraftModel.from_pretrained(tmp_path).eval()
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    steps = random_steps(len(model.target_layer_ids), seed=2)
    reloaded = ref.DFlashDraftModel.from_pretrained(tmp_path).eval()
    for use_cache in (False, True) if kind != "sliding" or SLIDING_CROP else (False,):
        cache = (lambda m: DynamicCache(config=m.config)) if use_cache else (lambda m: None)
        got = draft_logits(model, head, steps, cache(model))
        for a, b in zip(got, draft_logits(reference, head, steps, cache(reference)), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for a, b in zip(got, draft_logits(reloaded, head, steps, cache(reloaded)), strict=True):
            assert torch.equal(a, b)


def test_checkpoint_keys_and_config_fields(tmp_path):
    model = ours("sliding")
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == expected_keys(2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"]) == (BLOCK, 8, 2)
    assert cfg["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 5]}
    assert (cfg["layer_types"], cfg["sliding_window"]) == (LAYER_TYPES["sliding"], 3)


def test_default_target_layer_ids_match_reference(ref):
    for num_target_layers in range(4, 100):
        for n in range(1, 9):
            assert build_target_layer_ids(num_target_layers, n) == ref.build_target_layer_ids(num_target_layers, n)


@torch.no_grad()
def test_reference_generate_loop_drives_our_drafter_losslessly(ref, tmp_path):
    """dflash_generate with our model, and with the reference model loaded from our checkpoint: same tokens, and
    (greedy, plain Qwen3 target) the target's own greedy continuation."""
    target = random_tiny_model("qwen3", num_layers=8, vocab_size=VOCAB)
    model = ours("full")
    model.save_pretrained(tmp_path)
    reference = ref.DFlashDraftModel.from_pretrained(tmp_path).eval()
    prompt = torch.randint(0, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(4))
    with_ours = ref.dflash_generate(model, target, prompt, max_new_tokens=12, stop_token_ids=None)
    with_ref = ref.dflash_generate(reference, target, prompt, max_new_tokens=12, stop_token_ids=None)
    greedy = target.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(with_ours, with_ref)
    assert torch.equal(with_ours, greedy)
