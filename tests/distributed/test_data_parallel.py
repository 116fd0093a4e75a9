"""Data-parallel training over torchrun, 2 processes with gloo on the CPU, against the one-process trainer.

The same global batch (1 process x grad_accum 2 = 2 processes x grad_accum 1) must give the same losses and the same
weights and optimizer moments up to the order of the sums; checkpoints written by 2 ranks resume on 1 and the other
way round; the exported drafter is the same bytes whichever number of ranks wrote it.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.train import loop, setup
from flashdraft.train.checkpoint import CheckpointManager
from flashdraft.train.optim import build_optimizer, build_scheduler
from tests import SHIPPED_DRAFTER
from tests.distributed.torchrun import RUN, torchrun

pytestmark = pytest.mark.slow
# The sums of a step run in another order (gradients accumulated in .grad vs reduce-scattered, stats all-reduced):
# last-bit differences, which Adam can enlarge a little over the steps. A wrong split of the data or of the loss,
# or averaged instead of summed gradients, differs by far more (percent).
RTOL = 1e-6


def _losses(out: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }


def _cfg(out: Path, *extra: str):
    return load_config(bundled.ASSETS / "train.yaml", [*SHIPPED_DRAFTER, *RUN, f"log.out={out}", *extra])


def _state(out: Path, step: int, *extra: str):
    """Weights and optimizer state of a run's checkpoint, loaded in this (one) process whatever wrote it."""
    cfg = _cfg(out, *extra)
    s = setup.setup(cfg, out, None)
    optimizer = build_optimizer(s.drafter.parameters(), cfg.optim, s.device)
    scheduler = build_scheduler(optimizer, cfg.optim, s.total_steps)
    CheckpointManager(out).load(CheckpointManager(out).path_for(step), s.drafter, optimizer, scheduler)
    return s.drafter, optimizer


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    loop.train(_cfg(out, "train.grad_accum=2"))
    return out


def test_two_processes_give_the_losses_of_one(one_proc, two_procs):
    out, run = two_procs
    one, two = _losses(one_proc), _losses(out)
    assert list(two) == [1, 2, 3, 4]
    assert one[1] == two[1]  # the first step runs before any update: the same sums of the same numbers
    assert two == pytest.approx(one, rel=RTOL)
    # Only rank 0 prints: one progress line per step and one "done".
    assert run.stdout.count("done:") == 1 and run.stdout.count("step 3/4") == 1, run.stdout


def test_weights_and_optimizer_moments_match_one_process(one_proc, two_procs):
    """Adam's update is scale-free, so equal losses alone would not show that gradients are summed (not averaged)
    over ranks: the first moment is the gradient's own scale."""
    out, _ = two_procs
    d1, o1 = _state(one_proc, 4, "train.grad_accum=2")
    d2, o2 = _state(out, 4)
    for (name, p1), (_, p2) in zip(d1.named_parameters(), d2.named_parameters(), strict=True):
        # atol 3% of one step's lr (3e-4): Adam divides by sqrt(v), so a last-bit gradient difference in an element
        # whose gradient is near zero moves that element by a visible fraction of lr (1.06e-6 seen on a 2-core CI
        # machine, 2026-12-04); a wrong split of the data moves most elements by O(lr).
        torch.testing.assert_close(p2, p1, rtol=1e-5, atol=1e-5, msg=name)
        m1, m2 = o1.state[p1]["exp_avg"], o2.state[p2]["exp_avg"]
        assert m1.abs().max() > 0, name
        assert (m2 - m1).norm() <= 1e-4 * m1.norm(), name


def test_sharded_checkpoint_layout_and_identical_export(two_procs, tmp_path):
    out, _ = two_procs
    ckpt = out / "checkpoints" / "step_00000004"
    files = json.loads((ckpt / "MANIFEST.json").read_text())["files"]
    assert {
        "sharded/.metadata",
        "sharded/__0_0.distcp",
        "sharded/__1_0.distcp",
        "drafter/model.safetensors",
        "scheduler.pt",
        "rng.pt",
        "trainer_state.json",
    } <= set(files)
    assert "optimizer.pt" not in files
    assert json.loads((ckpt / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    # The sharded state, loaded and exported by one process, gives the very bytes rank 0 exported from 2 ranks.
    drafter, _ = _state(out, 4)
    drafter.save_pretrained(tmp_path / "export")
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == (
        ckpt / "drafter" / "model.safetensors"
    ).read_bytes()


def test_two_rank_checkpoint_resumes_on_one_process(one_proc, two_procs, tmp_path):
    out, _ = two_procs
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    loop.train(_cfg(resumed, "train.grad_accum=2"), resume=True)
    assert _losses(resumed) == pytest.approx(_losses(out), rel=RTOL)
    assert _losses(resumed) == pytest.approx(_losses(one_proc), rel=RTOL)


def test_one_process_checkpoint_resumes_on_two(one_proc, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(one_proc, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    run = torchrun(["train", "--resume", "--out", str(resumed), *RUN])
    assert run.returncode == 0, run.stderr[-3000:]
    assert _losses(resumed) == pytest.approx(_losses(one_proc), rel=RTOL)
    a = load_file(one_proc / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_periodic_tau_with_a_sharded_drafter_neither_hangs_nor_changes_the_losses(one_proc, tmp_path):
    """Every rank gathers the FSDP2 drafter, rank 0 evaluates it (decodes, scores the held-out set) while the others
    wait in the next step's collective."""
    out = tmp_path / "run"
    run = torchrun(
        [
            "train",
            "--out",
            str(out),
            *RUN,
            "data.eval_prompts=bundled",
            "data.eval_limit=1",
            "data.eval_max_new_tokens=24",
            "log.eval_every=2",
        ],
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    # The gathered drafter is the fine-tuned shipped one, whose drafts are accepted; a shard, or weights not
    # gathered, would accept nothing (tau 1).
    assert [step for step, r in rows.items() if "tau" in r] == [0, 2, 4] and rows[2]["tau"] > 1.3
    assert all(rows[step]["heldout_loss"] > 0 for step in (0, 2, 4))
    one = _losses(one_proc)
    assert _losses(out) == pytest.approx(one, rel=RTOL)


def test_a_sharded_target_gives_the_losses_of_one_process(one_proc, tmp_path):
    run = torchrun(["train", "--out", str(tmp_path / "run"), *RUN, "target.shard=true"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "target: 6 decoder layers sharded over 2 ranks" in run.stdout + run.stderr
    assert _losses(tmp_path / "run") == pytest.approx(_losses(one_proc), rel=RTOL)
