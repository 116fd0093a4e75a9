"""The training loop end to end on the bundled default (CPU): outputs, exact resume, clear failures."""

import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from flashdraft import bundled
from flashdraft.config import load_config, to_dict
from flashdraft.target import load_causal_lm
from flashdraft.telemetry.metrics import before_after, describe_before_after
from flashdraft.train import forward, loop
from flashdraft.train.dataloader import DataLoader
from tests import SHIPPED_DRAFTER
from tests.telemetry.drawn import curve_pixels, shown

PLOT = importlib.util.find_spec("matplotlib") is not None  # the plot extra; without it no curve, and a notice
# Decoding with the shipped drafter on the bundled target: a step's simulated tau was 1.48-3.75 and the measured tau
# 1.75 (one prompt, 8 tokens) when written; a drafter that accepts nothing gives about 1.0.
TAU_FLOOR = 1.3
SHORT = [
    "train.max_steps=6",
    "log.every=1",
    "log.checkpoint_every=3",
    "data.eval_limit=1",
    "data.eval_max_new_tokens=8",
]


def _cfg(out, *extra):
    return load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *SHORT, f"log.out={out}", *extra])


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
    """The training batches' loss of each logged step."""
    return {r["step"]: r["loss"] for r in _records(out) if "loss" in r}


def _scores(out):
    """The evaluations' scores of each evaluated step."""
    keys = ("heldout_loss", "heldout_sim_tau", "tau", "heldout_prompts")
    return {r["step"]: {k: r[k] for k in keys if k in r} for r in _records(out) if "heldout_loss" in r}


def _batch(cfg, s, data, step=0):
    """The micro-batches of `step` that a run of `cfg` on Setup `s` reads from `data`."""
    return DataLoader.from_config(cfg, data, s.drafter, s.device).batch(step)


def _training_calls(real, action):
    """`real` (the loss) wrapped to call `action(n, loss, stats)` on the n-th call of a training step (evaluations
    run without gradients and are not counted); `action` returns the (loss, stats) to hand back."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        if not torch.is_grad_enabled():
            return loss, stats
        calls["n"] += 1
        return action(calls["n"], loss, stats)

    return wrapped


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    result = loop.train(_cfg(out))
    return out, result


def test_outputs_of_a_run(full_run):
    out, result = full_run
    assert result.steps == 6 and result.checkpoint.name == "step_00000006"
    records = _records(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]  # step 0: the evaluation before training
    rows = records[1:]
    for r in rows:
        assert {"loss", "sim_tau", "acc", "tok_s", "draft_tok_s", "lr"} <= set(r)
        # The shipped drafter accepts more than one token per block on its own data (a random one: about 1.0).
        assert r["loss"] > 0 and r["sim_tau"] > TAU_FLOOR and len(r["acc"]) == 15  # block 16: positions 1..15
    if PLOT:
        loss, tau = curve_pixels(out / "training_curve.png")
        assert loss.sum() > 20 and tau.sum() > 20
        # What the curve says it shows is the run's own before and after (the PNG's text, read with PIL).
        text = shown(out / "training_curve.png")
        assert json.loads(text["flashdraft:before_after"]) == result.change
        assert text["Title"] == describe_before_after(result.change)
    else:
        assert result.curve is None and not (out / "training_curve.png").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000006"]
    assert (out / "checkpoints" / "step_00000006" / "drafter" / "model.safetensors").is_file()
    # The data loader's place is saved beside the loop's: a resumed run reads on from it.
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state == {"step": 3, "data": {"step": 3, "seed": 0, "sequences_per_step": 4, "samples": 763}}
    assert result.measured_tau is not None and result.measured_tau > TAU_FLOOR
    assert json.loads((out / "measured_tau.json").read_text())["tau"] == result.measured_tau
    # Evaluated before the first step and after the last, on the one held-out prompt; the result compares the two.
    scores = _scores(out)
    assert list(scores) == [0, 6] and scores[6]["tau"] == result.measured_tau
    assert all(
        s["heldout_prompts"] == 1 and s["heldout_loss"] > 0 and s["heldout_sim_tau"] > 1 for s in scores.values()
    )
    assert result.change == {
        "steps": [0, 6],
        "prompts": 1,
        **{k: [scores[0][k], scores[6][k]] for k in ("heldout_loss", "heldout_sim_tau", "tau")},
    }
    assert "held-out loss" in result.summary() and "on 1 prompts (step 0 → 6)" in result.summary()
    heldout = json.loads((out / "heldout.json").read_text())
    assert [len(c) for c in heldout["continuations"]] == [8]  # data.eval_max_new_tokens of the target's greedy text
    # The bundled default fine-tunes the shipped drafter, trained for the shipped target: its first loss is far
    # below even a uniform guess's log(vocab) (the next test: a fresh drafter's is far above it).
    log_vocab = torch.log(torch.tensor(1088.0)).item()
    assert rows[0]["loss"] < log_vocab - 2.5


def test_a_fresh_drafter_starts_far_above_the_shipped_one(full_run, tmp_path):
    result = loop.train(
        _cfg(tmp_path / "fresh", "drafter.init_from=null", "train.max_steps=1", "data.eval_prompts=null")
    )
    (row,) = [json.loads(line) for line in (tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()]
    # Untrained hidden states through the trained (tied, large-norm) LM head: confidently wrong, worse than uniform.
    log_vocab = torch.log(torch.tensor(1088.0)).item()
    assert result.steps == 1 and math.isfinite(row["loss"]) and row["loss"] > log_vocab
    assert row["loss"] > _losses(full_run[0])[1] + 4


def test_resume_repeats_an_uninterrupted_run_exactly(full_run, tmp_path):
    full, _ = full_run
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")  # as if killed after the step-3 checkpoint
    loop.train(_cfg(resumed), resume=True)
    assert _losses(resumed) == _losses(full)  # steps 1-3 kept from before, 4-6 recomputed: bit-identical
    assert _scores(resumed) == _scores(full)  # step 0 kept, the end's on the same held-out rows
    a = load_file(full / "checkpoints" / "step_00000006" / "drafter" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_00000006" / "drafter" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_periodic_real_tau_is_logged_and_leaves_training_unchanged(full_run, tmp_path):
    full, _ = full_run
    out = tmp_path / "periodic"
    loop.train(_cfg(out, "log.eval_every=3"))
    scores = _scores(out)
    assert list(scores) == [0, 3, 6]  # before the first step, every 3 steps, and at the end
    assert scores[3]["tau"] > TAU_FLOOR
    assert _losses(out) == _losses(full)  # evaluating in between draws no training randomness
    assert scores[0] == _scores(full)[0] and scores[6] == _scores(full)[6]


def test_the_heldout_loss_alone_is_scored_between_the_measured_tau_and_leaves_training_unchanged(full_run, tmp_path):
    full, _ = full_run
    out = tmp_path / "heldout"
    loop.train(_cfg(out, "log.heldout_every=2"))
    scores = _scores(out)
    assert list(scores) == [0, 2, 4, 6]
    assert [("tau" in scores[step]) for step in scores] == [True, False, False, True]  # no decoding in between
    assert _losses(out) == _losses(full)
    assert scores[0] == _scores(full)[0] and scores[6] == _scores(full)[6]
    losses = [scores[step]["heldout_loss"] for step in scores]
    assert len(set(losses)) == len(losses)  # each scored the drafter of its own step
    assert describe_before_after(before_after(_records(out))) == describe_before_after(before_after(_records(full)))


def test_eval_every_must_be_a_multiple_of_log_every(tmp_path):
    from flashdraft.config import ConfigError

    with pytest.raises(ConfigError, match="log.eval_every = 3: must be 0 or a multiple of log.every \\(2\\)"):
        _cfg(tmp_path, "log.every=2", "log.eval_every=3")


def test_non_finite_loss_stops_naming_the_last_checkpoint(tmp_path, monkeypatch):
    def poison(n, loss, stats):
        if n > 4:  # after the step-3 checkpoint
            stats.loss_sum = stats.loss_sum * float("nan")
        return loss, stats

    monkeypatch.setattr(forward, "dflash_loss", _training_calls(forward.dflash_loss, poison))
    with pytest.raises(loop.TrainingError, match=r"non-finite loss or gradient at step 5.*checkpoint: .*step_00000003"):
        loop.train(_cfg(tmp_path / "nan"))


def test_non_finite_steps_can_be_skipped_and_counted(tmp_path, monkeypatch):
    def poison(n, loss, stats):
        if n in (2, 4):  # steps 2 and 4 (one micro-batch per step)
            loss = loss * float("nan")
            stats.loss_sum = stats.loss_sum * float("nan")
        return loss, stats

    monkeypatch.setattr(forward, "dflash_loss", _training_calls(forward.dflash_loss, poison))
    out = tmp_path / "skip"
    loop.train(_cfg(out, "train.on_nonfinite=skip"))
    assert [r["skipped"] for r in _records(out) if "skipped" in r] == [0, 1, 1, 2, 2, 2]
    weights = load_file(out / "checkpoints" / "step_00000006" / "drafter" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())  # no NaN update was applied


def _signal_at_call(monkeypatch, n: int, sig=signal.SIGTERM):
    """Send `sig` to this process from inside the n-th loss computation of a step (as a scheduler would, mid-step)."""

    def signal_at(count, loss, stats):
        if count == n:
            os.kill(os.getpid(), sig)
        return loss, stats

    monkeypatch.setattr(forward, "dflash_loss", _training_calls(forward.dflash_loss, signal_at))


def test_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(full_run, tmp_path, monkeypatch):
    full, _ = full_run
    out = tmp_path / "stopped"
    _signal_at_call(monkeypatch, 4)  # during step 4
    before = signal.getsignal(signal.SIGTERM)
    result = loop.train(_cfg(out))
    assert result.stopped_by == "SIGTERM" and result.steps == 4 and result.measured_tau is None
    assert result.checkpoint.name == "step_00000004"  # not a checkpoint_every step: written because of the stop
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is removed after the run
    monkeypatch.undo()
    loop.train(_cfg(out), resume=True)
    assert _losses(out) == _losses(full)


def test_a_stop_logs_the_steps_since_the_last_log_line(tmp_path, monkeypatch):
    _signal_at_call(monkeypatch, 2, signal.SIGINT)
    result = loop.train(_cfg(tmp_path / "stopped", "log.every=5"))
    assert result.stopped_by == "SIGINT" and result.steps == 2
    assert list(_losses(tmp_path / "stopped")) == [2]
    assert (tmp_path / "stopped" / "training_curve.png").is_file() == PLOT


def test_cli_runs_the_bundled_default_and_reports(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashdraft",
            "train",
            "--out",
            str(tmp_path / "cli"),
            *SHORT[:1],
            "data.eval_limit=1",
            "data.eval_max_new_tokens=8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "simulated τ" in out.stdout and "measured τ" in out.stdout
    # Before and after, side by side: the held-out loss and the measured τ of step 0 and of the last step.
    (change,) = [line for line in out.stdout.splitlines() if line.startswith("held-out loss ")]
    assert " → " in change and "measured τ" in change and "on 1 prompts (step 0 → 6)" in change, change
    assert ("training_curve.png" in out.stdout) == PLOT
    # Time to the first step, once: since the command's start, split into setup (by phase) and the step itself.
    first = [line for line in out.stderr.splitlines() if line.startswith("first step after ")]
    assert len(first) == 1 and "the step itself" in first[0], out.stderr[-2000:]
    assert all(f"{phase} " in first[0] for phase in ("target", "fast-path probe", "data", "drafter", "evaluation"))
    # Where the whole run went: one closing line, and the same in wall_time.json, every phase a run has.
    assert sum(line.startswith("wall time ") for line in out.stderr.splitlines()) == 1, out.stderr[-2000:]
    wall = json.loads((tmp_path / "cli" / "wall_time.json").read_text())
    phases = ["target", "fast-path probe", "data", "drafter", "evaluation", "first step", "checkpoints", "steps"]
    assert list(wall["phases_s"]) == [*phases, "plot"]  # drawn, or a notice without matplotlib
    assert all(s >= 0 for s in wall["phases_s"].values()) and wall["other_s"] >= 0
    assert wall["total_s"] == pytest.approx(sum(wall["phases_s"].values()) + wall["other_s"], abs=0.01)


@pytest.mark.parametrize(
    "args, message",
    [
        (["drafter.block_size=1"], "drafter.block_size = 1"),
        (["train.device=cuda"] if not torch.cuda.is_available() else ["train.device=tpu"], "train.device"),
        (["--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
    ],
)
def test_cli_bad_input_exit_2(tmp_path, args, message):
    out = subprocess.run(
        [sys.executable, "-m", "flashdraft", "train", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr


class _Ragged:
    """Sequences of different lengths, each with a 5-token prompt (no loss): the `TokenizedDataset` reads."""

    def __init__(self, lengths, vocab):
        gen = torch.Generator().manual_seed(3)
        self.rows = [torch.randint(0, vocab, (n,), generator=gen).numpy() for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        mask = torch.ones(len(self.rows[i]), dtype=torch.uint8)
        mask[:5] = 0
        return self.rows[i], mask.numpy()

    def epoch_order(self, epoch, seed, *args, **kwargs):
        return list(range(len(self.rows)))


class _NoUpdate:
    """An optimizer that leaves the drafter as it is (the step's inputs are what a test checks) and clears its
    gradients as the loop asks."""

    def __init__(self, drafter):
        self.drafter = drafter

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        self.drafter.zero_grad(set_to_none=set_to_none)


def test_static_shapes_pad_without_changing_loss_or_gradients():
    """train.static_shapes pads each micro-batch to data.max_length positions and recipe.num_anchors blocks: the
    drafter sees that one shape, and the step's loss and gradients are those of the unpadded batch. On the CPU, in
    float32, where the padding changes no kernel's reduction order (on a GPU it does, by ~3e-5 relative: the GPU
    test below compares within bf16 tolerances instead)."""
    from flashdraft.benchmarks import train_step as bench

    overrides = [
        "data.max_length=40",
        "recipe.num_anchors=6",
        "train.batch_size=2",
        "train.grad_accum=2",
        "train.device=cpu",
    ]
    cfg = {
        static: load_config(
            bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *overrides, f"train.static_shapes={static}"]
        )
        for static in ("false", "true")
    }
    target, tokenizer = bench.load_bench_target(cfg["false"])
    s = bench.bench_setup(cfg["false"], target, tokenizer=tokenizer, steps=2)
    data = _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0])
    shapes = []
    s.drafter.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["position_ids"].shape)), with_kwargs=True
    )

    class Keep:  # stands in for the optimizer: keeps the step's gradients instead of applying them
        def step(self):
            self.grads = {n: p.grad.clone() for n, p in s.drafter.named_parameters()}

        def zero_grad(self, set_to_none=True):
            s.drafter.zero_grad(set_to_none=set_to_none)

    runs = {}
    for static, run_cfg in cfg.items():
        shapes.clear()
        keep = Keep()
        stats, tokens, finite = loop.train_step(s, run_cfg, keep, _batch(run_cfg, s, data))
        assert finite
        runs[static] = (stats, tokens, keep.grads, list(shapes))
    (plain, tokens, grads, plain_shapes), (padded, padded_tokens, padded_grads, padded_shapes) = runs.values()
    block = s.drafter.block_size
    assert padded_shapes == [(2, 40 + 6 * block)] * 2 and all(shape != (2, 40 + 6 * block) for shape in plain_shapes)
    assert tokens == padded_tokens == 23 + 31 + 17 + 29  # the padding is not counted as sequence tokens
    torch.testing.assert_close(padded.loss_sum, plain.loss_sum, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_recipe_objective_reaches_the_loss(monkeypatch):
    """recipe.loss / loss_weighting / anchor_sampling reach the step: every micro-batch's loss gets the recipe's
    objective and, for D-PACE, the step's labelled blocks (both micro-batches) as its denominator."""
    from flashdraft.benchmarks import train_step as bench
    from flashdraft.train.loss import Objective
    from flashdraft.train.loss.objective import labelled_blocks

    recipe = ["recipe.loss=lk", "recipe.lk_eta=2", "recipe.loss_weighting=dpace", "recipe.anchor_sampling=stratified"]
    overrides = ["data.max_length=40", "recipe.num_anchors=3", "train.batch_size=2", "train.grad_accum=2"]
    cfg = load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *overrides, "train.device=cpu", *recipe])
    target, tokenizer = bench.load_bench_target(cfg)
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=2)
    data = _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0])
    calls = []
    real = forward.dflash_loss

    def spy(hidden, head, labels, weights, **kwargs):
        calls.append((labelled_blocks(labels, kwargs["block_size"]).sum().item(), kwargs))
        return real(hidden, head, labels, weights, **kwargs)

    monkeypatch.setattr(forward, "dflash_loss", spy)

    stats, _, finite = loop.train_step(s, cfg, _NoUpdate(s.drafter), _batch(cfg, s, data))
    assert finite and len(calls) == 2
    blocks = sum(count for count, _ in calls)
    assert blocks == 4 * 3  # every sequence has room for its 3 anchors
    for _, kwargs in calls:
        assert kwargs["objective"] == Objective("lk", 2.0, "dpace", 0.5)
        assert float(kwargs["denominator"]) == blocks
    assert float(stats.weight_sum) == blocks == int(stats.blocks)


def test_target_labels_reach_the_loss_as_the_targets_final_states(monkeypatch):
    """recipe.labels = target: each labelled query's teacher state is the whole target's final hidden state at the
    position before its label (checked against a fresh full model's output_hidden_states), over ragged micro-batches,
    and the loss is the distribution loss, not the token loss."""
    from flashdraft.benchmarks import train_step as bench

    overrides = ["data.max_length=40", "recipe.num_anchors=3", "train.batch_size=2", "train.grad_accum=2"]
    cfg = load_config(
        bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *overrides, "train.device=cpu", "recipe.labels=target"]
    )
    target, tokenizer = bench.load_bench_target(cfg)
    assert len(target.decoder.layers) == target.num_target_layers  # nothing truncated
    s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=2)
    data = _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0])
    seen = {"ids": [], "batches": [], "losses": []}
    real_capture, real_before, real_loss = target.capture, forward.before_labels, forward.dflash_loss

    def capture(ids, attn=None, **kwargs):
        seen["ids"].append((ids, attn))
        return real_capture(ids, attn, **kwargs)

    def before(states, batch):
        seen["batches"].append(batch)
        return real_before(states, batch)

    def loss(hidden, head, labels, weights, **kwargs):
        seen["losses"].append((labels, kwargs["teacher_hidden"]))
        token, _ = real_loss(hidden, head, labels, weights, **{**kwargs, "teacher_hidden": None})
        soft, stats = real_loss(hidden, head, labels, weights, **kwargs)
        assert (soft - token).abs() > 1e-6
        return soft, stats

    monkeypatch.setattr(target, "capture", capture)
    monkeypatch.setattr(forward, "before_labels", before)
    monkeypatch.setattr(forward, "dflash_loss", loss)

    _, _, finite = loop.train_step(s, cfg, _NoUpdate(s.drafter), _batch(cfg, s, data))
    assert finite and len(seen["losses"]) == 2
    full = load_causal_lm(bundled.BUNDLED, dtype=torch.float32, device="cpu")
    checked = 0
    for (ids, attn), batch, (labels, teacher) in zip(seen["ids"], seen["batches"], seen["losses"], strict=True):
        with torch.no_grad():
            final = full(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[-1]
        positions = batch.position_ids[:, batch.ctx_len :]
        for b, q in (labels != -100).nonzero().tolist():
            pos = int(positions[b, q])
            assert ids[b, pos] == labels[b, q] and attn[b, pos] == 1
            torch.testing.assert_close(teacher[b, q], final[b, pos - 1], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 4 * 3 * 10  # 12 blocks, most of their 15 positions labelled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_flex_steps_over_ragged_batches_on_gpu():
    """What stopped a compiled FlexAttention run on the H200 at its second step: the batch shape changed. Under
    train.compile the shapes are static (train.static_shapes=auto), and each step's loss is the eager SDPA loss of
    the unpadded batch, up to bf16 rounding. The fast run also compiles the target's glue (target.compile=auto), over
    the batches' four lengths."""
    from flashdraft.benchmarks import train_step as bench

    base = ["data.max_length=40", "recipe.num_anchors=6", "train.batch_size=2", "train.grad_accum=1"]
    eager = load_config(
        bundled.ASSETS / "train.yaml",
        [*SHIPPED_DRAFTER, *base, "train.attention=sdpa", "train.compile=false", "target.compile=false"],
    )
    fast = load_config(
        bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *base, "train.attention=flex", "train.compile=true"]
    )
    target, tokenizer = bench.load_bench_target(eager)
    losses = {}
    for name, cfg in (("eager", eager), ("fast", fast)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=2)
        batches = DataLoader.from_config(
            cfg, _Ragged([23, 31, 17, 29], target.lm_head_weight.shape[0]), s.drafter, s.device
        )
        optimizer = torch.optim.SGD(s.drafter.parameters(), lr=0.0)  # the same weights for both steps
        losses[name] = [float(loop.train_step(s, cfg, optimizer, next(batches))[0].loss_sum) for _ in (0, 1)]
    torch.testing.assert_close(losses["fast"], losses["eager"], rtol=2e-2, atol=1e-3)


# ---- --resume of a job stopped before its first checkpoint ------------------------------------------------------

# Two steps, no checkpoint before the last one, no measured τ: the cheapest complete run.
TWO_STEPS = [
    "train.max_steps=2",
    "train.batch_size=1",
    "log.every=1",
    "log.checkpoint_every=100",
    "data.eval_prompts=null",
]


def _two_steps(out, *extra):
    return load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *TWO_STEPS, f"log.out={out}", *extra])


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_before_the_first_checkpoint_starts_again_from_step_0(tmp_path, caplog):
    reference = tmp_path / "reference"
    loop.train(_two_steps(reference))
    # A job of the same config killed after it logged step 1 (and a torn line), before any checkpoint.
    out = tmp_path / "killed"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(to_dict(_two_steps(out)), indent=1))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + '\n{"step": 2, "lo')
    with caplog.at_level(logging.WARNING, logger="flashdraft.train.resume"):
        result = loop.train(_two_steps(out), resume=True)
    assert "holds this run's config but no checkpoint yet" in caplog.text and "starting from step 0" in caplog.text
    assert result.steps == 2 and result.checkpoint.name == "step_00000002"
    # The lost step's row is gone; the rows are those of an uninterrupted run.
    assert [(r["step"], r["loss"]) for r in _rows(out)] == [(r["step"], r["loss"]) for r in _rows(reference)]


def test_resume_of_a_missing_out_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*and no run started in .*nothing to resume"):
        loop.train(_two_steps(tmp_path / "never"), resume=True)
    assert not (tmp_path / "never").exists()


def test_resume_into_another_runs_out_is_an_error_naming_the_difference(tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    theirs = json.dumps(to_dict(_two_steps(out, "train.max_steps=3")), indent=1)
    (out / "config.json").write_text(theirs)
    with pytest.raises(FileNotFoundError, match=r"another run's config \(train.max_steps: 2 now, 3 there\)"):
        loop.train(_two_steps(out), resume=True)
    assert (out / "config.json").read_text() == theirs  # left as it was


# ---- what a log line reports ------------------------------------------------------------------------------------


def test_logged_loss_accuracy_and_tau_are_means_over_the_log_window(tmp_path, monkeypatch):
    micro = []  # the LossStats of every micro-batch, in order
    real = forward.dflash_loss

    def recording(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        micro.append(stats)
        return loss, stats

    monkeypatch.setattr(forward, "dflash_loss", recording)
    out = tmp_path / "window"
    loop.train(
        _two_steps(
            out, "train.max_steps=5", "log.every=3", "log.eval_every=0", "log.heldout_every=0", "train.grad_accum=2"
        )
    )
    rows = {r["step"]: r for r in _rows(out)}
    assert list(rows) == [3, 5] and len(micro) == 10
    # Step 5 ends a run that is not a multiple of log.every: its line is over the last 3 steps (3, 4, 5), not over
    # the 2 since the line of step 3, nor the last step or micro-batch.
    for step, first in ((3, 0), (5, 2)):
        window = micro[2 * first : 2 * step]
        loss = sum(float(m.loss_sum) for m in window) / sum(float(m.weight_sum) for m in window)
        correct = [sum(int(m.correct[k]) for m in window) for k in range(1, 16)]
        valid = [sum(int(m.valid[k]) for m in window) for k in range(1, 16)]
        acc = [c / v for c, v in zip(correct, valid, strict=True)]
        tau = 1 + sum(math.prod(acc[: k + 1]) for k in range(15))  # 1 + Σ_k Π_{j<=k} acc_j
        assert rows[step]["loss"] == pytest.approx(loss, rel=1e-5)
        assert rows[step]["acc"] == pytest.approx(acc, abs=1e-4)
        assert rows[step]["sim_tau"] == pytest.approx(tau, rel=1e-5)
    last = micro[-1]
    assert rows[5]["loss"] != pytest.approx(float(last.loss_sum / last.weight_sum), rel=1e-5)


class _TwoLengths:
    """Two sequences, the second 37 tokens shorter (right padding in the batch), every position a response."""

    def __init__(self, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(length)
        self.rows = [torch.randint(6, vocab, (n,), generator=g).numpy() for n in (length, length - 37)]

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return self.rows[i], torch.ones(len(self.rows[i]), dtype=torch.uint8).numpy()

    def epoch_order(self, epoch: int, seed: int) -> list[int]:
        return [0, 1]


def test_no_step_tensor_grows_with_the_square_of_the_length_or_with_length_times_vocabulary():
    """Long sequences (data.max_length 131072 on one GPU) need every tensor of a step to grow at most linearly with
    the length: no (seq x seq) mask or attention matrix, no (seq x vocabulary) logits. Every tensor the step creates
    (forward and backward, target and drafter, masks, loss) is recorded at two lengths, with a padded batch."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from flashdraft.benchmarks import train_step as bench

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.shapes += [(str(func), tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

    largest = {}
    for length in (400, 1600):  # no model width among the lengths below
        cfg = load_config(
            bundled.ASSETS / "train.yaml",
            [
                *SHIPPED_DRAFTER,
                f"data.max_length={length}",
                "recipe.num_anchors=8",
                "train.batch_size=2",
                "train.device=cpu",
            ],
        )
        target, tokenizer = bench.load_bench_target(cfg)
        vocab = target.lm_head_weight.shape[0]
        s = bench.bench_setup(cfg, target, tokenizer=tokenizer, steps=1)
        data = _TwoLengths(length, vocab)
        optimizer = torch.optim.AdamW(s.drafter.parameters())
        with Shapes() as seen:
            loop.train_step(s, cfg, optimizer, _batch(cfg, s, data))
        seq_dims = {length - 1, length, length + 8 * s.drafter.block_size}  # T (shifted), context + blocks
        square = [(op, shape) for op, shape in seen.shapes if sum(d in seq_dims for d in shape) >= 2]
        by_vocab = [(op, shape) for op, shape in seen.shapes if vocab in shape and any(d in seq_dims for d in shape)]
        assert not square and not by_vocab, (square[:3], by_vocab[:3])
        assert any(length in shape for _, shape in seen.shapes)  # the recording saw the sequence
        largest[length] = max(math.prod(shape) for _, shape in seen.shapes)
    assert largest[1600] <= 4.5 * largest[400], largest
