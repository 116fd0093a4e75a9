"""examples/tiny_target/train_mtp.py at the smallest size on the CPU: the chained objective trains every step it
reports, the target's states are cached and reused, and the head is saved under the checkpoint's names."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flashdraft import bundled
from tests.scripts import TINY_TARGET, load_script


@pytest.fixture
def script():
    return load_script(TINY_TARGET / "train_mtp.py")


@pytest.fixture
def corpus(tmp_path):
    # Token files as corpus.py writes them, of the package's own text (the regenerated rows; the held-out prompts).
    tokenizer = bundled.load_tokenizer()
    (tmp_path / "corpus").mkdir()
    for name, source, field in (("train", "train.jsonl", "response"), ("heldout", "eval.jsonl", "prompt")):
        text = "".join(json.loads(line)[field] for line in (bundled.ASSETS / source).read_text().splitlines()[:40])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        np.asarray(ids, dtype=np.uint16).tofile(tmp_path / "corpus" / f"{name}.u16")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join((bundled.ASSETS / "train.jsonl").read_text().splitlines(keepends=True)[:6]))
    return tmp_path / "corpus", rows


def test_chained_training_runs_reports_each_step_and_reuses_the_target_states(script, corpus, tmp_path, capsys):
    directory, rows = corpus
    out = tmp_path / "mtp"
    args = ["--corpus", str(directory), "--out", str(out), "--rows", str(rows), "--windows", "4", "--heldout", "2"]
    args += ["--seq", "24", "--chain", "2", "--steps", "30", "--batch", "4", "--eval-every", "15", "--warmup", "2"]
    torch.manual_seed(0)
    script.main(args)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "heldout_loss" in m]
    assert [m["step"] for m in evals] == [0, 15, 30]
    assert all(len(m["agreement_by_step"]) == 2 and m["agreement"] == m["agreement_by_step"][0] for m in evals)
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    head = load_file(out / "mtp_head.safetensors")
    assert {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"} <= set(head)
    assert all(t.dtype == torch.bfloat16 for t in head.values())
    assert "target hidden states from" not in capsys.readouterr().out
    script.main(args)  # the same data: the cached states are read back
    assert "target hidden states from" in capsys.readouterr().out


def test_a_chain_longer_than_the_windows_is_refused(script, corpus, tmp_path):
    directory, rows = corpus
    with pytest.raises(SystemExit):
        script.main(["--corpus", str(directory), "--out", str(tmp_path / "m"), "--rows", str(rows), "--seq", "4"])
