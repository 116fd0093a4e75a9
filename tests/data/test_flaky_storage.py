"""Storage that flakes: the real readers (s3fs / aiobotocore over HTTP) stream JSONL, Parquet and offline features
through FaultyS3, a proxy in front of moto that throttles (503 SlowDown), resets connections mid-body and stalls
bodies, by request count. Within `s3.attempts` every record is read exactly once, in order; past it the error is
a DataError naming the URL and what happened (the CLI: exit 2, no traceback)."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from flashdraft.config import S3Config
from flashdraft.data import DataError, iter_records
from flashdraft.data import resolve_sources as resolve

from .faulty_s3 import FaultyS3

pytest.importorskip("s3fs")

# 1 s of silence is a stall; 3 tries per request and per body.
S3 = S3Config(connect_timeout=2, read_timeout=1, attempts=3)
N = 20_000
CUT = {"reset": "cut off mid-body 3 times", "stall": "stalled mid-body", "503": "kept throttling (503 SlowDown)"}


def records(n: int = N) -> list[dict]:
    # Lengths vary so that reads end mid-line.
    return [{"id": i, "text": "x" * (40 + i * 7 % 97)} for i in range(n)]


def jsonl(recs) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in recs)


@pytest.fixture
def proxy(s3, monkeypatch):
    """(boto3 client, bucket, FaultyS3 in front of moto); s3fs reads in 256 KiB blocks, so a 2 MiB file takes
    several ranged GETs and a fault can fall after records were already yielded (as in a file of gigabytes)."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "default_block_size", 256 << 10)
    client, bucket, endpoint = s3
    front = FaultyS3(endpoint, stall_s=S3.read_timeout + 1)
    yield client, bucket, front
    front.close()


def read_ids(proxy, key: str) -> tuple[list[int], list[int]]:
    """(ids read, how many object GETs the proxy had seen when each record arrived)."""
    _, bucket, front = proxy
    files = resolve([f"s3://{bucket}/{key}"], endpoint_url=front.url, s3=S3)
    ids, gets = [], []
    for rec in iter_records(files):
        ids.append(rec.data["id"])
        gets.append(len(front.gets))
    return ids, gets


@pytest.mark.parametrize("fault", ["503", "reset", "stall"])
def test_jsonl_through_faults_reads_every_record_once(proxy, fault):
    client, bucket, front = proxy
    body = jsonl(records())
    assert body[(1 << 20) - 1 : 1 << 20] != b"\n"  # the 1 MiB read that the fault interrupts ends mid-line
    client.put_object(Bucket=bucket, Key="d/a.jsonl", Body=body)
    front.plan = [None, fault, fault]  # the second GET fails twice: the third try, the last allowed, passes
    ids, gets = read_ids(proxy, "d/a.jsonl")
    assert ids == list(range(N))  # none twice, none skipped, in order
    assert gets.count(1) > 0  # records were yielded before the faulty GET
    first, *tries = front.gets[1:4]
    # Read again from where the transfer stopped (a ranged GET of the same bytes), not from the file's start.
    assert [g[2] for g in front.gets[1:4]] == [fault, fault, None] and all(t[1] == first[1] for t in tries)
    assert first[1].startswith("bytes=") and not first[1].startswith("bytes=0-")


def test_gzip_jsonl_cut_off_mid_stream_resumes(proxy):
    client, bucket, front = proxy
    body = gzip.compress(jsonl(records()), compresslevel=0)  # stored: large enough for several GETs
    client.put_object(Bucket=bucket, Key="d/a.jsonl.gz", Body=body)
    front.plan = [None, "reset", "stall"]
    ids, _ = read_ids(proxy, "d/a.jsonl.gz")
    assert ids == list(range(N)) and [g[2] for g in front.gets[:4]] == [None, "reset", "stall", None]


def parquet(recs, row_group_size: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist(recs), buf, row_group_size=row_group_size, compression="none", use_dictionary=False
    )
    return buf.getvalue()


def test_parquet_through_faults_reads_every_row_once(proxy):
    client, bucket, front = proxy
    client.put_object(Bucket=bucket, Key="p/a.parquet", Body=parquet(records(), row_group_size=2_000))
    # The footer is read first; then one read of a row group is throttled and cut off, the next one stalls.
    front.plan = [None, None, "503", "reset", None, "stall"]
    ids, gets = read_ids(proxy, "p/a.parquet")
    assert ids == list(range(N)) and gets.count(len(front.gets)) < N  # several GETs, all rows once
    assert front.gets[2][1] == front.gets[3][1] == front.gets[4][1] and front.gets[5][1] == front.gets[6][1]


@pytest.mark.parametrize("fault", ["503", "reset", "stall"])
def test_past_the_attempts_the_error_names_the_url_and_the_fault(proxy, fault):
    client, bucket, front = proxy
    client.put_object(Bucket=bucket, Key="d/a.jsonl", Body=jsonl(records()))
    front.plan = [None] + [fault] * 3
    with pytest.raises(DataError) as info:
        read_ids(proxy, "d/a.jsonl")
    text = str(info.value)
    assert text.startswith(f"s3://{bucket}/d/a.jsonl: ") and CUT[fault] in text and front.url in text
    assert not info.value.skippable  # --skip-bad must not drop a file's records for a flaky network
    assert len(front.gets) == 4  # bounded: 3 tries of the faulty range, no more


def test_the_cli_reports_storage_that_keeps_failing_with_exit_2(proxy, tokenizer_dir, tmp_path, capsys):
    from flashdraft import cli

    client, bucket, front = proxy
    client.put_object(Bucket=bucket, Key="d/a.jsonl", Body=jsonl(records(50)))
    front.plan = ["503"] * 3
    spec = f"s3://{bucket}/d/a.jsonl"
    argv = ["prepare", "--data", spec, "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o")]
    argv += ["--endpoint-url", front.url, "--s3-read-timeout", "1", "--no-progress", "--skip-bad"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and f"{spec}: the S3 endpoint {front.url} kept throttling (503 SlowDown)" in err, err
    assert "Traceback" not in err and len(front.gets) == 3


@pytest.fixture
def remote_features(proxy, make_features, tmp_path, monkeypatch):
    """(local FeatureStore, its copy on S3 read through the proxy); features.json's first GET is cut off."""
    from flashdraft.data.features import FeatureStore

    client, bucket, front = proxy
    root, _ = make_features(tmp_path, n=6)
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"feat/{path.relative_to(root)}", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ENDPOINT_URL", front.url)
    front.plan = ["reset"]
    remote = FeatureStore(f"s3://{bucket}/feat", s3=S3)
    assert [g[2] for g in front.gets] == ["reset", None] and front.gets[0][0].endswith("feat/features.json")
    return FeatureStore(root), remote


def test_features_through_faults_read_each_sample_as_written(proxy, remote_features):
    import torch

    _, _, front = proxy
    local, remote = remote_features
    front.gets.clear()
    # A part file's header (2 GETs), then one GET per sample: throttled, cut off and stalled within the attempts.
    front.plan = ["503", "reset", None, "stall", None, "reset", "reset"]
    for i in range(6):
        assert torch.equal(remote.sample(i), local.sample(i))
    assert len(front.gets) == 2 + 6 + 5  # each fault cost one more GET of the same bytes
    assert front.gets[5][1] == front.gets[6][1] == front.gets[7][1]


def test_features_past_the_attempts_are_a_data_error_naming_the_file(proxy, remote_features):
    from flashdraft.data.features import FeatureStore

    _, bucket, front = proxy
    _, remote = remote_features
    front.gets.clear()
    front.plan = ["reset"] * 3
    with pytest.raises(DataError, match=rf"s3://{bucket}/feat/.*: the transfer .* was cut off mid-body 3 times"):
        remote.sample(0)
    assert len(front.gets) == 3
    front.plan = ["stall"] * 3
    with pytest.raises(DataError, match=rf"s3://{bucket}/feat/features.json: the transfer .* stalled mid-body"):
        FeatureStore(f"s3://{bucket}/feat", s3=S3)
