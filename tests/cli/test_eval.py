"""`flashdraft eval` end to end on a tiny target + drafter saved to disk, with a tiny word-level tokenizer."""

import argparse
import json
import sys

import pytest
import torch

from flashdraft.cli import eval as eval_cli
from tests import SHIPPED_DRAFTER
from tests.speculative import one_thread, random_drafter, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from tests.speculative.test_prompts import WORDS, _tokenizer, _write

# tau of the shipped drafter on the first held-out prompt, 24 new tokens, is 1.53 (float32, CPU); a drafter whose
# drafts are never accepted has tau 1.
SHIPPED_TAU_FLOOR = 1.3


def _save_models(root, family):
    target = tiny_target(family, dtype=torch.float32, seed=21, vocab_size=64)
    target.generation_config.eos_token_id = 2
    target.save_pretrained(root / "target")
    _tokenizer().save_pretrained(root / "target")
    random_drafter(target, block_size=4, seed=22).save_pretrained(root / "drafter")
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _save_models(tmp_path_factory.mktemp("eval"), "qwen3")


def _args(*argv):
    parser = argparse.ArgumentParser()
    eval_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", *argv])


def test_eval_end_to_end(models, tmp_path, capsys):
    prompts = _write(
        tmp_path / "prompts.jsonl",
        [
            json.dumps({"messages": [{"role": "user", "content": "the cat sat on the mat"}], "category": "chat"}),
            json.dumps({"prompt": "a dog ran far away and then home", "category": "text"}),
            "",
            json.dumps({"messages": [{"role": "user", "content": "is red good"}], "category": "chat"}),
            json.dumps({"prompt": "big small big small big"}),
        ],
    )
    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    args = _args(
        "--target",
        str(models / "target"),
        "--drafter",
        str(models / "drafter"),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        "--device",
        "cpu",
        "--ignore-eos",
        "--no-progress",
    )
    assert args.run(args) == 0
    report = _strict_json(out_json)
    for key in (
        "tau",
        "speedup",
        "steady_speedup",
        "prefill_ms",
        "per_prompt",
        "slow_prompts",
        "prompt_lookup_tau",
        "per_category",
        "per_position_acceptance",
        "acceptance_length_p95",
        "tokens_per_second",
        "acceptance_length_histogram",
    ):
        assert key in report, key
    assert report["num_prompts"] == 4 and report["block_size"] == 4
    assert set(report["per_category"]) == {"chat", "text", "all"}
    assert sum(c["num_prompts"] for c in report["per_category"].values()) == 4
    assert report["tokens"] == {"dflash": 48, "autoregressive": 48, "prompt_lookup": 48}
    assert report["greedy_mismatches"] == 0
    tps = report["tokens_per_second"]
    assert report["speedup"] == pytest.approx(tps["dflash"] / tps["autoregressive"])
    assert len(report["per_position_acceptance"]) == 3
    hist = report["acceptance_length_histogram"]
    # Each prompt: 1 token from the prefill, 11 from verification rounds.
    assert sum(int(k) * v for k, v in hist.items()) == 4 * 11
    assert report["tau"] == pytest.approx(4 * 11 / sum(hist.values()))
    # The statistics are those of decoding each prompt directly (greedy: the same rounds, whatever the timing).
    direct = _decode_directly(models, prompts, 12, block_size=4)
    assert hist == {str(k): direct["dflash"].count(k) for k in range(1, 5)}
    assert report["tau"] == pytest.approx(sum(direct["dflash"]) / len(direct["dflash"]))
    assert report["prompt_lookup_tau"] == pytest.approx(sum(direct["lookup"]) / len(direct["lookup"]))
    _assert_plot_drawn(out_png, report)
    printed = capsys.readouterr().out
    assert "overall" in printed and "chat" in printed
    _assert_time_per_prompt(report, printed)


def _strict_json(path):
    """The report, refusing NaN and Infinity (which json writes by default but strict parsers reject)."""

    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}: not strict JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _assert_time_per_prompt(report, printed):
    """A row per prompt and method with its time per phase; the summaries of it; what the tables print."""
    rows = report["per_prompt"]
    assert len(rows) == report["num_prompts"] * len(report["methods_run"])
    assert {(r["method"], r["prompt"]) for r in rows} == {
        (m, i) for m in report["methods_run"] for i in range(report["num_prompts"])
    }
    for row in rows:
        assert row["new_tokens"] == report["max_new_tokens"] and row["prompt_tokens"] > 0
        assert row["prefill_ms"] > 0 and row["first_round_ms"] > 0 and row["steady_round_ms"] > 0
        assert row["rounds"] == pytest.approx((row["new_tokens"] - 1) / row["tau"])
    dflash = [r for r in rows if r["method"] == "dflash"]
    assert report["prefill_ms"] == pytest.approx(sum(r["prefill_ms"] for r in dflash) / len(dflash))
    for method, figures in report["methods"].items():
        assert figures["prefill_ms"] > 0 and figures["steady_round_ms"] > 0, method
    assert report["steady_speedup"] == report["methods"]["dflash"]["steady_speedup"] > 0
    # Decode-phase tokens/s over AR's is what tau x step / round measures.
    assert report["steady_speedup"] == pytest.approx(report["implied_ceiling"])
    assert isinstance(report["slow_prompts"], list)
    assert "where the time goes" in printed
    assert f"steady-state speedup {report['steady_speedup']:.2f}x" in printed
    assert f"end-to-end speedup {report['speedup']:.2f}x" in printed


def _decode_directly(models, prompts_path, max_new_tokens, block_size):
    """Acceptance lengths of DFlash and prompt lookup over every prompt, decoded without `evaluate`."""
    from transformers import AutoModelForCausalLM

    from flashdraft.drafter import DFlashDraftModel
    from flashdraft.speculative import generate, prompt_lookup_generate
    from flashdraft.speculative.prompts import load_prompts

    target = AutoModelForCausalLM.from_pretrained(models / "target").eval()
    drafter = DFlashDraftModel.from_pretrained(models / "drafter").eval()
    lengths = {"dflash": [], "lookup": []}
    for prompt in load_prompts(prompts_path, _tokenizer()):
        ids = prompt.input_ids
        lengths["dflash"] += generate(target, drafter, ids, max_new_tokens, block_size=block_size).acceptance_lengths
        lookup = prompt_lookup_generate(target, ids, max_new_tokens, block_size=block_size)
        lengths["lookup"] += lookup.acceptance_lengths
    return lengths


COLORS = {"dflash": (0x1F, 0x77, 0xB4), "prompt_lookup": (0xFF, 0x7F, 0x0E), "autoregressive": (0x7F, 0x7F, 0x7F)}


def _color_mask(pixels, rgb):
    return (pixels - torch.tensor(rgb) / 255).abs().amax(-1) < 0.02


def _longest_run(column) -> int:
    best = run = 0
    for hit in column.tolist():
        run = run + 1 if hit else 0
        best = max(best, run)
    return best


def _bar_heights(mask) -> list[float]:
    """Heights (pixels) of the bars `mask` marks, left to right: for each run of columns in which it holds, the
    longest unbroken vertical stretch in its middle column (anti-aliased text of a similar colour above or below a
    bar does not count)."""
    columns = mask.any(0).int().tolist()
    edges = [i for i in range(1, len(columns)) if columns[i] != columns[i - 1]]
    return [float(_longest_run(mask[:, (a + b) // 2])) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _assert_plot_drawn(path, report):
    """The PNG decodes to the figure's 16 x 4.5 inches at 120 dpi, in three panels: DFlash's acceptance-length
    histogram (tab:blue bars, one per acceptance length that occurred and as tall as its count); each speculative
    method's acceptance by draft position (DFlash blue, prompt lookup tab:orange); tau per method (one bar in each
    method's colour, as tall as its tau)."""
    from matplotlib import image

    pixels = torch.from_numpy(image.imread(path)[..., :3])
    assert tuple(pixels.shape) == (540, 1920, 3) and pixels.std() > 0.05
    third = pixels.shape[1] // 3
    left, middle, right = pixels[:, :third], pixels[:, third : 2 * third], pixels[:, 2 * third :]
    blue = _color_mask(left, COLORS["dflash"])
    assert blue.sum() > 2000 and not _color_mask(left, COLORS["prompt_lookup"]).any()
    # Histogram bars left to right: their heights relative to the tallest are the counts relative to the largest.
    heights = torch.tensor(_bar_heights(blue))
    counts = torch.tensor(
        [float(v) for _, v in sorted((int(k), v) for k, v in report["acceptance_length_histogram"].items()) if v]
    )
    assert len(heights) == len(counts), (heights, counts)
    torch.testing.assert_close(heights / heights.max(), counts / counts.max(), atol=3 / float(heights.max()), rtol=0)
    for method in ("dflash", "prompt_lookup"):
        assert _color_mask(middle, COLORS[method]).sum() > 30, method
    # tau per method: each bar's height relative to DFlash's is its tau relative to DFlash's.
    taus = {m: report["methods"][m]["tau"] for m in COLORS}
    bars = {m: max(_bar_heights(_color_mask(right, rgb))) for m, rgb in COLORS.items()}
    for method in COLORS:
        assert bars[method] / bars["dflash"] == pytest.approx(taus[method] / taus["dflash"], abs=0.03), method


def test_eval_limit_and_stop_tokens(models, tmp_path):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"the {w} sat"}) for w in WORDS[:5]])
    out_json = tmp_path / "r.json"
    args = _args(
        "--target",
        str(models / "target"),
        "--drafter",
        str(models / "drafter"),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--limit",
        "2",
        "--json",
        str(out_json),
        "--no-progress",
        "--block-size",
        "3",
    )
    assert args.run(args) == 0
    report = json.loads(out_json.read_text())
    assert report["num_prompts"] == 2 and report["block_size"] == 3
    assert report["tokens"]["dflash"] == report["tokens"]["autoregressive"] <= 12


def test_eval_hybrid_target_enables_the_fast_path(tmp_path, capsys):
    from flashdraft import fastpath

    root = _save_models(tmp_path, "qwen3_5")
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "the cat sat on the mat and the dog"})])
    out_json = tmp_path / "r.json"
    args = _args(
        "--target",
        str(root / "target"),
        "--drafter",
        str(root / "drafter"),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "10",
        "--json",
        str(out_json),
        "--no-progress",
        "--ignore-eos",
    )
    try:
        assert args.run(args) == 0
    finally:  # enable() patched the modeling module; give other tests transformers' own state back
        fastpath.disable(tiny_target("qwen3_5", dtype=torch.float32))
    report = json.loads(out_json.read_text())
    assert report["tokens"]["dflash"] == report["tokens"]["autoregressive"] == 10
    assert report["greedy_mismatches"] == 0


def test_eval_with_the_engine_reports_the_implied_ceiling(models, tmp_path, capsys):
    """--engine on (graphs off on a CPU): same tokens as transformers' forwards; tau x step / round beside the
    measured speedup."""
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"the {w} sat on the mat"}) for w in WORDS[:3]])
    reports = {}
    for engine in ("on", "off"):
        out_json = tmp_path / f"{engine}.json"
        args = _args(
            "--target",
            str(models / "target"),
            "--drafter",
            str(models / "drafter"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--json",
            str(out_json),
            "--no-progress",
            "--ignore-eos",
            "--device",
            "cpu",
            "--engine",
            engine,
        )
        assert args.run(args) == 0
        reports[engine] = json.loads(out_json.read_text())
    on = reports["on"]
    assert on["backend"] == "engine" and reports["off"]["backend"] == "plain"
    assert on["greedy_mismatches"] == 0 and on["tau"] == pytest.approx(reports["off"]["tau"])
    assert on["implied_ceiling"] == pytest.approx(on["tau"] * on["decode_step_ms"] / on["round_ms"])
    assert on["decode_step_ms"] > 0 and on["round_ms"] > 0
    assert "implied ceiling" in capsys.readouterr().out


def test_before_any_run_the_shipped_drafter_is_evaluated(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/default here
    args = _args("--limit", "1", "--max-new-tokens", "24", "--json", str(tmp_path / "r.json"), "--no-progress")
    assert args.run(args) == 0
    captured = capsys.readouterr()
    assert "the drafter shipped with the bundled target\n" in captured.err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["drafter"].endswith("bundled/drafter") and report["greedy_mismatches"] == 0
    # The trained drafter's drafts are accepted (1.53 on this prompt); a random or misread one gets tau ~ 1.
    assert report["tau"] > SHIPPED_TAU_FLOOR
    # Not a terminal: the table keeps every number whole (rich's 80-column default would cut them to "3.…").
    overall = next(line for line in captured.out.splitlines() if "overall" in line)
    assert f" {report['tau']:.2f} " in overall and "…" not in overall


def test_missing_target_or_drafter_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _args("--target", "somewhere", "--prompts", "x.jsonl")
    assert args.run(args) == 2
    assert "give both --target and --drafter" in capsys.readouterr().err


def test_after_a_run_of_the_bundled_default_no_arguments_still_evaluate_the_shipped_drafter(
    tmp_path, monkeypatch, capsys
):
    """The shipped drafter is what a run of the bundled default is measured against: `flashdraft eval` keeps
    evaluating it and names the run's command; `--drafter runs/default` evaluates the run (a DSpark drafter)."""
    from flashdraft import bundled
    from flashdraft.config import load_config
    from flashdraft.train.loop import train

    monkeypatch.chdir(tmp_path)
    train(load_config(bundled.ASSETS / "train.yaml", ["train.max_steps=2", "data.eval_prompts=null"]))
    common = ["--limit", "1", "--max-new-tokens", "24", "--no-progress"]
    args = _args(*common, "--json", str(tmp_path / "shipped.json"))
    assert args.run(args) == 0
    assert "the run of `flashdraft train`: flashdraft eval --drafter runs/default" in capsys.readouterr().err
    report = json.loads((tmp_path / "shipped.json").read_text())
    assert report["target"] == "bundled" and report["drafter"].endswith("bundled/drafter")
    assert report["num_prompts"] == 1 and report["tau"] > SHIPPED_TAU_FLOOR
    args = _args(*common, "--drafter", "runs/default", "--json", str(tmp_path / "run.json"))
    assert args.run(args) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["drafter"].endswith("step_00000002/drafter") and report["greedy_mismatches"] == 0


def test_eval_of_a_training_run_takes_its_target_prompts_and_latest_checkpoint(tmp_path, monkeypatch, capsys):
    """`flashdraft eval --drafter RUN` on what a tiny `flashdraft train` wrote: the latest complete checkpoint, with
    the target, dtype and held-out prompts of the run's config.json; a flag given still wins."""
    from flashdraft import bundled, cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    quick = [
        *SHIPPED_DRAFTER,
        "train.max_steps=2",
        "train.batch_size=1",
        "data.eval_limit=1",
        "data.eval_max_new_tokens=4",
    ]
    assert cli.main(["train", "--out", str(run), *quick]) == 0
    capsys.readouterr()
    common = ["eval", "--drafter", str(run), "--limit", "1", "--max-new-tokens", "8", "--no-progress"]
    assert cli.main([*common, "--json", "a.json"]) == 0
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["drafter"] == str(run / "checkpoints" / "step_00000002" / "drafter")
    assert report["target"] == "bundled" and report["prompts"] == str(bundled.eval_prompts())
    assert report["num_prompts"] == 1 and report["greedy_mismatches"] == 0
    # What the run's config.json names is what eval uses, unless the command line says otherwise.
    settings = json.loads((run / "config.json").read_text())
    prompts = _write(tmp_path / "mine.jsonl", [json.dumps({"prompt": "def add(a, b):"})])
    settings["target"]["dtype"], settings["data"]["eval_prompts"] = "bfloat16", str(prompts)
    (run / "config.json").write_text(json.dumps(settings))
    assert cli.main([*common, "--json", "b.json"]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert (report["dtype"], report["prompts"]) == ("bfloat16", str(prompts))
    assert cli.main([*common, "--dtype", "float32", "--prompts", str(bundled.eval_prompts()), "--json", "c.json"]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert (report["dtype"], report["prompts"]) == ("float32", str(bundled.eval_prompts()))


def test_plot_without_matplotlib_is_refused_before_the_models_load(capsys, tmp_path, monkeypatch):
    from flashdraft import cli

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    # Models that do not exist: had the check come after loading them, the error would name them instead.
    code = cli.main(
        [
            "eval",
            "--target",
            str(tmp_path / "no-target"),
            "--drafter",
            str(tmp_path / "no-drafter"),
            "--prompts",
            str(prompts),
            "--plot",
            str(tmp_path / "eval.png"),
        ]
    )
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "flashdraft eval: error: --plot needs matplotlib: pip install 'flashdraft[plot]', or leave out --plot"
    ]


def test_eval_refine_drafts_in_passes(models, tmp_path, capsys):
    from flashdraft.cli import main

    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"the {w} sat on the mat"}) for w in WORDS[:3]])
    common = ["eval", "--target", str(models / "target"), "--drafter", str(models / "drafter"), "--prompts"]
    common += [str(prompts), "--max-new-tokens", "12", "--no-progress", "--device", "cpu"]
    assert main([*common, "--refine", "1,2", "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["refine"] == [1, 2] and report["greedy_mismatches"] == 0
    # The title names the passes; greedy rounds use no verification rule, so it names none.
    title = next(line for line in capsys.readouterr().out.splitlines() if "DFlash, block" in line)
    assert title.strip() == "DFlash, block 4, temperature 0.0, 3 passes"
    # each: one more draft kept per pass, up to the block size (4 here) - 2
    assert main([*common, "--refine", "each", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["refine"] == [1, 2]
    assert main([*common, "--refine", "each", "--block-size", "3", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["refine"] == [1]
    capsys.readouterr()
    for bad, message in (
        ("1,x", "--refine 1,x: eval.refine[1]: expected int, got str 'x'"),
        ("2,1", "--refine 2,1: eval.refine = [2, 1]: expected ascending"),
        ("3", "within 1 … 2"),
    ):
        assert main([*common, "--refine", bad]) == 2, bad
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (bad, err)


def test_eval_verify_chooses_how_sampled_drafts_are_verified(models, tmp_path, capsys, monkeypatch):
    """--verify reaches the verification of every speculative method (block by default) and the report."""
    import importlib

    from flashdraft.cli import main

    plain_loop = importlib.import_module("flashdraft.speculative.generate")
    seen = []
    verify_drafts = plain_loop.rejection_sample

    def spy(*args):
        if args[0].numel():  # a round with drafts (autoregressive decoding samples through it with none)
            seen.append(args[-1])
        return verify_drafts(*args)

    monkeypatch.setattr(plain_loop, "rejection_sample", spy)
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"the {w} sat on the mat"}) for w in WORDS[:2]])
    common = ["eval", "--target", str(models / "target"), "--drafter", str(models / "drafter"), "--prompts"]
    common += [str(prompts), "--max-new-tokens", "8", "--no-progress", "--device", "cpu", "--temperature", "1"]
    for flag, expected in (([], "block"), (["--verify", "token"], "token")):
        seen.clear()
        assert main([*common, *flag, "--json", str(tmp_path / "r.json")]) == 0
        assert json.loads((tmp_path / "r.json").read_text())["verify"] == expected
        assert seen and set(seen) == {expected}, (flag, set(seen))
        assert f"temperature 1.0, {expected} verification" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([*common, "--verify", "tree"])
    assert exit_info.value.code == 2 and "invalid choice: 'tree'" in capsys.readouterr().err


def test_eval_of_a_dspark_drafter_reports_its_confidence_calibration(tmp_path, capsys):
    """A drafter with a confidence head: its predicted acceptance per draft position against the observed, in the
    JSON (strict: positions no round reached are null) and as a table."""
    target = tiny_target("qwen3", dtype=torch.float32, seed=21, vocab_size=64)
    target.save_pretrained(tmp_path / "target")
    _tokenizer().save_pretrained(tmp_path / "target")
    random_drafter(target, block_size=4, seed=23, family="dspark").save_pretrained(tmp_path / "drafter")
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"the {w} sat on the mat"}) for w in WORDS[:3]])
    out_json = tmp_path / "r.json"
    args = _args(
        *("--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)),
        *("--max-new-tokens", "12", "--json", str(out_json), "--no-progress", "--ignore-eos", "--device", "cpu"),
    )
    assert args.run(args) == 0
    report = _strict_json(out_json)
    table = report["confidence_calibration"]
    # sample_from_anchor (DSpark's default): the anchor's slot drafts too, block_size drafts per round.
    assert [row["position"] for row in table] == [1, 2, 3, 4]
    # Position 1 is reached by every round that drafted (all but a last one left a single token to emit).
    rounds = sum(report["acceptance_length_histogram"].values())
    assert rounds - 3 <= table[0]["rounds"] == table[0]["survival_rounds"] <= rounds
    for row in table:
        assert set(row) == {
            "position",
            "predicted",
            "observed",
            "rounds",
            "predicted_survival",
            "observed_survival",
            "survival_rounds",
        }
        assert (row["predicted"] is None) == (row["observed"] is None) == (row["rounds"] == 0)
        assert 0 < row["predicted_survival"] < 1
    printed = capsys.readouterr().out
    assert "confidence head: predicted against observed acceptance" in printed
    # The report names the drafter by its family, and the JSON says which it is.
    assert report["drafter_family"] == "dspark"
    assert "DSpark, block 4, temperature 0.0" in printed and "DFlash" not in printed
    assert "per-position acceptance (draft 1..4):" in printed  # its anchor's slot drafts too
    # Prompt lookup verifies as wide a block as the drafter (its anchor slot drafts: one token more).
    assert len(report["methods"]["prompt_lookup"]["per_position_acceptance"]) == 4


def test_slow_prompts_are_named_in_a_warning(models, tmp_path, capsys):
    """A report whose DFlash prompt 2 ran its steady rounds at 5x the median prints a warning naming it, its
    numbers and what may cause it."""
    from rich.console import Console

    from flashdraft.speculative.report import print_report

    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"the {w} sat on the mat"}) for w in WORDS[:3]])
    out_json = tmp_path / "r.json"
    common = ["--max-new-tokens", "8", "--json", str(out_json), "--no-progress", "--device", "cpu"]
    args = _args(
        *common, "--target", str(models / "target"), "--drafter", str(models / "drafter"), "--prompts", str(prompts)
    )
    assert args.run(args) == 0
    report = _strict_json(out_json)
    capsys.readouterr()
    row = next(r for r in report["per_prompt"] if r["method"] == "dflash" and r["prompt"] == 1)
    slow = {**row, "category": "[bold]code", "steady_round_ms": 50.0, "median_steady_round_ms": 10.0}
    report["slow_prompts"] = [{**slow, "times_median": 5.0}]
    console = Console(width=200, record=True)
    print_report(report, console=console)
    text = console.export_text()
    assert "warning: 1 prompt(s) with steady rounds over 2x their method's median:" in text
    assert "DFlash, prompt 2 ([bold]code" in text and "steady round 50.00 ms, 5.0x the median 10.00 ms" in text
    assert "recaptured" in text or "captured again" in text
    assert "fallback to the plain loop" in text and "host synchronisation per token" in text
    # Many slow prompts (a loaded machine): the slowest are named, the rest counted.
    report["slow_prompts"] = [{**slow, "prompt": i, "times_median": 2.0 + i / 10} for i in range(12)]
    console = Console(width=200, record=True)
    print_report(report, console=console)
    text = console.export_text()
    assert "warning: 12 prompt(s)" in text and "... and 4 more (the JSON report's slow_prompts lists them all)" in text
    named = [n for n in range(1, 13) if f"DFlash, prompt {n} (" in text]
    assert named == list(range(5, 13))  # the 8 slowest: prompts 4 .. 11, shown 1-based
