"""S3 through the real s3fs/aiobotocore stack against moto in server mode on 127.0.0.1 (nothing mocked in-process);
failing fast against a local server that accepts connections and never answers, and a port that refuses them."""

import contextlib
import gzip
import io
import json
import socket
import threading
import time

import pytest

from flashdraft.config import S3Config
from flashdraft.data import DataError, DataReport, PrepareConfig, TokenizedDataset, iter_records, prepare_shards
from flashdraft.data import resolve_sources as resolve
from flashdraft.data.remote import read_again_if_cut_off

from .conftest import FAKE_KEY_ID, FAKE_SECRET

pytest.importorskip("s3fs")

CHATS = [
    {"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]} for i in range(6)
]


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
    assert [f.url for f in files] == [
        f"s3://{name}/chat/part-0.jsonl",
        f"s3://{name}/chat/part-1.jsonl.gz",
        f"s3://{name}/pq/part-0.parquet",
    ]
    assert all(f.fingerprint.split(":", 1)[1] for f in files)  # ETags identify the content
    report, seen = DataReport(), []
    records = list(iter_records(files, report, progress=seen.append))
    assert [r.data for r in records] == CHATS
    assert [r.where() for r in records][-2:] == [
        f"s3://{name}/pq/part-0.parquet row 0",
        f"s3://{name}/pq/part-0.parquet row 1",
    ]
    assert sum(seen) == sum(f.size for f in files)
    assert [r.data for r in iter_records(resolve([f"s3://{name}/chat/part-0.jsonl"], endpoint_url=endpoint))] == CHATS[
        :2
    ]


def test_prepare_from_s3(bucket, tokenizer, tmp_path, local_copy):
    name, endpoint = bucket
    cfg = PrepareConfig(
        data=[f"s3://{name}/chat/", f"s3://{name}/pq/*.parquet"],
        tokenizer="-",
        out=str(tmp_path / "s3"),
        endpoint_url=endpoint,
        progress=False,
    )
    res = prepare_shards(cfg, tokenizer=tokenizer)
    assert res.counts["kept"] == 6 and res.counts["files"] == 3
    local = prepare_shards(
        PrepareConfig(data=[local_copy], tokenizer="-", out=str(tmp_path / "local"), progress=False),
        tokenizer=tokenizer,
    )
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
    for spec, text in [
        (f"s3://{name}/nope/*.jsonl", "matches no"),
        (f"s3://{name}/nope.jsonl", "no such file"),
        (f"s3://{name}-missing/x.jsonl", "no such file"),
    ]:
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

    code = cli.main(
        [
            "prepare",
            "--data",
            spec,
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(tmp_path / "o"),
            "--endpoint-url",
            moto_server,
            "--no-progress",
            "--skip-bad",
        ]
    )
    captured = capsys.readouterr()
    assert code == 2 and "no S3 credentials found" in captured.err and spec in captured.err
    assert FAKE_SECRET not in captured.err + captured.out and "Traceback" not in captured.err

    # a key id without a secret (partial credentials) is just as clear
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    with pytest.raises(DataError, match="no S3 credentials found") as e:
        resolve([spec], endpoint_url=moto_server)
    assert FAKE_KEY_ID not in str(e.value)


# ---- storage that fails fast ----------------------------------------------------------------------------------


@pytest.fixture
def silent_endpoint():
    """A TCP server on 127.0.0.1 that accepts every connection and never answers; yields (URL, accepted sockets)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


@pytest.fixture
def fake_credentials(no_aws, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)


@pytest.mark.slow
def test_a_silent_endpoint_fails_within_30_s_naming_the_url_and_the_setting(
    silent_endpoint, fake_credentials, tokenizer_dir, tmp_path, capsys
):
    from flashdraft import cli

    url, accepted = silent_endpoint
    spec = "s3://bucket/data/part-0.jsonl"
    started = time.monotonic()
    code = cli.main(
        [
            "prepare",
            "--data",
            spec,
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(tmp_path / "o"),
            "--endpoint-url",
            url,
            "--no-progress",
        ]
    )
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and took <= 30, (code, took, err)
    assert f"{spec}: no answer from the S3 endpoint {url} within s3.read_timeout = 8 s (3 attempts" in err
    assert "raise s3.read_timeout (flashdraft prepare: --s3-read-timeout)" in err and "Traceback" not in err
    assert len(accepted) == 3  # botocore's attempts, not multiplied by s3fs's own retries


def test_the_timeouts_and_attempts_reach_botocore(silent_endpoint, fake_credentials):
    url, accepted = silent_endpoint
    started = time.monotonic()
    with pytest.raises(DataError, match=r"no answer from .* within s3.read_timeout = 1 s \(2 attempts"):
        resolve(["s3://bucket/x.jsonl"], endpoint_url=url, s3=S3Config(read_timeout=1, attempts=2))
    assert time.monotonic() - started < 8 and len(accepted) == 2


def test_an_endpoint_that_refuses_connections_is_named(fake_credentials):
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(
        DataError,
        match=rf"s3://bucket/x.jsonl: cannot connect to the S3 endpoint {url} .*2 attempts"
        ".*raise s3.connect_timeout",
    ) as info:
        resolve(["s3://bucket/x.jsonl"], endpoint_url=url, s3=S3Config(attempts=2))
    assert not info.value.skippable and time.monotonic() - started < 10


def test_moto_reads_with_the_configured_client(bucket):
    name, endpoint = bucket
    s3 = S3Config(connect_timeout=2, read_timeout=3, attempts=4)
    files = resolve([f"s3://{name}/chat/", f"s3://{name}/pq/"], endpoint_url=endpoint, s3=s3)
    assert [r.data for r in iter_records(files)] == CHATS
    fs = files[0].fs
    config = fs.s3.meta.config
    assert (config.connect_timeout, config.read_timeout) == (2, 3)
    assert config.retries == {"total_max_attempts": 4, "mode": "standard"} and fs.retries == 1


class ClientPayloadError(Exception):
    """Named as aiohttp's: a response body cut off mid-transfer."""


def test_a_transfer_cut_off_is_read_again_and_nothing_else_is():
    calls = []

    def cut_once():
        calls.append(1)
        if len(calls) == 1:
            raise ClientPayloadError("Response payload is not completed")
        return b"data"

    assert read_again_if_cut_off(cut_once, 3, "s3://b/k") == b"data" and len(calls) == 2
    calls.clear()

    def always_cut():
        calls.append(1)
        raise ClientPayloadError("cut")

    with pytest.raises(ClientPayloadError):
        read_again_if_cut_off(always_cut, 3, "s3://b/k")
    assert len(calls) == 3
    calls.clear()

    def broken():
        calls.append(1)
        raise ValueError("not a transfer problem")

    with pytest.raises(ValueError):
        read_again_if_cut_off(broken, 3, "s3://b/k")
    assert len(calls) == 1
