"""The evaluation of training: the held-out set scored the same way every time, and the measured τ of real
speculative decoding with the drafter being trained."""

import json
import logging

import pytest
import torch

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.speculative import generate
from flashdraft.speculative.prompts import load_prompts
from flashdraft.train import evaluation, setup
from flashdraft.train.evaluation import Evaluator, eval_prompts_path, heldout_anchors
from tests import SHIPPED_DRAFTER

# More anchors than continuation tokens: every continuation token starts a held-out block.
SHORT = ["data.eval_limit=3", "data.eval_max_new_tokens=24", "recipe.num_anchors=32"]


def _cfg(out, *extra):
    return load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, f"log.out={out}", *SHORT, *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Setup of the bundled default and one evaluation of its (shipped) drafter."""
    out = tmp_path_factory.mktemp("eval")
    cfg = _cfg(out)
    s = setup.setup(cfg, out, None)
    evaluator = Evaluator(cfg, s, out)
    return cfg, s, out, evaluator, evaluator.evaluate()


def test_measured_tau_counts_tokens_per_target_forward_over_all_prompts(run):
    """The τ training prints is `flashdraft eval`'s: every prompt's accepted tokens over every prompt's rounds. A mean
    of the prompts' own τ differs whenever the prompts do (one the target repeats can reach the block size)."""
    cfg, s, out, evaluator, scores = run
    drafter = s.drafter.eval()
    accepted, rounds, own = 0, 0, []
    for prompt in load_prompts(bundled.eval_prompts(), s.tokenizer, 3):
        with torch.no_grad():
            result = generate(evaluator.full_target, drafter, prompt.input_ids, cfg.data.eval_max_new_tokens)
        accepted, rounds = accepted + sum(result.acceptance_lengths), rounds + result.num_rounds
        own.append(result.tau)
    s.drafter.train()
    assert scores["tau"] == pytest.approx(accepted / rounds, rel=1e-12)
    assert max(own) - min(own) > 0.5  # prompts this unlike each other tell the two counts apart
    assert scores["tau"] != pytest.approx(sum(own) / len(own), rel=1e-3)
    assert json.loads((out / "measured_tau.json").read_text()) == {"tau": scores["tau"], "per_prompt": own}


def test_the_heldout_rows_are_the_prompts_and_the_targets_greedy_continuations(run):
    """Greedy speculative decoding is lossless: the rows the loss is scored on are the target's own greedy text."""
    cfg, s, out, evaluator, scores = run
    assert scores["heldout_prompts"] == 3 and len(evaluator.rows) == 3
    full = evaluator.full_target
    for prompt, continuation in evaluator.rows:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            greedy = full.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(prompt) :]
        assert continuation == greedy.tolist()
    saved = json.loads((out / "heldout.json").read_text())
    assert saved["continuations"] == [c for _, c in evaluator.rows] and saved["max_new_tokens"] == 24


def test_evaluating_again_gives_the_same_scores_and_leaves_the_drafter_training(run):
    cfg, s, out, evaluator, scores = run
    assert evaluator.evaluate() == scores
    assert s.drafter.training
    # A new evaluator (a resumed run) reads the saved rows: the same set, without decoding them anew.
    again = Evaluator(cfg, s, out)
    assert again.evaluate() == scores and again.rows == evaluator.rows


def test_the_heldout_loss_is_the_training_objective_on_fixed_blocks(run):
    """The held-out loss and simulated τ are those of the stats `heldout_stats` sums, and a drafter that drafts
    worse scores worse on both."""
    cfg, s, out, evaluator, scores = run
    stats = evaluator.heldout_stats(s.drafter)
    assert scores["heldout_loss"] == pytest.approx(float(stats.loss_sum / stats.weight_sum), rel=1e-6)
    assert scores["heldout_sim_tau"] == pytest.approx(float(stats.tau()), rel=1e-6) and scores["heldout_sim_tau"] > 1.5
    # Every continuation token is labelled by some block: anchors run from the prompt's last token on.
    assert int(stats.valid[1]) == 3 * 24  # position 1 of the blocks: every continuation token once
    saved = {k: v.clone() for k, v in s.drafter.state_dict().items()}
    try:
        with torch.no_grad():
            for p in s.drafter.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5 * p.std().nan_to_num())
        worse = evaluator.heldout_stats(s.drafter)
    finally:
        s.drafter.load_state_dict(saved)
    assert float(worse.loss_sum / worse.weight_sum) > scores["heldout_loss"] and float(worse.tau()) < float(stats.tau())


def test_heldout_anchors_start_at_the_prompts_end_and_spread_evenly():
    assert heldout_anchors(5, 12, 32).tolist() == [4, 5, 6, 7, 8, 9, 10]
    spread = heldout_anchors(10, 110, 8)
    assert spread.tolist()[0] == 9 and spread.tolist()[-1] == 108 and spread.numel() == 8
    assert (spread.diff() >= 13).all()


def test_saved_rows_of_other_prompts_are_decoded_anew(run, tmp_path, caplog):
    cfg, s, out, evaluator, scores = run
    saved = json.loads((out / "heldout.json").read_text())
    (tmp_path / "heldout.json").write_text(json.dumps(saved | {"max_new_tokens": 25}))
    other = Evaluator(cfg, s, tmp_path)
    other.prompts = evaluator.prompts
    with caplog.at_level(logging.WARNING, logger="flashdraft.train.evaluation"):
        assert other._saved_rows() is None
    assert "other prompts or lengths" in caplog.text


def test_which_prompts_a_run_evaluates_on(tmp_path):
    assert eval_prompts_path(_cfg(tmp_path)) == str(bundled.eval_prompts())
    # The bundled prompts are held out from the bundled data only: another run's data may hold them.
    assert eval_prompts_path(_cfg(tmp_path, "data.train=[other.jsonl]")) is None
    assert eval_prompts_path(_cfg(tmp_path, "data.eval_prompts=null")) is None
    assert eval_prompts_path(_cfg(tmp_path, "data.eval_prompts=p.jsonl")) == "p.jsonl"
    assert evaluation.HELDOUT == "heldout.json"


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
    scores = Evaluator(cfg, s, tmp_path).evaluate()
    assert [next(d.parameters()).dtype for d in decoded_with] == [torch.bfloat16] * 4
    assert scores["tau"] > 2.0  # the shipped drafter drafts well here; a copy without its weights drafts ~1.0
    assert s.drafter.training and next(s.drafter.parameters()).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measured_tau_replays_one_set_of_cuda_graphs_across_evaluations(tmp_path):
    """A run evaluates several times (step 0, log.eval_every, the end): the engine and the drafter's bf16 copy are
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
    reused = evaluator.evaluate()["tau"]
    again = engine_loop.current_session(evaluator.full_target)
    assert again is session and len(session.runners) == 1
    assert [step.graph for step in session.engine.steps.values()] + [
        r.step.graph for r in session.runners.values()
    ] == graphs
    engine_loop.drop_session(evaluator.full_target)
    evaluator.decoder = None
    assert evaluator.evaluate()["tau"] == reused
