"""bench/train_step.py on the CPU (--smoke): it runs both trainers (and DSpark beside DFlash), writes its JSON, and
warns only about what it runs."""

import json

from . import run_bench


def test_smoke_runs_both_trainers_and_writes_the_report(tmp_path):
    out = tmp_path / "step.json"
    # 32 anchors fit the smoke's 96 tokens: no variant's config may be read at another length and warn otherwise.
    run = run_bench("train_step", "--smoke", "--family", "dspark", "--json", str(out), "recipe.num_anchors=32")
    report = json.loads(out.read_text())
    rows = [r for r in report["results"] if "step_s" in r]
    assert sorted(r["variant"].split("[")[0] for r in rows) == ["flashdraft", "flashdraft", "naive (torch target)"]
    assert [r["variant"].endswith(" dspark") for r in rows if "drafter.family=dspark" in r.get("overrides", [])] == [
        True
    ]
    assert all(r["seq"] == 96 and r["step_s"] > 0 for r in rows)
    assert "exceeds data.max_length" not in run.stdout + run.stderr
