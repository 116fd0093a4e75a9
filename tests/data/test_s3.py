"""S3 through the real s3fs/aiobotocore stack against moto in server mode on 127.0.0.1 (nothing mocked in-process)."""

import gzip
import io
import json

import pytest

from flashdraft.data import DataError, DataReport, PrepareConfig, TokenizedDataset, iter_records, prepare_shards
from flashdraft.data import resolve_sources as resolve

from .conftest import FAKE_KEY_ID, FAKE_SECRET

pytest.importorskip("s3fs")

CHATS = [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]}
         for i in range(6)]  # fmt: skip


def jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def parquet(records, row_group_size) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf, row_group_size=row_group_size)
    return buf.getvalue()


@pytest.fixture
def bucket(s3):
    client, name, endpoint = s3
    client.put_object(Bucket=name, Key="chat/part-0.jsonl", Body=jsonl(CHATS[:2]))
    client.put_object(Bucket=name, Key="chat/part-1.jsonl.gz", Body=gzip.compress(jsonl(CHATS[2:4])))
    client.put_object(Bucket=name, Key="chat/notes.txt", Body=b"ignored")
    client.put_object(Bucket=name, Key="pq/part-0.parquet", Body=parquet(CHATS[4:], row_group_size=1))
    return name, endpoint


def test_read_jsonl_and_parquet(bucket):
    name, endpoint = bucket
    files = resolve([f"s3://{name}/chat/*.jsonl*", f"s3://{name}/pq/"], endpoint_url=endpoint)
    assert [f.url for f in files] == [f"s3://{name}/chat/part-0.jsonl", f"s3://{name}/chat/part-1.jsonl.gz",
                                      f"s3://{name}/pq/part-0.parquet"]  # fmt: skip
    assert all(f.fingerprint.split(":", 1)[1] for f in files)  # ETags identify the content
    report, seen = DataReport(), []
    records = list(iter_records(files, report, progress=seen.append))
    assert [r.data for r in records] == CHATS
    assert [r.where() for r in records][-2:] == [f"s3://{name}/pq/part-0.parquet row 0",
                                                 f"s3://{name}/pq/part-0.parquet row 1"]  # fmt: skip
    assert sum(seen) == sum(f.size for f in files)
    assert [r.data for r in iter_records(resolve([f"s3://{name}/chat/part-0.jsonl"], endpoint_url=endpoint))] == CHATS[
        :2
    ]


def test_prepare_from_s3(bucket, tokenizer, tmp_path, local_copy):
    name, endpoint = bucket
    cfg = PrepareConfig(data=[f"s3://{name}/chat/", f"s3://{name}/pq/*.parquet"], tokenizer="-",
                        out=str(tmp_path / "s3"), endpoint_url=endpoint, progress=False)  # fmt: skip
    res = prepare_shards(cfg, tokenizer=tokenizer)
    assert res.counts["kept"] == 6 and res.counts["files"] == 3
    local = prepare_shards(PrepareConfig(data=[local_copy], tokenizer="-", out=str(tmp_path / "local"), progress=False),
                    tokenizer=tokenizer)  # fmt: skip
    a, b = TokenizedDataset(res.path), TokenizedDataset(local.path)
    assert [a[i][0].tolist() for i in range(6)] == [b[i][0].tolist() for i in range(6)]
    assert [a[i][1].tolist() for i in range(6)] == [b[i][1].tolist() for i in range(6)]
    meta = json.dumps(a.meta)
    assert FAKE_SECRET not in meta and FAKE_KEY_ID not in meta and a.meta["endpoint_url"] == endpoint
    assert prepare_shards(cfg, tokenizer=tokenizer).reused  # the ETags did not change


def test_endpoint_from_environment(bucket, monkeypatch):
    name, endpoint = bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert len(list(iter_records(resolve([f"s3://{name}/chat/part-0.jsonl"])))) == 2


@pytest.fixture
def local_copy(tmp_path, write_jsonl):
    return write_jsonl(tmp_path / "local.jsonl", CHATS)


def test_missing_objects(bucket):
    name, endpoint = bucket
    for spec, text in [(f"s3://{name}/nope/*.jsonl", "matches no"), (f"s3://{name}/nope.jsonl", "no such file"),
                       (f"s3://{name}-missing/x.jsonl", "no such file")]:  # fmt: skip
        with pytest.raises(DataError, match=text) as e:
            resolve([spec], endpoint_url=endpoint)
        assert spec in str(e.value) and not e.value.skippable


def test_no_credentials(moto_server, no_aws, monkeypatch, tmp_path, tokenizer_dir, capsys):
    """A secret without a key id is no credentials: a clear error naming the path, and the secret never shown."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    spec = "s3://some-bucket/data/*.jsonl"
    with pytest.raises(DataError, match="no S3 credentials found") as e:
        resolve([spec], endpoint_url=moto_server)
    assert spec in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)
    assert FAKE_SECRET not in str(e.value) and not e.value.skippable

    from flashdraft import cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "prepare", "flashdraft.data.prepare")
    code = cli.main(["prepare", "--data", spec, "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"),
                     "--endpoint-url", moto_server, "--no-progress", "--skip-bad"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2 and "no S3 credentials found" in captured.err and spec in captured.err
    assert FAKE_SECRET not in captured.err + captured.out and "Traceback" not in captured.err

    # a key id without a secret (partial credentials) is just as clear
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    with pytest.raises(DataError, match="no S3 credentials found") as e:
        resolve([spec], endpoint_url=moto_server)
    assert FAKE_KEY_ID not in str(e.value)
