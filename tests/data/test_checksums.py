"""Data that rots: a byte damaged on disk in a shard file or an offline features file is found the first time its
records are read, named with the file and the records, before any batch holding them is returned; undamaged data
reads back as written; files written before checksums existed are read with one warning."""

from __future__ import annotations

import json
import logging
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from flashdraft.config import load_config
from flashdraft.data import DataError, PrepareConfig, TokenizedDataset, checksums, prepare_shards
from flashdraft.data.features import FeatureStore
from flashdraft.data.shards import INDEX, INPUT_IDS, LOSS_MASK, META
from flashdraft.train.dataloader import DataLoader
from tests.data.conftest import flip, sample_offset

PART = "part-00000-00000.safetensors"


def _index_header_bytes(out) -> int:
    return (out / INDEX).stat().st_size - 16 * len(np.load(out / INDEX))


def _byte_of(out, name: str, record: int) -> int:
    """The offset in file `name` of the first byte of `record`."""
    offset = int(np.load(out / INDEX)[record, 0])
    return {INPUT_IDS: 4 * offset, LOSS_MASK: offset, INDEX: _index_header_bytes(out) + 16 * record}[name]


def test_undamaged_shards_read_back_as_written_and_each_chunk_is_hashed_once(tmp_path, make_shards, monkeypatch):
    out, samples = make_shards(tmp_path / "shards", 600)  # chunks of 256: records 0-255, 256-511, 512-599
    sums = json.loads((out / META).read_text())["checksums"]
    assert len(sums["input_ids"]) == len(sums["loss_mask"]) == len(sums["index"]) == 3
    hashed = []

    def crc32(data, value=0):
        hashed.append(len(data))
        return zlib.crc32(data, value)

    monkeypatch.setattr(checksums, "zlib", SimpleNamespace(crc32=crc32))
    ds = TokenizedDataset(out)
    opened = len(hashed)  # the index header only
    for i in range(len(samples)):
        ids, mask = ds[i]
        assert np.array_equal(ids, samples[i].input_ids) and np.array_equal(mask, samples[i].loss_mask), i
    assert len(hashed) - opened == 3 * 3  # three chunks of three files, hashed once each
    for i in range(len(samples)):
        ds[i]
    assert len(hashed) - opened == 9  # read again: nothing hashed


@pytest.mark.parametrize("name", [INPUT_IDS, LOSS_MASK, INDEX])
def test_a_flipped_byte_in_a_shard_file_is_found_on_read_naming_the_file_and_records(tmp_path, make_shards, name):
    out, samples = make_shards(tmp_path / "shards", 600)
    flip(out / name, _byte_of(out, name, 300))
    ds = TokenizedDataset(out)
    ids, _ = ds[255]  # another chunk reads as before
    assert np.array_equal(ids, samples[255].input_ids)
    for record in (256, 300, 511):  # any record of the damaged chunk, not only the damaged one
        with pytest.raises(
            DataError, match=rf"{out / name}: records 256-511 fail their checksum \(stored [0-9a-f]{{8}}"
        ):
            ds[record]
    assert np.array_equal(ds[512][0], samples[512].input_ids)


def test_no_batch_holding_a_damaged_record_is_returned(tmp_path, make_shards):
    """The training loader reads in a shuffled order: the batches before the first one that holds a record of the
    damaged chunk come back, that one does not."""
    out, _ = make_shards(tmp_path / "shards", 520)  # the last chunk: records 512-519
    flip(out / INPUT_IDS, _byte_of(out, INPUT_IDS, 515))
    cfg = load_config(None, ["train.batch_size=2", "train.device=cpu"])
    loader = DataLoader(TokenizedDataset(out), cfg, block_size=4, mask_token_id=0, device="cpu")
    returned = []
    with pytest.raises(DataError, match=r"input_ids.bin: records 512-519 fail their checksum"):
        for step in range(loader.steps_per_epoch):
            returned += [i for micro in loader.batch(step) for i in micro.indices]
    assert len(returned) > 10 and max(returned) < 512


def test_a_damaged_index_header_stops_the_open(tmp_path, make_shards):
    out, _ = make_shards(tmp_path / "shards", 40)
    flip(out / INDEX, 20)  # inside the header's shape and dtype
    with pytest.raises(DataError, match=rf"{out / INDEX}: the header fails its checksum"):
        TokenizedDataset(out)


def test_shards_without_checksums_are_read_with_one_warning_and_reused_by_prepare(
    tmp_path, tokenizer, write_jsonl, make_chat, caplog
):
    """Format 1 (before checksums) has the same token files, so the same content hash: prepare reuses it (the
    features captured from it stay valid) and it reads as before, with one warning per directory and process."""
    data = write_jsonl(tmp_path / "d.jsonl", [make_chat(("user", "Hi"), ("assistant", f"Hello {i}")) for i in range(5)])
    job = PrepareConfig(data=[data], tokenizer="unused", out=str(tmp_path / "shards"), progress=False)
    out = prepare_shards(job, tokenizer=tokenizer).path
    meta = json.loads((out / META).read_text())
    expected = [TokenizedDataset(out)[i][0].tolist() for i in range(5)]
    del meta["checksums"]
    (out / META).write_text(json.dumps({**meta, "format_version": 1}))
    flip(out / INPUT_IDS, 0)  # cannot be found without checksums: this is what the warning says
    with caplog.at_level(logging.WARNING, logger="flashdraft.data.checksums"):
        assert prepare_shards(job, tokenizer=tokenizer).reused
        first, second = TokenizedDataset(out), TokenizedDataset(out)
    warned = [r.getMessage() for r in caplog.records if "without checksums" in r.getMessage()]
    assert len(warned) == 1 and str(out) in warned[0] and "prepare --force" in warned[0]
    assert [second[i][0].tolist() for i in range(1, 5)] == expected[1:] and first[0][0].tolist() != expected[0]


def test_garbled_checksums_in_meta_are_refused(tmp_path, make_shards):
    out, _ = make_shards(tmp_path / "shards", 40)
    meta = json.loads((out / META).read_text())
    meta["checksums"]["input_ids"] = []
    (out / META).write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"{out / META}: field 'checksums': expected a crc32 per chunk"):
        TokenizedDataset(out)


# ---- offline features


def test_a_flipped_byte_in_a_features_file_is_found_on_read_naming_the_file_and_record(tmp_path, make_features):
    url, data = make_features(tmp_path)
    before = [FeatureStore(url).sample(i) for i in range(len(data))]
    flip(tmp_path / "features" / PART, sample_offset(tmp_path / "features" / PART, 3) + 5)
    store = FeatureStore(url)
    assert all(store.sample(i).equal(before[i]) for i in (0, 1, 2, 4, 5))  # the others read as before
    with pytest.raises(DataError, match=rf"{url}/{PART}: record 3 fails its checksum \(stored [0-9a-f]{{8}}, read"):
        store.sample(3)
    with pytest.raises(DataError, match="record 3 fails its checksum"):
        store.batch([2, 3], 8)  # no batch holding it


@pytest.mark.parametrize("damaged", ["header", "head.safetensors", "config.json"])
def test_a_damaged_features_header_head_or_config_is_named(tmp_path, make_features, damaged):
    url, _ = make_features(tmp_path)
    if damaged == "header":
        flip(tmp_path / "features" / PART, 20)
        store = FeatureStore(url)
        with pytest.raises(DataError, match=rf"{url}/{PART}: the header \(of records 0, 1, 2, 3, …\) fails its"):
            store.sample(4)
    else:
        flip(tmp_path / "features" / damaged, -3)
        with pytest.raises(DataError, match=rf"{url}/{damaged}: the file fails its checksum"):
            FeatureStore(url).file(damaged)


def test_features_without_checksums_are_read_with_one_warning(tmp_path, make_features, caplog):
    url, _ = make_features(tmp_path)
    index = json.loads((tmp_path / "features" / "features.json").read_text())
    del index["checksums"]
    (tmp_path / "features" / "features.json").write_text(json.dumps({**index, "format": "flashdraft-features/1"}))
    with caplog.at_level(logging.WARNING, logger="flashdraft.data.checksums"):
        stores = FeatureStore(url), FeatureStore(url)
    warned = [r.getMessage() for r in caplog.records if "without checksums" in r.getMessage()]
    assert len(warned) == 1 and url in warned[0] and "flashdraft features" in warned[0]
    assert stores[1].sample(3).equal(stores[0].sample(3))
