"""examples/tiny_target/pipeline.sh end to end on the bundled target at the smallest size on the CPU: corpus,
both regenerations, a drafter fine-tuned from the bundled one, eval at both temperatures, every stage reading and
writing under BUILD and the eval on the HELDOUT prompts given."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashdraft import bundled

ROOT = Path(__file__).resolve().parents[2]
PLOT = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.slow
def test_pipeline_on_the_bundled_target_keeps_every_stage_under_build(tmp_path):
    build = tmp_path / "build"
    heldout = bundled.ASSETS / "eval.jsonl"
    env = {
        **os.environ,
        # The pipeline calls python3; the test's interpreter (the venv's) must be the one found first.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "BUILD": str(build),
        "TARGET": "bundled",
        "HELDOUT": str(heldout),
        "STAGES": "corpus regen drafter eval",
        "PROMPTS_PER_FILE": "1",
        "T1_PROMPTS_PER_FILE": "1",
        "REGEN_T0_LIMIT": "6",
        "REGEN_T1_LIMIT": "5",
        "REGEN_TOKENS": "12",
        "REGEN_BATCH": "6",
        "DRAFTER_ARGS": "drafter.init_from=bundled train.max_steps=2 train.batch_size=2 recipe.num_anchors=4 "
        "data.eval_limit=1 data.eval_max_new_tokens=12",
        "EVAL_TOKENS": "12",
        "EVAL_ARGS": "--limit 2 --baselines ar,prompt_lookup",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "tiny_target" / "pipeline.sh")],
        cwd=tmp_path,  # nothing may land in the working directory: BUILD holds it all
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]

    rows = {t: (build / f"regen_t{t}.jsonl").read_text().splitlines() for t in (0, 1)}
    assert (len(rows[0]), len(rows[1])) == (6, 5)
    assert all(json.loads(line)["response"] for t in rows for line in rows[t])

    run = build / "drafter_run"
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["train"] == [str(build / "regen_t0.jsonl"), str(build / "regen_t1.jsonl")]
    assert config["data"]["eval_prompts"] == str(heldout)
    assert config["drafter"]["init_from"] == "bundled"
    assert len(list((run / "checkpoints").glob("step_*"))) >= 1

    for t in (0, 1):
        report = json.loads((build / f"eval_t{t}.json").read_text())
        # The package's own prompts, not the held-out windows the corpus stage cut from this machine's Python.
        assert report["prompts"] == str(heldout) and report["num_prompts"] == 2
        assert report["temperature"] == float(t)
        if PLOT:
            assert (build / f"eval_t{t}.png").stat().st_size > 0
    assert json.loads((build / "eval_t0.json").read_text())["greedy_mismatches"] == 0
