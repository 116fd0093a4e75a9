"""examples/tiny_target/ship.py: the drafter is written in bf16 beside the rows and prompts it ships with, or alone
(--drafter-only), leaving the shipped rows and prompts as they were."""

import json

import torch
from safetensors.torch import load_file

from flashdraft import bundled
from flashdraft.drafter import DFlashDraftModel
from tests.scripts import TINY_TARGET, load_script


def _float32_drafter(path):
    DFlashDraftModel.from_pretrained(bundled.drafter_dir(), dtype=torch.float32).save_pretrained(path)
    return path


def _rows(path, n, tag):
    path.write_text("".join(json.dumps({"prompt": f"{tag} {i}", "response": f"r{i}", "x": 1}) + "\n" for i in range(n)))


def test_ship_writes_the_drafter_in_bf16_with_rows_and_prompts(tmp_path):
    drafter, build, out = _float32_drafter(tmp_path / "drafter"), tmp_path / "build", tmp_path / "out"
    (build / "corpus").mkdir(parents=True)
    out.mkdir()
    _rows(build / "regen_t0.jsonl", 5, "t0")
    _rows(build / "regen_t1.jsonl", 4, "t1")
    (build / "corpus" / "heldout_prompts.jsonl").write_text('{"prompt": "held", "category": "c"}\n')
    load_script(TINY_TARGET / "ship.py").main(
        ["--drafter", str(drafter), "--build", str(build), "--out", str(out), "--rows", "3"]
    )
    weights = load_file(out / "drafter" / "model.safetensors")
    original = load_file(drafter / "model.safetensors")
    assert weights.keys() == original.keys() and all(w.dtype == torch.bfloat16 for w in weights.values())
    assert all(torch.equal(weights[k], original[k].to(torch.bfloat16)) for k in weights)
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(set(r) == {"prompt", "response"} for r in rows)
    assert sum(r["prompt"].startswith("t0") for r in rows) == 3
    assert (out / "eval.jsonl").read_text() == '{"prompt": "held", "category": "c"}\n'


def test_drafter_only_keeps_the_shipped_rows_and_prompts(tmp_path):
    drafter, out = _float32_drafter(tmp_path / "drafter"), tmp_path / "out"
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "stale.bin").write_text("old")
    (out / "train.jsonl").write_text("rows\n")
    (out / "eval.jsonl").write_text("prompts\n")
    load_script(TINY_TARGET / "ship.py").main(
        ["--drafter-only", "--drafter", str(drafter), "--out", str(out), "--build", "missing"]
    )
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "drafter" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "train.jsonl").read_text() == "rows\n" and (out / "eval.jsonl").read_text() == "prompts\n"
