"""tools/sweep.py end to end at the smallest size on the CPU: two variants trained from the same
seed on the bundled data, decoded beside prompt lookup, the JSON, table and plot written; the deadline skips; a
failing variant is reported and the others go on; a bad variant name stops before anything trains."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flashdraft import bundled
from tests.scripts import TOOLS, load_script

PLOT = importlib.util.find_spec("matplotlib") is not None


def load_sweep():
    return load_script(TOOLS / "sweep.py")


TINY = [
    "--data",
    str(bundled.ASSETS / "train.jsonl"),
    "--steps",
    "2",
    "--limit",
    "1",
    "--max-new-tokens",
    "12",
    "--set",
    "train.batch_size=1",
    "recipe.num_anchors=4",
    "data.max_length=256",
]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models on a shared 2-core machine: one thread is several times faster than two.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.skipif(not PLOT, reason="matplotlib is optional")
def test_chart_labels_every_bar_and_keeps_the_legend_off_the_bars():
    """The chart a reader looks at: each bar carries its τ, and the legend covers no bar and no label (it sat on
    the tallest bar of a 4-variant chart before)."""
    sweep = load_sweep()
    variants = [
        {"name": n, "tau_t0": t0, "tau_t1": t1}
        for n, t0, t1 in [("baseline", 4.06, 1.90), ("a", 3.73, 1.89), ("b", 4.21, 2.08), ("c", 3.76, 1.92)]
    ]
    report = {
        "steps": 150,
        "num_prompts": 32,
        "block_size": 8,
        "variants": variants,
        "prompt_lookup": {"tau_t0": 1.87, "tau_t1": 1.33},
    }
    fig = sweep.chart(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    assert ax.get_title().endswith("block 8")
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in ax.patches]
    labels = [text for text in ax.texts]
    assert len(bars) == 8 and sorted(t.get_text() for t in labels) == sorted(
        f"{v[k]:.2f}" for v in variants for k in ("tau_t0", "tau_t1")
    )
    for box in [*bars, *(text.get_window_extent(renderer) for text in labels)]:
        assert not legend.overlaps(box)
    assert all(text.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y1 for text in labels)


def test_sweep_trains_and_measures_each_variant(tmp_path, capsys):
    sweep = load_sweep()
    assert sweep.main([*TINY, "--out", str(tmp_path), "--variants", "baseline,target_lk"]) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["steps"] == 2 and report["num_prompts"] == 1
    assert set(report["prompt_lookup"]) == {"tau_t0", "tau_t1"}
    assert [r["name"] for r in report["variants"]] == ["baseline", "target_lk"]
    for row in report["variants"]:
        assert row["steps"] == 2 and row["train_s"] > 0 and row["tok_s"] > 0
        assert 1 <= row["tau_t0"] <= 16 and 1 <= row["tau_t1"] <= 16
        assert row["greedy_mismatches"] == 0  # float32 on the CPU: DFlash and prompt lookup are both the target's
        saved = json.loads((tmp_path / "runs" / row["name"] / "config.json").read_text())
        assert saved["train"]["max_steps"] == 2 and saved["data"]["eval_prompts"] is None
    saved = json.loads((tmp_path / "runs" / "target_lk" / "config.json").read_text())
    assert (saved["recipe"]["labels"], saved["recipe"]["loss"]) == ("target", "lk")
    baseline = json.loads((tmp_path / "runs" / "baseline" / "config.json").read_text())
    assert (baseline["recipe"]["labels"], baseline["recipe"]["loss"]) == ("token", "ce")
    table = (tmp_path / "sweep.md").read_text()
    assert "| baseline |" in table and "| target_lk |" in table and "× prompt lookup" in table
    assert table in capsys.readouterr().out
    if PLOT:
        assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "sweep.md").unlink()
    assert sweep.main(["--out", str(tmp_path), "--redraw"]) == 0  # from sweep.json alone
    assert (tmp_path / "sweep.md").read_text() == table


def test_a_failing_variant_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch):
    sweep = load_sweep()
    trained = []

    def train_variant(cfg):
        trained.append(cfg.recipe.loss)
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(sweep, "train_variant", train_variant)
    assert sweep.main([*TINY, "--out", str(tmp_path), "--variants", "lk,gamma4"]) == 1
    rows = json.loads((tmp_path / "sweep.json").read_text())["variants"]
    assert trained == ["lk", "ce"] and all("out of memory" in r["failed"] for r in rows)
    assert (
        "| gamma4 | – | – | – | – | – | – | failed: RuntimeError: CUDA out of memory"
        in (tmp_path / "sweep.md").read_text()
    )


def test_deadline_skips_and_bad_variants_stop(tmp_path):
    sweep = load_sweep()
    assert sweep.main([*TINY, "--out", str(tmp_path), "--variants", "lk", "--deadline-s", "0"]) == 0
    (row,) = json.loads((tmp_path / "sweep.json").read_text())["variants"]
    assert "tau_t0" not in row and "deadline" in row["skipped"]
    assert not (tmp_path / "runs").exists()
    assert "| lk | – |" in (tmp_path / "sweep.md").read_text()
    with pytest.raises(SystemExit):
        sweep.main([*TINY, "--out", str(tmp_path), "--variants", "baseline,bogus"])
    with pytest.raises(SystemExit):
        sweep.main([*TINY, "--out", str(tmp_path), "--variants", "dpace+bogus"])


def test_a_combined_variant_takes_the_overrides_of_each_part(tmp_path):
    sweep = load_sweep()
    a = sweep.parse_args([*TINY, "--out", str(tmp_path), "--variants", "dpace+late+layers5"])
    cfg = sweep.variant_config(a, "dpace+late+layers5")
    assert cfg.recipe.loss_weighting == "dpace"
    assert list(cfg.drafter.target_layer_ids) == [3, 4, 5, 6, 7]
    assert cfg.drafter.num_layers == 5
    assert Path(cfg.log.out) == tmp_path / "runs" / "dpace+late+layers5"
    alone = sweep.variant_config(a, "late")  # a part alone keeps the others' defaults
    assert alone.recipe.loss_weighting != "dpace" and alone.drafter.num_layers == 3


def test_the_block_size_is_the_one_trained_and_decoded(tmp_path):
    """--block-size sets the drafter's block as well as the decoding's: a block-8 sweep of block-16 drafters would
    decode each block with half its slots unused, or fail."""
    sweep = load_sweep()
    for block in (8, 16):
        a = sweep.parse_args([*TINY, "--out", str(tmp_path), "--variants", "dspark", "--block-size", str(block)])
        assert sweep.variant_config(a, "dspark").drafter.block_size == block == a.block_size


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU with FP8 the variant trains")
def test_the_fp8_variant_without_an_fp8_gpu_is_a_reported_failure(tmp_path):
    sweep = load_sweep()
    assert sweep.main([*TINY, "--out", str(tmp_path), "--variants", "fp8,baseline"]) == 1
    fp8, baseline = json.loads((tmp_path / "sweep.json").read_text())["variants"]
    assert "target.precision" in fp8["failed"] and "tau_t0" not in fp8
    assert baseline["steps"] == 2 and "tau_t0" in baseline


def test_runs_split_over_processes_merge_into_one_table(tmp_path):
    sweep = load_sweep()
    skip = ["--deadline-s", "0"]  # prompt lookup is measured, the variants skipped: real reports, cheaply
    assert sweep.main([*TINY, *skip, "--out", str(tmp_path / "a"), "--variants", "lk"]) == 0
    assert sweep.main([*TINY, *skip, "--out", str(tmp_path / "b"), "--variants", "gamma4,dpace"]) == 0
    assert sweep.main(["--out", str(tmp_path / "all"), "--merge", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    merged = json.loads((tmp_path / "all" / "sweep.json").read_text())
    assert [r["name"] for r in merged["variants"]] == ["lk", "gamma4", "dpace"]
    a = json.loads((tmp_path / "a" / "sweep.json").read_text())
    assert merged["prompt_lookup"] == a["prompt_lookup"]
    table = (tmp_path / "all" / "sweep.md").read_text()
    assert all(f"| {name} | – |" in table for name in ("lk", "gamma4", "dpace"))
    assert "Joined from 2 runs" in table

    with pytest.raises(SystemExit, match="measured \\['lk'\\] again"):
        sweep.main(["--out", str(tmp_path / "x"), "--merge", str(tmp_path / "a"), str(tmp_path / "a")])
    other = [*TINY, *skip, "--out", str(tmp_path / "c"), "--variants", "late"]
    other[other.index("--steps") + 1] = "3"
    assert sweep.main(other) == 0
    with pytest.raises(SystemExit, match="steps = 3"):
        sweep.main(["--out", str(tmp_path / "x"), "--merge", str(tmp_path / "a"), str(tmp_path / "c")])
    # Another host's bf16 may break a near-tie of prompt lookup differently: a small gap merges, a large one stops.
    b_json = tmp_path / "b" / "sweep.json"
    b = json.loads(b_json.read_text())
    for factor, ok in ((1.005, True), (1.05, False)):
        b_json.write_text(
            json.dumps({**b, "prompt_lookup": {**b["prompt_lookup"], "tau_t0": factor * a["prompt_lookup"]["tau_t0"]}})
        )
        argv = ["--out", str(tmp_path / "x"), "--merge", str(tmp_path / "a"), str(tmp_path / "b")]
        if ok:
            assert sweep.main(argv) == 0
        else:
            with pytest.raises(SystemExit, match="more than 1% apart"):
                sweep.main(argv)
    with pytest.raises(SystemExit, match="cannot read"):
        sweep.main(["--out", str(tmp_path / "x"), "--merge", str(tmp_path / "a"), str(tmp_path / "missing")])


def test_prompt_lookup_is_decoded_once_and_reused_only_when_measured_alike(tmp_path, monkeypatch, capsys):
    sweep = load_sweep()
    kept = tmp_path / "lookup.json"
    skip = ["--deadline-s", "0", "--lookup", str(kept)]
    assert sweep.main([*TINY, *skip, "--out", str(tmp_path / "a"), "--variants", "lk"]) == 0
    first = json.loads((tmp_path / "a" / "sweep.json").read_text())["prompt_lookup"]
    saved = json.loads(kept.read_text())
    assert saved["tau"] == first and set(saved["tokens"]) == {"0", "1"}
    assert all(len(rows) == 1 and len(rows[0]) > 0 for rows in saved["tokens"].values())

    def no_decoding(self, method, temperature, drafter=None):
        raise AssertionError(f"{method} decoded again")

    monkeypatch.setattr(sweep.Decoder, "run", no_decoding)
    assert sweep.main([*TINY, *skip, "--out", str(tmp_path / "b"), "--variants", "gamma4"]) == 0
    assert json.loads((tmp_path / "b" / "sweep.json").read_text())["prompt_lookup"] == first
    assert f"read from {kept}" in capsys.readouterr().out

    other = [*TINY, *skip, "--out", str(tmp_path / "c"), "--variants", "lk"]
    other[other.index("--max-new-tokens") + 1] = "13"
    with pytest.raises(SystemExit, match="max_new_tokens = 12, this run has 13"):
        sweep.main(other)
    kept.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read .*lookup.json"):
        sweep.main([*TINY, *skip, "--out", str(tmp_path / "d"), "--variants", "lk"])


def test_every_variant_is_a_configuration_the_trainer_accepts():
    """Each variant's overrides on the sweep's default recipe load as a run's configuration: a misspelt key or a
    family's option it lacks would otherwise surface only on a GPU, after the variants before it trained."""
    from flashdraft.config import load_config

    sweep = load_sweep()
    for name in sweep.VARIANTS:
        _, overrides = sweep.variant(name)
        cfg = load_config(sweep.TINY_TARGET / "drafter.yaml", overrides)
        assert cfg.drafter.family == next((o.split("=")[1] for o in overrides if "drafter.family" in o), "dflash")
