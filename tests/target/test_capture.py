"""FrozenTarget and load_frozen_target: capture == output_hidden_states exactly, truncation, freezing, loading rules."""

import json

import pytest
import torch

from flashdraft import fastpath
from flashdraft.config import TargetConfig, load_config
from flashdraft.hub import resolve_local_files_only
from flashdraft.target import FrozenTarget, glue_compile_enabled, load_causal_lm, load_frozen_target
from flashdraft.target.tiny import random_tiny_model

LAYERS = 8


def full_reference(family, dtype, ids, mask=None, seed=0):
    """The untouched model's output_hidden_states (fast path enabled, as on every hybrid target)."""
    model = random_tiny_model(family, num_layers=LAYERS, dtype=dtype, seed=seed)
    fastpath.enable(model, strict=False)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.float64), ("qwen3_5", torch.float32)])
@pytest.mark.parametrize("layer_ids", [[1, 3, 5], [5, 0, 5, 2], [2, 7]], ids=["sorted", "unsorted-dup", "last"])
def test_capture_equals_output_hidden_states(family, dtype, layer_ids):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 13), generator=g)
    hidden_states = full_reference(family, dtype, ids)

    model = random_tiny_model(family, num_layers=LAYERS, dtype=dtype, seed=0)
    target = FrozenTarget.from_model(model, layer_ids, strict=False)
    lm_head_calls = []
    model.lm_head.register_forward_hook(lambda *_: lm_head_calls.append(1))
    features = target.capture(ids)

    expected = torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert features.shape == (2, 13, len(layer_ids) * 64) and features.dtype == dtype
    assert torch.equal(features, expected)  # exactly: same kernels, same inputs
    assert not lm_head_calls
    # Truncated after the last captured layer; the final norm never runs inside the decoder.
    assert len(model.model.layers) == max(layer_ids) + 1
    assert model.config.num_hidden_layers == max(layer_ids) + 1
    assert isinstance(model.model.norm, torch.nn.Identity)
    # The full config is what a drafter is built from.
    assert target.config.num_hidden_layers == LAYERS and target.num_target_layers == LAYERS


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_capture_with_right_padding(family):
    """Every token's features equal those of the masked full model (the padding positions' are undefined: the
    decoder runs unmasked, which causal layers make exact for right padding); other padding is refused."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    hidden_states = full_reference(family, torch.float64, ids, mask)
    target = FrozenTarget.from_model(random_tiny_model(family, LAYERS, dtype=torch.float64), [1, 4], strict=False)
    features = target.capture(ids, mask)
    expected = torch.cat([hidden_states[2], hidden_states[5]], dim=-1)
    tokens = mask.bool()
    torch.testing.assert_close(features[tokens], expected[tokens], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="only right padding"):
        target.capture(ids, mask.flip(1))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_capture_final_hidden_is_the_models_last_state_and_logits(family):
    """recipe.labels = target: a target built with final_hidden keeps every layer, and capture(final=True) gives
    the final-normed last hidden state, whose product with the LM head is the full model's logits; the captured
    features stay those of the truncated capture."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (2, 10), generator=g)
    reference = random_tiny_model(family, num_layers=LAYERS, dtype=torch.float64, seed=0)
    fastpath.enable(reference, strict=False)
    with torch.no_grad():
        out = reference(input_ids=ids, output_hidden_states=True)
    model = random_tiny_model(family, num_layers=LAYERS, dtype=torch.float64, seed=0)
    target = FrozenTarget.from_model(model, [1, 4], strict=False, final_hidden=True)
    assert len(model.model.layers) == LAYERS
    features, final = target.capture(ids, final=True)
    assert torch.equal(features, torch.cat([out.hidden_states[2], out.hidden_states[5]], dim=-1))
    assert torch.equal(final, out.hidden_states[-1])
    torch.testing.assert_close(final @ target.lm_head_weight.t(), out.logits, rtol=1e-12, atol=1e-12)
    assert torch.equal(target.capture(ids), features)
    truncated = FrozenTarget.from_model(random_tiny_model(family, LAYERS, dtype=torch.float64), [1, 4], strict=False)
    with pytest.raises(ValueError, match="final_hidden"):
        truncated.capture(ids, final=True)


def test_frozen_embed_and_lm_head():
    model = random_tiny_model("qwen3_5", LAYERS, dtype=torch.float64)
    embedding = model.get_input_embeddings().weight.detach().clone()
    target = FrozenTarget.from_model(model, [1, 2], strict=False)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = torch.tensor([[3, 7, 255]])
    assert torch.equal(target.embed(ids), embedding[ids])
    assert target.lm_head_weight.shape == (256, 64)
    assert target.lm_head_weight is model.lm_head.weight
    features = target.capture(ids)
    assert not features.requires_grad
    # The probe ran on the truncated model and is kept on the object: one row per linear-attention layer kept.
    assert [layer.index for layer in target.fastpath_report.layers] == [0, 1, 2]


def test_layer_id_validation():
    with pytest.raises(ValueError, match=r"out of range.*0\.\.7"):
        FrozenTarget.from_model(random_tiny_model("qwen3", LAYERS), [1, 8], strict=False)
    with pytest.raises(ValueError, match="non-empty"):
        FrozenTarget.from_model(random_tiny_model("qwen3", LAYERS), [], strict=False)


# ---- loading -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_load_frozen_target_reads_only_kept_layers(tmp_path, family):
    random_tiny_model(family, LAYERS, seed=3).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (1, 9), generator=g)
    hidden_states = full_reference(family, torch.float32, ids, seed=3)

    target = load_frozen_target(tmp_path, layer_ids=[0, 2], device="cpu")
    assert target.dtype == torch.float32 and target.device.type == "cpu"  # CPU default: fp32
    assert len(target.decoder.layers) == 3 and target.config.num_hidden_layers == LAYERS
    assert not any(name.startswith("model.layers.3.") for name, _ in target.model.named_parameters())
    assert torch.equal(target.capture(ids), torch.cat([hidden_states[1], hidden_states[3]], dim=-1))
    assert target.name_or_path == str(tmp_path)
    # recipe.labels = target loads every layer: the final hidden state is the full model's.
    whole = load_frozen_target(tmp_path, layer_ids=[0, 2], device="cpu", final_hidden=True)
    assert len(whole.decoder.layers) == LAYERS
    features, final = whole.capture(ids, final=True)
    assert torch.equal(features, target.capture(ids)) and torch.equal(final, hidden_states[-1])


def test_load_frozen_target_multimodal_qwen35_checkpoint(tmp_path):
    """The published Qwen3.5 layout: a ConditionalGeneration checkpoint (model.language_model.*, a vision tower).
    Loaded as the text-only causal LM; the vision tower and the dropped layers stay on disk."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from flashdraft.target.tiny import tiny_config

    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=4)
    config = Qwen3_5Config(text_config=tiny_config("qwen3_5", LAYERS).to_dict(), vision_config=vision)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    fastpath.enable(model, strict=False)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden_states = model.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states

    target = load_frozen_target(tmp_path, layer_ids=[1, 3], device="cpu")
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM" and len(target.decoder.layers) == 4
    assert target.config.num_hidden_layers == LAYERS
    assert not any("visual" in name for name, _ in target.model.named_parameters())
    assert torch.equal(target.capture(ids), torch.cat([hidden_states[2], hidden_states[4]], dim=-1))
    assert torch.equal(target.lm_head_weight, model.lm_head.weight)


def test_load_frozen_target_default_layer_ids(tmp_path):
    random_tiny_model("qwen3", LAYERS).save_pretrained(tmp_path)
    target = load_frozen_target(tmp_path, num_features=3, dtype=torch.float64, device="cpu")
    assert target.target_layer_ids == [1, 3, 5]  # round(1 + i * (8 - 4) / 2)
    assert target.dtype == torch.float64


def test_load_frozen_target_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_frozen_target(tmp_path / "does-not-exist")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="file"):
        load_frozen_target(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty has no config\.json"):
        load_frozen_target(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_frozen_target(empty)
    (empty / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model\.bin\)"):
        load_frozen_target(empty)


def test_hub_id_offline_by_default(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=0"):
        load_frozen_target("flashdraft-tests/no-such-model")


def test_local_files_only_rule(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_local_files_only(None) is True
    for value, expected in [("0", False), ("false", False), ("1", True), ("", True)]:
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert resolve_local_files_only(None) is expected
    assert resolve_local_files_only(True) is True and resolve_local_files_only(False) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_capture_on_gpu_with_fast_path(family):
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    model = random_tiny_model(family, LAYERS, dtype=torch.bfloat16, device="cuda")
    fastpath.enable(model, strict=True)
    with torch.no_grad():
        hidden_states = model(input_ids=ids, output_hidden_states=True).hidden_states
    model = random_tiny_model(family, LAYERS, dtype=torch.bfloat16, device="cuda")
    target = FrozenTarget.from_model(model, [1, 3, 5])  # strict on CUDA: every linear-attention layer fast
    assert target.fastpath_report.ok
    assert torch.equal(target.capture(ids), torch.cat([hidden_states[i + 1] for i in [1, 3, 5]], dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("lever", ["cudnn_attention", "compile"])
def test_capture_levers_on_gpu(family, lever):
    """`target.cudnn_attention` (the attention backend) and `target.compile` (compiled norms and MLPs) change how
    the target runs, not the features: both bf16 paths sit as close to the float64 reference (same weights) as
    each other."""
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    layer_ids = [1, 3, 5]
    reference = full_reference(family, torch.float64, ids)
    expected = torch.cat([reference[i + 1] for i in layer_ids], dim=-1)
    errors = {}
    for on in (False, True):
        model = random_tiny_model(family, LAYERS, dtype=torch.float64).to("cuda", torch.bfloat16)
        target = FrozenTarget.from_model(model, layer_ids)
        if lever == "compile":
            target.compile_glue(on)
        else:
            target.cudnn_attention = on
        got = target.capture(ids.cuda()).double().cpu()
        errors[on] = ((got - expected).norm() / expected.norm()).item()
    assert errors[True] < 2e-2 and errors[True] <= 2 * errors[False] + 1e-3, errors


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_compiled_glue_keeps_the_features_and_can_be_undone(family):
    """`target.compile`: the plain RMSNorms and dense MLPs run compiled — one graph per code path and shape kind,
    shared by every layer — and the features stay those of the eager target (float32, CPU), at two lengths; then
    `compile_glue(False)` puts every eager forward back."""
    from torch._dynamo.utils import counters

    model = random_tiny_model(family, LAYERS, dtype=torch.float32)
    target = FrozenTarget.from_model(model, [1, 3], strict=False)
    lengths = (24, 40)
    ids = {n: torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n)) for n in lengths}
    eager = {n: target.capture(ids[n]) for n in lengths}
    forwards = [vars(m).get("forward") for m in target.decoder.modules()]  # instance patches (the fast path's)
    attention_layers = [layer for layer in target.decoder.layers if hasattr(layer, "self_attn")]
    expected = 3 * len(target.decoder.layers) + 2 * len(attention_layers)  # 2 norms + MLP per layer; q/k norms
    torch._dynamo.reset()
    counters.clear()
    assert target.compile_glue() == expected and target.glue_compiled
    assert target.compile_glue() == expected  # idempotent: nothing wrapped twice
    for n in lengths:
        torch.testing.assert_close(target.capture(ids[n]), eager[n], rtol=1e-5, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs < expected, f"{graphs} graphs for {expected} modules: compiled per layer, not per code path"
    assert target.compile_glue(False) == 0 and not target.glue_compiled
    assert all(
        a is b for a, b in zip([vars(m).get("forward") for m in target.decoder.modules()], forwards, strict=True)
    )
    assert torch.equal(target.capture(ids[lengths[0]]), eager[lengths[0]])


@pytest.mark.parametrize(
    ("setting", "device", "shard", "expected"),
    [
        ("auto", "cuda", False, True),
        ("auto", "cuda", True, False),
        ("auto", "cpu", False, False),
        (True, "cpu", False, True),
        (False, "cuda", False, False),
        (True, "cuda", True, True),
    ],
)
def test_target_compile_resolution(setting, device, shard, expected):
    """`target.compile`: auto compiles the glue on CUDA, except a sharded target; true and false are obeyed."""
    options = TargetConfig(path="t", compile=setting, shard=shard)
    assert glue_compile_enabled(options, torch.device(device)) is expected


def test_target_compile_rejects_other_values():
    with pytest.raises(ValueError, match="target.compile = 'yes'"):
        glue_compile_enabled(TargetConfig(path="t", compile="yes"), torch.device("cpu"))


# ---- target.precision: fp8 ---------------------------------------------------------------------------------------


def _bundled_text_ids(rows: int = 2, length: int = 160) -> torch.Tensor:
    """Real text for the bundled target: the first `rows` of its training data, `length` tokens each."""
    from flashdraft import bundled

    tokenizer = bundled.load_tokenizer()
    records = [json.loads(line) for line in open(bundled.train_data()[0])][:rows]
    return torch.tensor([tokenizer(r["prompt"] + r["response"])["input_ids"][:length] for r in records])


def _norms(features: torch.Tensor) -> torch.Tensor:
    """(B, T, layers, D) -> the Frobenius norm of each layer's slice."""
    return features.transpose(0, 2).flatten(1).norm(dim=1)


def test_fp8_features_of_the_bundled_target_stay_within_bound():
    """The bundled (trained) target on its own text, every captured layer against float64: bf16 within 1%, FP8
    linears (bf16 activations, on the CPU's scaled matmul) within 8% — and measurably off (FP8 really ran)."""
    from flashdraft import bundled
    from flashdraft.fastpath import fp8

    ids = _bundled_text_ids()
    layers = [1, 3, 5, 7]

    def features(dtype, precision):
        model = load_causal_lm(bundled.BUNDLED, dtype=dtype, device="cpu")
        if precision == "fp8":
            assert fp8.convert_linears(model.model.layers)
        target = FrozenTarget.from_model(model, layers, strict=False)
        assert target.precision == precision
        return target.capture(ids).double().unflatten(-1, (len(layers), -1))

    reference = features(torch.float64, "bf16")
    for dtype, precision, bound in ((torch.bfloat16, "bf16", 0.01), (torch.bfloat16, "fp8", 0.08)):
        got = features(dtype, precision)
        errors = (_norms(got - reference) / _norms(reference)).tolist()
        assert max(errors) < bound, (precision, errors)
        if precision == "fp8":
            assert min(errors) > 0.01, errors


def test_fp8_needs_an_fp8_device_and_a_bf16_target():
    from flashdraft.config import ConfigError

    target = FrozenTarget.from_model(random_tiny_model("qwen3", 4, dtype=torch.float32), [1, 2], strict=False)
    with pytest.raises(ConfigError, match=r"target.precision = fp8: the cpu device has no FP8") as err:
        target.configure(TargetConfig(path="t", precision="fp8"))
    assert err.value.field == "target.precision" and target.precision == "bf16"
    with pytest.raises(ValueError, match="must be bf16 or fp8"):
        target.set_precision("int4")
    for overrides, message in (
        (["target.precision=fp16"], "must be bf16 or fp8"),
        (["target.precision=fp8", "target.shard=true"], "cannot be combined with target.shard"),
        (["target.precision=fp8", "target.dtype=float32"], "needs a bfloat16 target"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            load_config(None, overrides)
        assert err.value.field == "target.precision"


def test_fp8_refused_on_the_cpu_before_the_target_loads(tmp_path, monkeypatch):
    from flashdraft import bundled
    from flashdraft.config import ConfigError
    from flashdraft.train import setup

    monkeypatch.setattr(setup, "load_frozen_target", lambda *a, **k: pytest.fail("the target was loaded"))
    cfg = load_config(bundled.ASSETS / "train.yaml", ["target.precision=fp8", f"log.out={tmp_path}"])
    with pytest.raises(ConfigError, match="target.precision = fp8: the cpu device"):
        setup.load_inputs(cfg, tmp_path, console=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_fp8_target_on_the_gpu(family):
    """`configure(precision=fp8)` on a bf16 GPU target: FP8 linears proven by the probe (strict), features within
    FP8's error of the bf16 ones, compiled glue (the quantization compiled) equal to eager, and no way back."""
    from flashdraft.fastpath import fp8

    if fp8.unsupported_reason(torch.device("cuda")) is not None:
        pytest.skip(fp8.unsupported_reason(torch.device("cuda")))
    ids = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    bf16 = FrozenTarget.from_model(random_tiny_model(family, LAYERS, dtype=torch.bfloat16, device="cuda"), [1, 3, 5])
    expected = bf16.capture(ids).float()
    target = FrozenTarget.from_model(random_tiny_model(family, LAYERS, dtype=torch.bfloat16, device="cuda"), [1, 3, 5])
    target.configure(TargetConfig(path="t", precision="fp8", compile=False))
    assert target.precision == "fp8" and target.fastpath_report.ok and target.fastpath_report.fp8.proven > 0
    eager = target.capture(ids).float()
    error = ((eager - expected).norm() / expected.norm()).item()
    assert 0.005 < error < 0.1, error
    target.compile_glue(True)
    compiled = target.capture(ids).float()
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-2
    with pytest.raises(ValueError, match="load the target again"):
        target.set_precision("bf16")


def test_compiled_glue_of_an_fp8_target_keeps_its_features():
    """`target.compile` with FP8 linears: the per-row quantization compiles (inside the MLPs, and alone for the
    attention and Gated DeltaNet projections) without a graph break, and the features stay the eager ones up to FP8
    rounding: a float32 rounding difference of the compiled glue can move an activation across an FP8 step (12.5%),
    which the next layers carry on. Measured on the CPU: 7e-8 relative with torch 2.14's inductor, 5.8e-4 with
    2.13's (2.3% of the elements moved), against 2.3e-2 between this FP8 target and the same model unquantized,
    which is what a compiled path that lost the quantization would show."""
    from torch._dynamo.utils import counters

    from flashdraft.fastpath import fp8

    model = random_tiny_model("qwen3_5", LAYERS, dtype=torch.float32)
    fp8.convert_linears(model.model.layers)
    target = FrozenTarget.from_model(model, [1, 3], strict=False)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    eager = target.capture(ids)
    torch._dynamo.reset()
    counters.clear()
    lone = [m for m in target._glue_modules() if isinstance(m, fp8.FP8Linear)]
    assert lone and all(m is not layer.mlp.down_proj for m in lone for layer in target.decoder.layers)
    target.compile_glue()
    compiled = target.capture(ids)
    assert ((compiled - eager).norm() / eager.norm()).item() < 5e-3
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
