"""`flashdraft prepare --verify DIR` through the real CLI: OK and exit 0 on undamaged shards and features; every
damaged file and record range named, exit 1; no checksums, exit 1; neither kind of directory, exit 2. And damage
found while training stops `train` with exit 2 and the file named, no traceback."""

from __future__ import annotations

import json

from flashdraft import cli
from flashdraft.data.shards import INDEX, INPUT_IDS, LOSS_MASK, META
from tests import SHIPPED_DRAFTER
from tests.data.conftest import flip, sample_offset

PART = "part-00000-00000.safetensors"


def _verify(path, capsys) -> tuple[int, str]:
    code = cli.main(["prepare", "--no-progress", "--verify", str(path)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, " ".join((out.out + out.err).split())  # unwrapped


def test_verify_shards_names_every_damaged_file_and_range(tmp_path, make_shards, capsys):
    out, _ = make_shards(tmp_path / "shards", 600)  # chunks: records 0-255, 256-511, 512-599
    code, text = _verify(out, capsys)
    assert code == 0 and f"OK: the shards in {out}: 600 records verify" in text
    flip(out / INPUT_IDS, 4 * 3)  # record 0's tokens
    flip(out / LOSS_MASK, -1)  # the last record's mask
    code, text = _verify(out, capsys)
    assert code == 1 and "DAMAGED" in text
    assert f"{out / INPUT_IDS}: records 0-255 fail their checksum" in text
    assert f"{out / LOSS_MASK}: records 512-599 fail their checksum" in text
    assert "256-511" not in text


def test_verify_features_names_the_damaged_record_and_header(tmp_path, make_features, monkeypatch, capsys):
    monkeypatch.setattr("flashdraft.data.features.SHARD_BYTES", 1)  # one sample per part file
    url, _ = make_features(tmp_path)
    assert _verify(url, capsys)[0] == 0
    third, fifth = (tmp_path / "features" / f"part-00000-0000{k}.safetensors" for k in (3, 5))
    flip(third, sample_offset(third, 3))
    flip(fifth, 12)
    code, text = _verify(url, capsys)
    assert code == 1
    assert f"{third}: record 3 fails its checksum" in text
    assert f"{fifth}: the header (of record 5) fails its checksum" in text


def test_verify_without_checksums_fails_and_says_so(tmp_path, make_shards, capsys):
    out, _ = make_shards(tmp_path / "shards", 10)
    meta = json.loads((out / META).read_text())
    del meta["checksums"]
    (out / META).write_text(json.dumps({**meta, "format_version": 1}))
    code, text = _verify(out, capsys)
    assert code == 1 and f"cannot verify: the shards in {out} were written without checksums" in text


def test_verify_what_is_no_dataset_is_bad_input(tmp_path, capsys):
    code, text = _verify(tmp_path, capsys)
    assert code == 2 and f"{tmp_path}: neither a shard directory" in text


def test_verify_a_damaged_index_is_damage(tmp_path, make_shards, capsys):
    out, _ = make_shards(tmp_path / "shards", 10)
    flip(out / INDEX, 30)
    code, text = _verify(out, capsys)
    assert code == 1 and f"{out / INDEX}: the header fails its checksum" in text


def test_damage_found_by_train_is_exit_2_naming_the_file(tmp_path, make_features, capsys):
    """Offline training reads the target's head beside the features first: damaged, the run stops before it
    loads anything else, as it does on any record (the same DataError, through the same handler)."""
    url, _ = make_features(tmp_path)
    flip(tmp_path / "features" / "head.safetensors", -2)
    run = ["train", "--out", str(tmp_path / "run"), *SHIPPED_DRAFTER, f"data.features={url}", "train.device=cpu"]
    code = cli.main(run)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"flashdraft train: error: {url}/head.safetensors: the file fails its checksum" in " ".join(err.split())
