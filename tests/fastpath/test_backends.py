"""Per-call backend choice of the delta rule: when gradients are needed and fla refuses its backward, use torch."""

from __future__ import annotations

import pytest
import torch

from flashdraft.fastpath import backends, record
from flashdraft.fastpath.patch import Unpatched, linear_attention_layers, modeling_module
from flashdraft.target.tiny import random_tiny_model


@pytest.fixture
def chunk_rule(monkeypatch):
    """The device-aware chunk rule with a stand-in fla kernel that a CPU can run, and a known backward problem."""
    calls = []

    def fake_fla_chunk(q, k, v, g, beta, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(v), None

    monkeypatch.setattr(backends, "_fla_ops", lambda: ((fake_fla_chunk, None), ""))
    monkeypatch.setattr(backends, "_device_reason", lambda *t: "")
    monkeypatch.setattr(backends, "fla_chunk_backward_problem", lambda: "fallback: fla #640 stand-in")
    model = random_tiny_model("qwen3_5", num_layers=4)
    layer = linear_attention_layers(model)[0][1]
    # Unpatched: an earlier test in this process may have patched the module (its calls are then ours).
    fns = backends.make_backends(backends.torch_fallbacks(Unpatched(modeling_module(layer))))
    return fns[backends.CHUNK_RULE], calls


def _inputs(requires_grad: bool):
    torch.manual_seed(0)
    b, t, h, d = 1, 6, 2, 8
    q, k, v = (torch.randn(b, t, h, d, requires_grad=requires_grad) for _ in range(3))
    g = -torch.rand(b, t, h)
    beta = torch.rand(b, t, h)
    return q, k, v, g, beta


@pytest.mark.parametrize("requires_grad", [False, True])
def test_chunk_rule_falls_back_only_when_gradients_are_needed(chunk_rule, requires_grad):
    fn, calls = chunk_rule
    with record.listening() as log:
        log.layer = 0
        out, _ = fn(*_inputs(requires_grad), use_qk_l2norm_in_kernel=True)
    impl, reason = log.calls[0][backends.CHUNK_RULE][0]
    if requires_grad:
        assert (impl, reason) == (backends.TORCH, "fallback: fla #640 stand-in")
        assert calls == [] and out.abs().sum() > 0  # the torch reference ran, not the stand-in
        out.sum().backward()
    else:
        assert impl == backends.FLA and len(calls) == 1


def test_chunk_rule_keeps_fla_under_no_grad_even_with_trainable_inputs(chunk_rule):
    fn, calls = chunk_rule
    with torch.no_grad():
        fn(*_inputs(True), use_qk_l2norm_in_kernel=True)
    assert len(calls) == 1
