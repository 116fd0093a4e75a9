"""`flashdraft train` as a user runs it: piped into a log file, without the optional extras, restarted with --resume."""

import json
import subprocess
import sys

import pytest

from flashdraft import bundled, cli
from flashdraft.config import load_config, to_dict

# Three short steps of one sequence each, a log line per step, one short held-out prompt evaluated before and after.
QUICK = ["train.max_steps=3", "train.batch_size=1", "log.every=1", "data.eval_limit=1", "data.eval_max_new_tokens=4"]
FLA_CPU_WARNING = "Triton is not supported on current platform"


@pytest.fixture(scope="module")
def piped_run_without_matplotlib(tmp_path_factory, env_without):
    """`python -m flashdraft train --out OUT ... > file` in an environment without matplotlib."""
    out = tmp_path_factory.mktemp("piped") / "run"
    run = subprocess.run(
        [sys.executable, "-m", "flashdraft", "train", "--out", str(out), *QUICK],
        capture_output=True,
        text=True,
        timeout=900,
        env=env_without("matplotlib"),
    )
    return run, out


def test_a_run_without_matplotlib_succeeds_and_says_so_in_one_line(piped_run_without_matplotlib):
    run, out = piped_run_without_matplotlib
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in (run.stdout + run.stderr).splitlines() if "curve" in line or "matplotlib" in line]
    assert said == [
        f"training curve not drawn: matplotlib is not installed (pip install 'flashdraft[plot]' to get it; every "
        f"value is in {out / 'metrics.jsonl'})"
    ]
    assert not (out / "training_curve.png").exists()
    assert "done" in run.stdout and (out / "checkpoints" / "step_00000003").is_dir()


def test_piped_output_is_one_unwrapped_line_per_log_step_without_bars(piped_run_without_matplotlib):
    run, out = piped_run_without_matplotlib
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 0/3", "step 1/3", "step 2/3", "step 3/3"]
    assert " | held-out loss " in lines[0]  # the evaluation before the first step
    steps = lines[1:]
    assert all(" | lr " in line for line in steps)  # the last field: the line is whole
    assert all(len(line) > 80 for line in steps)  # rich would have wrapped them at 80 columns
    # No progress bar of training or of data preparation, in either stream; every line is whole.
    assert "━" not in run.stdout + run.stderr and "\r" not in run.stdout + run.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3]


def test_a_cpu_run_shows_no_warning_of_fla(piped_run_without_matplotlib):
    run, _ = piped_run_without_matplotlib
    control = subprocess.run([sys.executable, "-c", "import fla.utils"], capture_output=True, text=True, timeout=600)
    if FLA_CPU_WARNING not in control.stderr:
        pytest.skip("fla does not warn on this machine (a GPU driver is present)")
    assert FLA_CPU_WARNING not in run.stderr


def test_a_named_tracker_that_is_not_installed_stops_the_run_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    code = cli.main(["train", "--out", str(tmp_path / "run"), "log.trackers=[wandb]"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "flashdraft train: error: log.trackers: 'wandb' is not installed: pip install wandb (or remove 'wandb' from "
        "log.trackers)"
    ]
    assert not (tmp_path / "run" / "config.json").exists()  # refused before the run started


def test_resume_into_another_runs_out_stops_before_anything_loads(tmp_path, capsys):
    out = tmp_path / "other"
    out.mkdir()
    args = ["train.max_steps=2", "data.eval_prompts=null"]
    theirs = to_dict(load_config(bundled.ASSETS / "train.yaml", [*args, f"log.out={out}", "train.seed=1"]))
    (out / "config.json").write_text(json.dumps(theirs))
    assert cli.main(["train", "--out", str(out), "--resume", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"flashdraft train: error: --resume: no checkpoint in {out / 'checkpoints'}, and {out / 'config.json'} is "
        "another run's config (train.seed: 0 now, 1 there): give this run another --out, or drop --resume to start "
        "it over there"
    ]
