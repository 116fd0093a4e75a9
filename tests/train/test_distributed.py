"""Data-parallel training over torchrun, 2 processes with gloo on the CPU, against the one-process trainer.

The same global batch (1 process x grad_accum 2 = 2 processes x grad_accum 1) must give the same losses and the same
weights and optimizer moments up to the order of the sums; checkpoints written by 2 ranks resume on 1 and the other
way round; the exported drafter is the same bytes whichever number of ranks wrote it; an error on one rank stops
the job with that rank's message.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashdraft import bundled
from flashdraft.config import load_config
from flashdraft.train import loop, setup
from flashdraft.train.checkpoint import CheckpointManager
from flashdraft.train.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# 4 steps, a checkpoint every 2; no measured τ (decoding is rank 0's alone and tested elsewhere).
RUN = [
    "train.max_steps=4",
    "log.every=1",
    "log.checkpoint_every=2",
    "data.eval_prompts=null",
    "train.batch_size=2",
    "train.device=cpu",
]  # gloo on the CPU even where a GPU is visible (2 ranks cannot share one with NCCL)
# The sums of a step run in another order (gradients accumulated in .grad vs reduce-scattered, stats all-reduced):
# last-bit differences, which Adam can enlarge a little over the steps. A wrong split of the data or of the loss,
# or averaged instead of summed gradients, differs by far more (percent).
RTOL = 1e-6


def _env(extra_path: Path | None = None) -> dict:
    paths = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def torchrun(args: list[str], nproc: int = 2, env: dict | None = None, timeout: int = 300):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "flashdraft",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env())


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _cfg(out: Path, *extra: str):
    return load_config(bundled.ASSETS / "train.yaml", [*RUN, f"log.out={out}", *extra])


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


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory):
    """Launched by `flashdraft train --nproc 2` (torchrun underneath)."""
    out = tmp_path_factory.mktemp("two")
    run = subprocess.run(
        [sys.executable, "-m", "flashdraft", "train", "--nproc", "2", "--out", str(out), *RUN],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run


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
    """Every rank gathers the FSDP2 drafter, rank 0 decodes while the others wait in the next step's collective."""
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
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The gathered drafter is the fine-tuned shipped one, whose drafts are accepted (tau 1.77 on this prompt before
    # fine-tuning); a shard, or weights not gathered, would accept nothing (tau 1).
    assert [r["step"] for r in rows if "tau" in r] == [2] and rows[1]["tau"] > 1.3
    one = _losses(one_proc)
    assert _losses(out) == pytest.approx(one, rel=RTOL)


def test_a_sharded_target_gives_the_losses_of_one_process(one_proc, tmp_path):
    run = torchrun(["train", "--out", str(tmp_path / "run"), *RUN, "target.shard=true"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "target: 6 decoder layers sharded over 2 ranks" in run.stdout + run.stderr
    assert _losses(tmp_path / "run") == pytest.approx(_losses(one_proc), rel=RTOL)


# ---- errors ---------------------------------------------------------------------------------------------------


def _site(tmp_path: Path, code: str) -> Path:
    """A directory with a sitecustomize.py running `code` at the start of every worker (it reads RANK)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nRANK = os.environ.get('RANK')\n" + textwrap.dedent(code))
    return site


FAIL_IN_STEP_ON_RANK_1 = """
    if RANK == "1":
        import flashdraft.train.loop as loop

        def boom(*args, **kwargs):
            raise ValueError("injected failure on rank 1")

        loop.train_step = boom
"""


def test_an_error_on_rank_1_stops_every_rank_with_its_message(tmp_path):
    env = _env(_site(tmp_path, FAIL_IN_STEP_ON_RANK_1))
    start = time.monotonic()
    run = torchrun(["train", "--out", str(tmp_path / "run"), *RUN], env=env, timeout=120)
    assert run.returncode != 0
    assert "flashdraft train (rank 1): error: injected failure on rank 1" in run.stderr, run.stderr[-3000:]
    assert time.monotonic() - start < 90  # start-up included; a hang would be the 120 s timeout above


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rank 1 fails while loading the target; rank 0 is busy tokenising (a sleep standing for hours of it).
FAIL_ON_RANK_1_WHILE_RANK_0_WORKS = """
    import flashdraft.data, flashdraft.bundled

    if RANK == "1":
        def boom(*args, **kwargs):
            raise ValueError("injected failure on rank 1")

        flashdraft.bundled.build_target = boom
    if RANK == "0":
        import time

        def slow(*args, **kwargs):
            time.sleep(600)

        flashdraft.data.prepare_shards = slow
"""


def test_a_failure_on_another_node_stops_a_rank_that_is_not_in_a_collective(tmp_path):
    """Two torchrun agents (two "nodes" of one process each, c10d rendezvous on this machine). Rank 1 fails while
    rank 0 works alone, in no collective, on the other node: torchrun's fail-fast stops only the failing node's
    processes, and no collective is there to fail. The error watch stops rank 0 within seconds, and it prints
    rank 1's message."""
    env = _env(_site(tmp_path, FAIL_ON_RANK_1_WHILE_RANK_0_WORKS))
    port = _free_port()
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=fdtest",
        "-m",
        "flashdraft",
        "train",
        "--out",
        str(tmp_path / "run"),
        *RUN,
    ]
    nodes = []
    for _ in range(2):
        # The first agent binds the rendezvous endpoint (hosts its store) and, with the lower pid, gets rank 0:
        # then the failing node takes nothing down with it that rank 0's node depends on.
        nodes.append(
            subprocess.Popen(
                common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
            )
        )
        time.sleep(3)
    try:
        outputs = [p.communicate(timeout=150) for p in nodes]  # rank 0 alone would sleep 600 s
    finally:
        for p in nodes:  # the agent and its workers (a killed agent would leave a sleeping worker behind)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    stderr = "".join(err for _, err in outputs)
    assert all(p.returncode != 0 for p in nodes), stderr[-3000:]
    assert "flashdraft train (rank 1): error: injected failure on rank 1" in stderr, stderr[-3000:]
    assert "flashdraft train: stopping every rank: rank 1 failed: injected failure on rank 1" in stderr, stderr[-3000:]
