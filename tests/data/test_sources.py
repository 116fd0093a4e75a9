"""Local sources: files, directories, globs, gzip, Parquet row groups; every malformed-input case names file + line."""

import gzip

import pytest

from flashdraft.data import DataError, DataReport, iter_records, resolve_sources
from flashdraft.data.errors import redact

REC = {"text": "hello"}


def read(specs, skip_bad=False):
    report = DataReport(skip_bad=skip_bad)
    records = list(iter_records(resolve_sources(specs), report))
    return records, report


def test_files_dirs_globs_gzip_parquet(tmp_path, write_jsonl, write_parquet):
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "b1"}, {"text": "b2"}])
    write_jsonl(tmp_path / "d" / "a.jsonl.gz", [{"text": "a1"}], gz=True)
    write_parquet(tmp_path / "d" / "sub" / "c.parquet", [{"text": f"c{i}"} for i in range(5)], row_group_size=2)
    (tmp_path / "d" / "README.md").write_text("not data")

    records, report = read([str(tmp_path / "d")])  # a directory: recursive, sorted, other files ignored
    assert [r.data["text"] for r in records] == ["a1", "b1", "b2", "c0", "c1", "c2", "c3", "c4"]
    assert [r.where().rsplit("/", 1)[1] for r in records[:3]] == ["a.jsonl.gz:1", "b.jsonl:1", "b.jsonl:2"]
    assert [r.row for r in records[3:]] == [0, 1, 2, 3, 4]
    assert (report.files, report.records) == (3, 8)

    records, _ = read([str(tmp_path / "d" / "*.jsonl*"), str(tmp_path / "d" / "sub" / "c.parquet")])
    assert [r.data["text"] for r in records] == ["a1", "b1", "b2", "c0", "c1", "c2", "c3", "c4"]
    records, _ = read([str(tmp_path / "d" / "**" / "*.parquet")])
    assert len(records) == 5


def test_progress_counts_bytes(tmp_path, write_jsonl, write_parquet):
    specs = [
        write_jsonl(tmp_path / "a.jsonl", [REC] * 50),
        write_jsonl(tmp_path / "b.jsonl.gz", [REC] * 50, gz=True),
        write_parquet(tmp_path / "c.parquet", [REC] * 50, row_group_size=7),
    ]
    files = resolve_sources(specs)
    seen = []
    assert len(list(iter_records(files, progress=seen.append))) == 150
    assert sum(seen) == sum(f.size for f in files)
    assert len(seen) >= 3 + 8  # streamed: at least one update per row group


def test_blank_lines_and_bom(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "a.jsonl", [b'\xef\xbb\xbf{"text": "x"}', b"", b"   ", REC])
    records, report = read([path])
    assert [r.line for r in records] == [1, 4] and report.records == 2


@pytest.mark.parametrize(
    "bad, reason, text",
    [
        (b'{"text": "x"', "malformed_json", "malformed JSON"),
        (b'{"text": "caf\xe9"}', "non_utf8", "not valid UTF-8"),
        (b"[1, 2]", "not_an_object", "expected a JSON object, got list"),
        (b'"just a string"', "not_an_object", "got str"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, write_jsonl, bad, reason, text):
    path = write_jsonl(tmp_path / "data.jsonl", [REC, REC, bad, REC])
    with pytest.raises(DataError, match=text) as e:
        read([path])
    assert str(e.value).startswith(f"{path}:3: ") and e.value.reason == reason
    records, report = read([path], skip_bad=True)
    assert len(records) == 3 and report.skipped == {reason: 1} and report.records == 4
    assert report.examples[reason][0].startswith(f"{path}:3")


def test_empty_and_corrupt_files(tmp_path, write_jsonl, write_parquet):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    empty_pq = write_parquet(tmp_path / "empty.parquet", [])
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:40])
    bad_pq = tmp_path / "bad.parquet"
    bad_pq.write_bytes(b"not parquet at all")
    good = write_jsonl(tmp_path / "good.jsonl", [REC])
    for path, text in [
        (empty, "empty file"),
        (empty_pq, "empty file"),
        (str(corrupt), "corrupt"),
        (str(bad_pq), "Parquet"),
    ]:
        with pytest.raises(DataError, match=text) as e:
            read([path])
        assert str(path) in str(e.value)
    records, report = read([empty, empty_pq, str(corrupt), str(bad_pq), good], skip_bad=True)
    # records decoded before the corruption are kept; the rest of that file counts as one unreadable file
    assert records[-1].data == REC and all(r.data == {"text": "x"} for r in records[:-1])
    assert report.skipped == {"empty_file": 2, "unreadable_file": 2}


def test_missing_paths_are_not_skippable(tmp_path, write_jsonl):
    cases = [
        (tmp_path / "nope.jsonl", "no such file"),
        (tmp_path / "*.jsonl", "matches no"),
        (tmp_path / "dir-without-data", "matches no"),
        (tmp_path / "x.csv", "unsupported file type"),
    ]
    for spec, text in cases:
        if spec.name == "dir-without-data":
            spec.mkdir()
        if spec.suffix == ".csv":
            spec.write_text("a,b\n")
        with pytest.raises(DataError, match=text) as e:
            read([str(spec)], skip_bad=True)
        assert str(spec) in str(e.value) and not e.value.skippable


def test_redact(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t/KEY+value")
    assert redact("s3://AKIA:pw@bucket/x") == "s3://***@bucket/x"
    assert redact("https://user:pw@host/x") == "https://***@host/x"
    assert redact('bucket "AKIA:pw@bucket" invalid') == 'bucket "***@bucket" invalid'
    assert "s3cr3t" not in redact("signature for s3cr3t/KEY+value failed")
    assert redact("line 3: at 10:30 email me@x.org") == "line 3: at 10:30 email me@x.org"
    with pytest.raises(DataError, match="credentials inside the URL") as e:
        resolve_sources(["s3://AKIA:pw@bucket/x.jsonl"])
    assert "pw" not in str(e.value)
