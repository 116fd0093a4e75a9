"""The measured τ of training: real speculative decoding with the drafter being trained."""

import pytest
import torch

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.train.tau import measure_tau


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measured_tau_on_gpu_decodes_the_master_weights_on_the_engine(monkeypatch):
    """What stopped a run's closing τ on the H200: the float32 master weights beside the bf16 target went into the
    engine under autocast (bf16 keys into a float32 cache). The engine now decodes a bf16 copy of them; the τ is
    the shipped drafter's real one, and the training drafter is left as it was."""
    from flashdraft.speculative.engine import session as engine_loop
    from flashdraft.train import step_timing

    cfg = load_config(bundled.ASSETS / "train.yaml", ["train.device=cuda", "data.eval_limit=4"])
    target, tokenizer = step_timing.load_bench_target(cfg)
    s = step_timing.bench_setup(cfg, target, tokenizer=tokenizer, steps=1)
    assert next(s.drafter.parameters()).dtype == torch.float32
    decoded_with = []
    engine_decode = engine_loop.engine_decode
    monkeypatch.setattr(
        engine_loop, "engine_decode", lambda *a, **kw: decoded_with.append(kw["drafter"]) or engine_decode(*a, **kw)
    )
    tau = measure_tau(cfg, s)
    assert [next(d.parameters()).dtype for d in decoded_with] == [torch.bfloat16] * 4
    assert tau > 2.0  # the shipped drafter: ~4.7 on the held-out prompts; a copy without its weights drafts ~1.0
    assert s.drafter.training and next(s.drafter.parameters()).dtype == torch.float32
