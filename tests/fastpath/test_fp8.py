"""FP8 linears (`target.precision: fp8`): the row-wise quantization, the scaled GEMM against a float64 reference of
the same quantize -> matmul -> dequantize, which linears convert, and the probe's proof of them."""

import pytest
import torch

from flashdraft import fastpath
from flashdraft.fastpath import fp8
from flashdraft.target.tiny import random_tiny_model

CUDA = torch.cuda.is_available()
FP8_CAPABLE = CUDA and fp8.unsupported_reason(torch.device("cuda")) is None
# Every finite float8_e4m3fn value, for the nearest-value reference.
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).double()
E4M3_VALUES = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()


def _rows(m, k, seed=0):
    """Rows of very different magnitudes (1e-3 .. 1e3), one of them all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, m, dtype=torch.float64)[:, None]
    x[m // 2] = 0
    return x


def test_quantize_rows_rounds_each_row_to_the_nearest_fp8_value():
    x = _rows(37, 80)
    q, scale = fp8.quantize_rows(x.float())
    assert q.dtype == fp8.FP8 and q.shape == (37, 80) and scale.shape == (37, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(dim=1, keepdim=True)
    nonzero = amax[:, 0] > 0
    torch.testing.assert_close(scale.double()[nonzero], amax[nonzero] / 448.0, rtol=2e-7, atol=0)
    # Each row's largest element lands on +-448; every element on a nearest e4m3 value of x / scale (float64).
    y = x / scale.double()
    assert torch.equal(q.double().abs().amax(dim=1)[nonzero], torch.full((36,), 448.0, dtype=torch.float64))
    nearest = (y[..., None] - E4M3_VALUES).abs().amin(dim=-1)
    assert bool(((q.double() - y).abs() <= nearest + 1e-6 * y.abs()).all())
    # The zero row stays zero (a tiny scale, never 0/0).
    assert torch.equal(q[m := 37 // 2].double(), torch.zeros(80, dtype=torch.float64)) and bool(scale[m] > 0)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_the_float64_product_of_its_operands(bias):
    """On the CPU (float32 output): the module's output is the float64 (q_x s_x)(q_w s_w)^T + b to float32
    rounding, and that product stays within FP8's error of the unquantized linear."""
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=g) * torch.logspace(-2, 1, 48)[:, None])
        if bias:
            linear.bias.copy_(torch.randn(48, generator=g))
    module = fp8.FP8Linear.from_linear(linear)
    x = torch.randn(3, 7, 96, generator=g)
    out = module(x)
    assert out.shape == (3, 7, 48) and out.dtype == torch.float32
    q, s = fp8.quantize_rows(x.reshape(-1, 96))
    w = module.weight.double() * module.weight_scale.double().t()
    reference = (q.double() * s.double()) @ w.t() + (linear.bias.double() if bias else 0)
    torch.testing.assert_close(out.reshape(-1, 48).double(), reference, rtol=1e-5, atol=1e-5)
    exact = x.reshape(-1, 96).double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    assert (reference - exact).norm() / exact.norm() < 0.06


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_CAPABLE, reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("fast_accum", [True, False])
def test_fp8_linear_on_the_gpu_equals_the_float64_product_of_its_operands(fast_accum):
    """The row-scaled GEMM itself (bf16 output), odd token counts and Qwen-like widths."""
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(512, 1024, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1024, 512, generator=g) * 0.02)
    module = fp8.FP8Linear.from_linear(linear.to("cuda", torch.bfloat16), fast_accum=fast_accum)
    for tokens in (1, 37, 1000):
        x = (torch.randn(tokens, 512, generator=g) * torch.logspace(-2, 2, tokens)[:, None]).to("cuda", torch.bfloat16)
        out = module(x)
        assert out.dtype == torch.bfloat16 and out.shape == (tokens, 1024)
        q, s = fp8.quantize_rows(x)
        reference = (q.double() * s.double()) @ (module.weight.double() * module.weight_scale.double().t()).t()
        error = ((out.double() - reference).norm(dim=1) / reference.norm(dim=1)).max().item()
        assert error < 1e-2, error  # bf16 output rounding (~3e-3) and the GEMM's accumulation


def test_convert_linears_keeps_names_gates_embedding_and_head():
    model = random_tiny_model("qwen3_5", num_layers=4, dtype=torch.float32)
    before = {n: p.numel() for n, p in model.named_parameters()}
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    converted = fp8.convert_linears(model.model.layers)
    assert converted and all(n.rsplit(".", 1)[-1] not in fp8.KEEP_BF16 for n in converted)
    kinds = {n.rsplit(".", 1)[-1] for n in converted}
    assert {"in_proj_qkv", "out_proj", "gate_proj", "up_proj", "down_proj", "q_proj", "o_proj"} <= kinds, kinds
    # Parameter names and sizes unchanged (FLOP counts, module paths); the scales are buffers.
    assert {n: p.numel() for n, p in model.named_parameters()} == before
    for name, module in model.model.layers.named_modules():
        if name in converted:
            assert isinstance(module, fp8.FP8Linear) and module.weight.dtype == fp8.FP8
        elif isinstance(module, torch.nn.Linear):
            assert name.rsplit(".", 1)[-1] in fp8.KEEP_BF16 or module.out_features % 16 or module.in_features % 16
    assert model.get_input_embeddings().weight is embed and model.get_output_embeddings().weight is head
    assert embed.dtype == head.dtype == torch.float32


def test_probe_proves_the_fp8_linears_and_names_a_wrong_one():
    model = random_tiny_model("qwen3_5", num_layers=4, dtype=torch.float32)
    converted = fp8.convert_linears(model.model.layers)
    report = fastpath.probe(model)
    assert report.fp8 is not None and report.fp8.ok
    assert report.fp8.converted == report.fp8.proven == len(converted)
    assert "FP8 linears ran row-scaled FP8 GEMMs" in report.summary()
    assert report.to_dict()["fp8"]["ok"] is True
    # A linear whose output is not its GEMM's (a wrong scale or layout) is named, and the report is not ok.
    wrong = model.model.layers[0].mlp.down_proj
    wrong.forward = lambda x, forward=wrong.forward: 1.5 * forward(x)
    report = fastpath.probe(model)
    assert not report.ok and report.fp8.proven == len(converted) - 1
    assert "0.mlp.down_proj: error" in report.failure_message()


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_CAPABLE, reason="needs a GPU with FP8 tensor cores")
def test_probe_proves_fp8_linears_beside_the_fast_kernels_on_the_gpu():
    """The proven path on a GPU: every linear-attention call on a fast kernel and every FP8 linear checked."""
    model = random_tiny_model("qwen3_5", num_layers=4, dtype=torch.bfloat16, device="cuda")
    fastpath.enable(model, strict=True)
    converted = fp8.convert_linears(model.model.layers)
    report = fastpath.enable(model, strict=True)
    assert report.ok and report.fp8.proven == len(converted) > 0, report.summary()


def test_unsupported_devices_are_named():
    assert "cpu device has no FP8" in fp8.unsupported_reason(torch.device("cpu"))
