"""`flashdraft eval` with the target's MTP layer as a baseline, and the context-length sweep."""

import json

import pytest
import torch

from flashdraft.target.mtp import MTPHead, write_mtp
from tests.cli.test_eval import _args
from tests.speculative import one_thread, random_drafter, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from tests.speculative.test_prompts import _tokenizer, _write

PROMPTS = [
    json.dumps({"prompt": "the cat sat on the mat and the dog ran far away", "category": "text"}),
    json.dumps({"messages": [{"role": "user", "content": "is the red cat good"}], "category": "chat"}),
]
ROWS = ["DFlash", "MTP (3 drafts)", "prompt lookup", "autoregressive"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3.5 target saved with a (random) MTP layer under the released names, one without, a drafter."""
    root = tmp_path_factory.mktemp("mtp-eval")
    target = tiny_target("qwen3_5", dtype=torch.float32, seed=21, vocab_size=64)
    target.generation_config.eos_token_id = 2
    target.save_pretrained(root / "plain")
    _tokenizer().save_pretrained(root / "plain")
    torch.manual_seed(23)
    write_mtp(root / "plain", MTPHead.for_target(target), root / "target")
    random_drafter(target, block_size=4, seed=22).save_pretrained(root / "drafter")
    return root


def _run(models, tmp_path, *extra, target="target"):
    prompts = _write(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "r.json"
    args = _args(
        *("--target", str(models / target), "--drafter", str(models / "drafter"), "--prompts", str(prompts)),
        *("--max-new-tokens", "10", "--json", str(out), "--no-progress", "--ignore-eos", "--device", "cpu"),
        *extra,
    )
    assert args.run(args) == 0
    return json.loads(out.read_text())


def _method_rows(printed: str) -> list[str]:
    table = printed.split("every method on the same prompts")[1].split("where the time goes")[0]
    return [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]


def test_mtp_is_a_default_baseline_when_the_target_ships_it(models, tmp_path, capsys):
    report = _run(models, tmp_path)
    assert report["methods_run"] == ["dflash", "mtp", "prompt_lookup", "autoregressive"]
    assert report["tokens"] == dict.fromkeys(report["methods_run"], 20)
    assert report["greedy_mismatches"] == 0 and report["mtp_drafts"] == 3
    mtp = report["methods"]["mtp"]
    assert report["mtp_tau"] == mtp["tau"] and 1 <= mtp["tau"] <= 4 and len(mtp["per_position_acceptance"]) == 3
    tps = report["tokens_per_second"]
    assert report["mtp_speedup"] == pytest.approx(tps["mtp"] / tps["autoregressive"])
    assert report["speedup_vs_mtp"] == pytest.approx(tps["dflash"] / tps["mtp"])
    assert _method_rows(capsys.readouterr().out) == ROWS


def test_baselines_pick_the_methods(models, tmp_path):
    report = _run(models, tmp_path, "--baselines", "mtp,ar", "--mtp-drafts", "2")
    assert report["methods_run"] == ["dflash", "mtp", "autoregressive"]
    assert len(report["methods"]["mtp"]["per_position_acceptance"]) == 2
    report = _run(models, tmp_path, "--baselines", "ar", target="plain")
    assert report["methods_run"] == ["dflash", "autoregressive"] and "mtp_tau" not in report
    # Without --baselines, a target without MTP weights is compared with ar and prompt lookup only.
    assert _run(models, tmp_path, target="plain")["methods_run"] == ["dflash", "prompt_lookup", "autoregressive"]


def test_baselines_mtp_on_a_target_without_mtp_is_a_clear_error(models, tmp_path, capsys):
    from flashdraft.cli import main

    prompts = _write(tmp_path / "p.jsonl", PROMPTS)
    common = [
        "eval",
        "--target",
        str(models / "plain"),
        "--drafter",
        str(models / "drafter"),
        "--prompts",
        str(prompts),
    ]
    assert main([*common, "--baselines", "ar,mtp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"target checkpoint {models / 'plain'} has no MTP weights" in err and "--baselines mtp" in err
    assert "Traceback" not in err
    assert main([*common, "--baselines", "ar,eagle"]) == 2
    assert "--baselines ar,eagle: eval.baselines = ['ar', 'eagle']: unknown eagle" in capsys.readouterr().err
    assert main([*common, "eval.baselines=[]"]) == 2
    assert "eval.baselines = []: an empty list: name at least one of ar" in capsys.readouterr().err
    assert main([*common, "--context-lengths", "1024,lots"]) == 2
    assert (
        "--context-lengths 1024,lots: eval.context_lengths[1]: expected int, got str 'lots'" in capsys.readouterr().err
    )


def test_context_lengths_sweep(models, tmp_path, capsys):
    report = _run(models, tmp_path, "--context-lengths", "40,25")
    rows = report["context_lengths"]
    assert [row["context_length"] for row in rows] == [25, 40]
    assert [row["prompt_tokens_mean"] for row in rows] == [25, 40]
    for row in rows:
        assert set(row["methods"]) == {"dflash", "mtp", "prompt_lookup", "autoregressive"}
        assert all(1 <= row["methods"][m]["tau"] <= 4 for m in ("dflash", "mtp", "prompt_lookup"))
        assert row["mtp_tau"] == row["methods"]["mtp"]["tau"] and row["tokens"]["mtp"] == 20
    assert report["greedy_mismatches"] == 0  # every length's outputs are checked against autoregressive decoding
    assert "tau and speedup by context length" in capsys.readouterr().out


def test_context_lengths_plot(models, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import image

    out = tmp_path / "eval.png"
    report = _run(models, tmp_path, "--context-lengths", "30,45", "--plot", str(out))
    pixels = torch.from_numpy(image.imread(out)[..., :3])
    third = pixels.shape[1] // 3
    # The right panel draws tau by context length: a line per speculative method in its colour.
    for color in ((0x2C, 0xA0, 0x2C), (0xFF, 0x7F, 0x0E), (0x1F, 0x77, 0xB4)):  # MTP, prompt lookup, DFlash
        mask = (pixels[:, 2 * third :] - torch.tensor(color) / 255).abs().amax(-1) < 0.02
        assert mask.sum() > 30, color
    assert len(report["context_lengths"]) == 2
