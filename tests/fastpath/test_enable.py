"""fastpath.enable on tiny hybrid targets: patching, per-layer proof, strictness, and unchanged numerics."""

import subprocess
import sys

import pytest
import torch

from flashdraft import fastpath
from flashdraft.fastpath.backends import CHUNK_RULE, CONV_FN, FLA, FLASHDRAFT_TRITON, OPS, TORCH
from flashdraft.fastpath.patch import (
    INSTANCE,
    entry_points,
    is_patched,
    linear_attention_layers,
    transformers_checks_devices,
)
from flashdraft.target.tiny import HYBRID_FAMILIES, random_tiny_model

from . import crashes_unpatched_on_cpu, expected_generation, torch_reference_logits

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_enable_on_cpu_reports_every_layer_and_keeps_numerics(family):
    model = random_tiny_model(family, num_layers=8, seed=1)
    ids = torch.randint(0, 256, (2, 19))
    fastpath.disable(model)  # transformers' import-time lookups, whatever an earlier test patched
    expected = torch_reference_logits(model, ids)
    try:
        report = fastpath.enable(model, strict=False)
        linear = [i for i, _ in linear_attention_layers(model)]
        assert [layer.index for layer in report.layers] == linear == [0, 1, 2, 4, 5, 6]
        assert report.generation == expected_generation()
        for layer in report.layers:
            assert set(layer.ops) == set(OPS)
            for use in layer.ops.values():
                assert use.impl == TORCH and "no CUDA device" in use.reason
        assert not report.ok and report.slow_layers() == linear
        with torch.no_grad():
            got = model(ids).logits
        # transformers 5.14 ran nn.Conv1d where the patched layer runs flashdraft's torch conv (same sums, other order);
        # from 5.15 the patched layer calls transformers' own torch functions.
        tolerance = dict(rtol=1e-5, atol=1e-6) if report.generation == INSTANCE else dict(rtol=0, atol=0)
        torch.testing.assert_close(got, expected, **tolerance)
        text = str(report)
        assert "no CUDA device" in text and "0-2,4-6" in text
    finally:
        fastpath.disable(model)


def test_strict_raises_with_layers_and_reason():
    model = random_tiny_model("qwen3_5", num_layers=4)
    try:
        with pytest.raises(fastpath.FastPathError) as err:
            fastpath.enable(model)
        msg = str(err.value)
        assert "3 of 3" in msg and "layers 0-2" in msg and "no CUDA device" in msg
        assert err.value.report.layers
    finally:
        fastpath.disable(model)


@pytest.mark.skipif(CUDA, reason="documents the CPU hazard of transformers' import-time choice")
def test_probe_without_enable_exposes_the_import_time_choice():
    model = random_tiny_model("qwen3_5", num_layers=4)
    fastpath.disable(model)  # what transformers chose at import, whatever an earlier test's entry point patched
    report = fastpath.probe(model)
    assert not report.ok
    chunk = report.layers[0].ops["chunk_gated_delta_rule"]
    if crashes_unpatched_on_cpu(model):
        # 5.17-5.24 bound fla's kernels at import because fla imports; on a CPU they crash.
        assert "active drivers" in report.error
        assert chunk.impl == f"error in {FLA}" and "active drivers" in chunk.reason
    elif transformers_checks_devices():
        # 5.25+ sends CPU inputs to its torch reference itself, and the probe says so.
        assert not report.error
        assert chunk.impl == TORCH and "transformers' own device check" in chunk.reason and "cpu" in chunk.reason
    else:
        # 5.14 (and 5.15-5.16 unless fla.ops was imported first) chose the torch functions at import.
        assert not report.error
        assert chunk.impl == TORCH and "chosen by transformers at import" in chunk.reason


def test_ensure_patches_once_and_keeps_an_explicit_choice():
    model = random_tiny_model("qwen3_5", num_layers=4)
    fastpath.disable(model)
    assert not is_patched(model)
    lookups = entry_points(linear_attention_layers(model)[0][1])
    current = lambda: {op: getattr(owner, name) for op, (owner, name) in lookups.items()}  # noqa: E731
    try:
        fastpath.ensure(model)
        assert is_patched(model)
        installed = current()
        fastpath.ensure(model)  # a second call changes nothing
        assert current() == installed
        fastpath.enable(model, strict=False, conv_backend="torch", run_probe=False)
        chosen = current()[CONV_FN]
        fastpath.ensure(model)  # ... and keeps what an explicit enable chose
        assert current()[CONV_FN] is chosen is not installed[CONV_FN]
        conv = fastpath.probe(model).layers[0].ops["causal_conv1d_fn"]
        assert conv.reason == "fallback: conv_backend='torch' requested"
    finally:
        fastpath.disable(model)


def test_plain_target_has_no_linear_layers():
    model = random_tiny_model("qwen3", num_layers=2)
    report = fastpath.enable(model, strict=True)
    assert report.ok and report.layers == [] and report.generation is None


def test_disable_restores_transformers_choice():
    model = random_tiny_model("qwen3_5", num_layers=4)
    fastpath.disable(model)
    owner, name = entry_points(linear_attention_layers(model)[0][1])[CHUNK_RULE]
    before = getattr(owner, name)
    assert not getattr(before, "__flashdraft_backend__", False)
    fastpath.enable(model, strict=False)
    assert getattr(owner, name) is not before
    fastpath.disable(model)
    assert getattr(owner, name) is before


def test_dao_backend_missing_is_reported():
    try:
        import causal_conv1d  # noqa: F401

        pytest.skip("pip causal-conv1d is installed here")
    except ImportError:
        pass
    model = random_tiny_model("qwen3_5", num_layers=4)
    try:
        report = fastpath.enable(model, strict=False, conv_backend="dao")
        use = report.layers[0].ops["causal_conv1d_fn"]
        assert use.impl == TORCH and "causal_conv1d not importable" in use.reason
    finally:
        fastpath.disable(model)


def test_unknown_conv_backend_is_a_clear_error():
    model = random_tiny_model("qwen3_5", num_layers=4)
    with pytest.raises(ValueError, match="conv_backend must be one of"):
        fastpath.enable(model, conv_backend="cudnn")


@pytest.mark.parametrize("order", ["flashdraft-first", "transformers-first"])
def test_import_order_does_not_matter(order):
    imports = ["import flashdraft.fastpath", "import transformers.models.qwen3_5.modeling_qwen3_5"]
    if order == "transformers-first":
        imports.reverse()
    script = "\n".join(
        [
            *imports,
            "from flashdraft import fastpath",
            "from flashdraft.target.tiny import random_tiny_model",
            "import torch",
            "m = random_tiny_model('qwen3_5', num_layers=4, device='cuda' if torch.cuda.is_available() else 'cpu')",
            "r = fastpath.enable(m, strict=False)",
            "print(sorted({u.impl for l in r.layers for u in l.ops.values()}), len(r.layers))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expected = "['torch'] 3" if not CUDA else f"['{FLA}', '{FLASHDRAFT_TRITON}'] 3"  # fp32 on the GPU: fast too
    assert out.stdout.strip().splitlines()[-1] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_enable_on_gpu_is_fast_everywhere_and_close_to_torch(family):
    model = random_tiny_model(family, num_layers=8, dtype=torch.bfloat16, device="cuda", seed=2)
    ids = torch.randint(0, 256, (2, 300), device="cuda")
    fastpath.disable(model)
    expected = torch_reference_logits(model, ids).float()
    try:
        report = fastpath.enable(model, strict=True)
        assert report.ok
        for layer in report.layers:
            assert layer.ops["causal_conv1d_fn"].impl == FLASHDRAFT_TRITON
            assert layer.ops["causal_conv1d_update"].impl == FLASHDRAFT_TRITON
            assert layer.ops["chunk_gated_delta_rule"].impl == FLA
            assert layer.ops["fused_recurrent_gated_delta_rule"].impl == FLA
            assert layer.ops["gated_rms_norm"].impl == FLA
        with torch.no_grad():
            got = model(ids).logits.float()
        rel = (got - expected).norm() / expected.norm()
        assert rel < 2e-2, rel
    finally:
        fastpath.disable(model)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_probe_reaches_every_call_of_a_target_truncated_before_its_first_full_attention_layer(family, tmp_path):
    """A target loaded only up to layer 2 holds linear-attention layers only; transformers cannot ask that cache for
    its length, so the probe must still reach the decode-time calls (regression: found on the H200)."""
    from flashdraft.fastpath.probe import NOT_CALLED
    from flashdraft.target import load_frozen_target

    random_tiny_model(family, num_layers=4).save_pretrained(tmp_path)
    target = load_frozen_target(tmp_path, layer_ids=[0, 2], device="cpu")  # enables the fast path, not strict
    report = fastpath.probe(target.model)
    assert report.error == ""
    assert len(report.layers) == 3
    for layer in report.layers:
        for op, use in layer.ops.items():
            assert use.impl != NOT_CALLED, f"layer {layer.index}: {op} not reached ({use.reason})"
