"""bench/spec_engine.py on the CPU (--smoke): every figure of its table is measured, the engine's round both as one
step (greedy and sampled) and as separate steps, and its checks pass; the JSON holds them."""

import json

from . import run_bench


def test_smoke_measures_the_round_both_ways_and_checks_the_engine(tmp_path):
    out = tmp_path / "engine.json"
    run = run_bench("spec_engine", "--smoke", "--json", str(out))
    report = json.loads(out.read_text())
    for ctx, row in report["contexts"].items():
        engine = row["engine"]
        for key in (
            "decode_ms",
            "verify16_ms",
            "draft_ms",
            "commit_ms",
            "round_ms",
            "round_sampled_ms",
            "round_steps_ms",
        ):
            assert engine[key] > 0, (ctx, key)
    checks = report["checks"]
    assert checks["same_argmax"] and checks["dflash_equals_engine_greedy"] and checks["backend"] == "engine"
    assert checks["prefill_logits_rel_err"] < 1e-5 and checks["decode_logits_rel_err"] < 1e-5
    assert "**engine round** (draft + verify + accept + commit as one step, one read)" in run.stdout
    assert "engine round of separate steps" in run.stdout and "engine round sampled" in run.stdout
