"""The measured τ of training: real speculative decoding with the drafter being trained (the evaluator)."""

import json

import pytest
import torch

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.speculative import generate
from flashdraft.speculative.prompts import load_prompts
from flashdraft.train import setup
from flashdraft.train.evaluation import Evaluator, eval_prompts_path


def test_measured_tau_counts_tokens_per_target_forward_over_all_prompts(tmp_path):
    """The τ training prints is `flashdraft eval`'s: every prompt's accepted tokens over every prompt's rounds. A mean
    of the prompts' own τ differs whenever the prompts do (one the target repeats can reach the block size)."""
    cfg = load_config(bundled.ASSETS / "train.yaml", [f"log.out={tmp_path}", "data.eval_limit=4"])
    s = setup.setup(cfg, tmp_path, None)
    evaluator = Evaluator(cfg, s, tmp_path)
    tau = evaluator.evaluate(final=True)
    assert s.drafter.training  # left as training found it
    drafter = s.drafter.eval()
    accepted, rounds, own = 0, 0, []
    for prompt in load_prompts(bundled.eval_prompts(), s.tokenizer, 4):
        with torch.no_grad():
            result = generate(evaluator.full_target, drafter, prompt.input_ids, cfg.data.eval_max_new_tokens)
        accepted, rounds = accepted + sum(result.acceptance_lengths), rounds + result.num_rounds
        own.append(result.tau)
    assert tau == pytest.approx(accepted / rounds, rel=1e-12)
    assert max(own) - min(own) > 1  # prompts this unlike each other tell the two counts apart
    assert tau != pytest.approx(sum(own) / len(own), rel=1e-3)
    assert json.loads((tmp_path / "measured_tau.json").read_text()) == {"tau": tau, "per_prompt": own}


def test_which_prompts_a_run_evaluates_on(tmp_path):
    def cfg(*extra):
        return load_config(bundled.ASSETS / "train.yaml", [f"log.out={tmp_path}", *extra])

    assert eval_prompts_path(cfg()) == str(bundled.eval_prompts())
    # The bundled prompts are held out from the bundled data only: another run's data may hold them.
    assert eval_prompts_path(cfg("data.train=[other.jsonl]")) is None
    assert eval_prompts_path(cfg("data.eval_prompts=null")) is None
    assert eval_prompts_path(cfg("data.eval_prompts=p.jsonl")) == "p.jsonl"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measured_tau_on_gpu_decodes_the_master_weights_on_the_engine(monkeypatch, tmp_path):
    """What stopped a run's closing τ on the H200: the float32 master weights beside the bf16 target went into the
    engine under autocast (bf16 keys into a float32 cache). The engine now decodes a bf16 copy of them; the τ is
    the shipped drafter's real one, and the training drafter is left as it was."""
    from flashdraft.benchmarks import train_step as bench
    from flashdraft.speculative.engine import session as engine_loop

    cfg = load_config(bundled.ASSETS / "train.yaml", ["train.device=cuda", "data.eval_limit=4"])
    target, tokenizer = bench.load_bench_target(cfg)
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=1)
    assert next(s.drafter.parameters()).dtype == torch.float32
    decoded_with = []
    engine_decode = engine_loop.engine_decode
    monkeypatch.setattr(
        engine_loop, "engine_decode", lambda *a, **kw: decoded_with.append(kw["drafter"]) or engine_decode(*a, **kw)
    )
    tau = Evaluator(cfg, s, tmp_path).evaluate()
    assert [next(d.parameters()).dtype for d in decoded_with] == [torch.bfloat16] * 4
    assert tau > 2.0  # the shipped drafter: ~4.7 on the held-out prompts; a copy without its weights drafts ~1.0
    assert s.drafter.training and next(s.drafter.parameters()).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measured_tau_replays_one_set_of_cuda_graphs_across_evaluations(tmp_path):
    """A run measures τ several times (log.eval_every, then at the end): the engine and the drafter's bf16 copy are
    captured once, and each evaluation refreshes the copy in place — the τ of the reused graphs equals that of a
    freshly captured session with the same (changed) weights."""
    from flashdraft.benchmarks import train_step as bench
    from flashdraft.speculative.engine import session as engine_loop

    cfg = load_config(bundled.ASSETS / "train.yaml", ["train.device=cuda", "data.eval_limit=3"])
    target, tokenizer = bench.load_bench_target(cfg)
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=1)
    evaluator = Evaluator(cfg, s, tmp_path)
    evaluator.evaluate()
    session = engine_loop.current_session(evaluator.full_target)
    graphs = [step.graph for step in session.engine.steps.values()] + [r.step.graph for r in session.runners.values()]
    assert session.captured and len(session.runners) == 1 and all(g is not None for g in graphs)
    with torch.no_grad():  # training moves the weights between evaluations
        generator = torch.Generator(device="cuda").manual_seed(0)
        for p in s.drafter.parameters():
            p.add_(torch.randn(p.shape, device=p.device, generator=generator) * 0.1 * p.std().nan_to_num())
    reused = evaluator.evaluate()
    again = engine_loop.current_session(evaluator.full_target)
    assert again is session and len(session.runners) == 1
    assert [step.graph for step in session.engine.steps.values()] + [
        r.step.graph for r in session.runners.values()
    ] == graphs
    engine_loop.drop_session(evaluator.full_target)
    evaluator.decoder = None
    assert evaluator.evaluate() == reused
