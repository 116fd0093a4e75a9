"""`flashdraft prepare`: end to end, counts, --skip-bad, overlong, reuse / refusal / --force, atomic output."""

import copy
import io
import json
import os

import pytest

from flashdraft.data import DataError, Encoder, FormatConfig, PrepareConfig, TokenizedDataset, prepare_shards
from flashdraft.data.shards import INPUT_IDS, ShardWriter
from flashdraft.io.space import StorageFull

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 4)


@pytest.fixture
def flashdraft(monkeypatch):
    """Run the real `flashdraft prepare` command."""
    from flashdraft import cli

    return lambda *argv: cli.main(["prepare", "--no-progress", "--workers", "1", *map(str, argv)])


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_end_to_end(tmp_path, tokenizer, tokenizer_dir, write_jsonl, write_parquet, make_chat, flashdraft, capsys):
    chats = [
        make_chat(("user", "Hi"), ("assistant", "Hello there!")),
        make_chat(
            ("system", "You are a helpful assistant."),
            ("user", "What is two plus two?"),
            ("assistant", "<think>Let me think.</think>Four."),
        ),
        {"text": "The answer is 42."},
    ]
    sharegpt = [
        {"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": f"A{i}"}]} for i in range(5)
    ]
    a = write_jsonl(tmp_path / "in" / "a.jsonl", chats)
    b = write_parquet(tmp_path / "in" / "b.parquet", sharegpt, row_group_size=2)
    out = tmp_path / "shards"
    assert flashdraft("--data", a, "--data", b, "--tokenizer", tokenizer_dir, "--out", out, "--drop-thinking") == 0
    stdout = capsys.readouterr().out
    assert "records read" in stdout and "loss tokens" in stdout and f"shards: {out}" in stdout

    ds = TokenizedDataset(out)
    enc = Encoder(tokenizer, FormatConfig(drop_thinking=True))
    expected = [enc.encode(r) for r in chats + sharegpt]
    assert len(ds) == 8
    for i, s in enumerate(expected):
        assert ds[i][0].tolist() == s.input_ids.tolist() and ds[i][1].tolist() == s.loss_mask.tolist()
    meta = ds.meta
    assert meta["counts"] == {
        "files": 2,
        "records": 8,
        "kept": 8,
        "skipped": {},
        "truncated": 0,
        "dropped_overlong": 0,
        "dropped_no_loss": 0,
        "tokens": ds.num_tokens,
        "loss_tokens": ds.num_loss_tokens,
    }
    assert meta["format"]["drop_thinking"] is True and meta["max_length"] == 3072
    assert meta["tokenizer"]["hash"] and meta["content_hash"] and meta["sources"] == [a, b]
    assert leftovers(tmp_path) == []

    assert flashdraft("--data", a, "--data", b, "--tokenizer", tokenizer_dir, "--out", out, "--drop-thinking") == 0
    stdout = capsys.readouterr().out
    assert "reusing the shards" in stdout and "loss tokens" in stdout
    assert flashdraft("--data", a, "--data", b, "--tokenizer", tokenizer_dir, "--out", out) == 2
    assert "different inputs" in capsys.readouterr().err


def test_progress_bar(tmp_path, tokenizer, write_jsonl):
    from rich.console import Console

    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"sample {i}"} for i in range(600)])
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    prepare_shards(
        PrepareConfig(data=[src], tokenizer="-", out=str(tmp_path / "o"), workers=1),
        tokenizer=tokenizer,
        console=console,
    )
    shown = console.file.getvalue()
    assert "reading" in shown and "600 records" in shown


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_and_no_loss(tmp_path, tokenizer, write_jsonl, overlong):
    n_long = len(tokenizer(LONG)["input_ids"])
    records = [{"text": "short"}, {"text": LONG}, {"prompt": LONG, "response": " yes"}, {"text": "also short"}]
    path = write_jsonl(tmp_path / "a.jsonl", records)
    cfg = PrepareConfig(
        data=[path], tokenizer="-", out=str(tmp_path / "out"), max_length=n_long - 5, overlong=overlong, progress=False
    )
    res = prepare_shards(cfg, tokenizer=tokenizer)
    c = res.counts
    if overlong == "truncate":
        # the prompt+response sample loses its whole response to truncation: no loss tokens left, dropped
        assert (c["truncated"], c["dropped_overlong"], c["dropped_no_loss"], c["kept"]) == (2, 0, 1, 3)
        assert TokenizedDataset(res.path).lengths.tolist()[1] == n_long - 5
    else:
        assert (c["truncated"], c["dropped_overlong"], c["dropped_no_loss"], c["kept"]) == (0, 2, 0, 2)
    assert c["records"] == 4


def test_bad_records_stop_or_are_counted(tmp_path, tokenizer_dir, write_jsonl, make_chat, flashdraft, capsys):
    good = make_chat(("user", "Hi"), ("assistant", "Hello"))
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            good,
            b'{"messages": [',
            {"messages": []},
            {"messages": [{"role": "narrator", "content": "x"}]},
            make_chat(("user", "Hi")),
            b"\xff\xfe",
            {"input_ids": [1, 2], "loss_mask": [1]},
            good,
        ],
    )
    out = tmp_path / "out"
    assert flashdraft("--data", path, "--tokenizer", tokenizer_dir, "--out", out) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: malformed JSON" in err and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []

    assert flashdraft("--data", path, "--tokenizer", tokenizer_dir, "--out", out, "--skip-bad") == 0
    stdout = capsys.readouterr().out
    for reason in (
        "malformed JSON",
        "empty conversation",
        "unknown role",
        "no assistant turn",
        "not valid UTF-8",
        "ids / mask lengths differ",
    ):
        assert reason in stdout
    meta = TokenizedDataset(out).meta
    assert meta["counts"]["skipped"] == {
        "malformed_json": 1,
        "empty_messages": 1,
        "unknown_role": 1,
        "no_assistant": 1,
        "non_utf8": 1,
        "length_mismatch": 1,
    }
    assert (meta["counts"]["records"], meta["counts"]["kept"]) == (8, 2)


def test_strict_error_names_file_line_and_field(tmp_path, tokenizer, write_jsonl, write_parquet, make_chat):
    good = make_chat(("user", "Hi"), ("assistant", "Hello"))
    bad = {"messages": [{"role": "narrator", "content": "x"}]}
    src = write_jsonl(tmp_path / "a.jsonl", [good, {"text": "fine"}, bad])
    with pytest.raises(DataError, match=r"a\.jsonl:3: field 'messages\[0\]\.role': unknown role 'narrator'"):
        prepare_shards(
            PrepareConfig(data=[src], tokenizer="-", out=str(tmp_path / "o"), progress=False), tokenizer=tokenizer
        )
    pq = write_parquet(tmp_path / "b.parquet", [{"text": "a"}, {"text": "b"}, {"text": None}], row_group_size=2)
    with pytest.raises(DataError, match=r"b\.parquet row 2: field 'text': expected a string, got NoneType"):
        prepare_shards(
            PrepareConfig(data=[pq], tokenizer="-", out=str(tmp_path / "o"), progress=False), tokenizer=tokenizer
        )
    assert not (tmp_path / "o").exists()


def test_reuse_refuse_force(tmp_path, tokenizer, write_jsonl, make_chat):
    src = tmp_path / "a.jsonl"
    write_jsonl(src, [make_chat(("user", "Hi"), ("assistant", "Hello")), {"text": "plain"}])
    out = tmp_path / "out"

    def cfg(**kw):
        return PrepareConfig(data=[str(src)], tokenizer="-", out=str(out), progress=False, **kw)

    first = prepare_shards(cfg(), tokenizer=tokenizer)
    stamp = os.stat(out / INPUT_IDS).st_mtime_ns
    again = prepare_shards(cfg(), tokenizer=tokenizer)
    assert again.reused and not first.reused and again.counts == first.counts
    assert os.stat(out / INPUT_IDS).st_mtime_ns == stamp

    with pytest.raises(DataError, match=r"different inputs \(changed: options\).*--force"):
        prepare_shards(cfg(max_length=100), tokenizer=tokenizer)
    with pytest.raises(DataError, match=r"\(changed: options\)"):
        prepare_shards(cfg(format=FormatConfig(drop_thinking=True)), tokenizer=tokenizer)
    other_tok = copy.deepcopy(tokenizer)
    other_tok.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<|endoftext|>")
    with pytest.raises(DataError, match=r"\(changed: tokenizer\)"):
        prepare_shards(cfg(), tokenizer=other_tok)
    forced = prepare_shards(cfg(max_length=100, force=True), tokenizer=tokenizer)
    assert not forced.reused and TokenizedDataset(out).meta["max_length"] == 100

    write_jsonl(src, [make_chat(("user", "Hi"), ("assistant", "Hello")), {"text": "plain, but longer"}])
    with pytest.raises(DataError, match=r"\(changed: sources\)"):
        prepare_shards(cfg(max_length=100), tokenizer=tokenizer)

    # shards written with --skip-bad (and records skipped) are not silently reused by a strict run
    write_jsonl(src, [{"text": "ok"}, b"{broken"])
    prepare_shards(cfg(skip_bad=True, force=True), tokenizer=tokenizer)
    assert prepare_shards(cfg(skip_bad=True), tokenizer=tokenizer).reused
    with pytest.raises(DataError, match="written with --skip-bad"):
        prepare_shards(cfg(), tokenizer=tokenizer)

    other = tmp_path / "not-shards"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a flashdraft shard directory"):
        prepare_shards(
            PrepareConfig(data=[str(src)], tokenizer="-", out=str(other), skip_bad=True, progress=False),
            tokenizer=tokenizer,
        )
    assert (other / "precious.txt").read_text() == "keep me"


def test_interrupted_write_leaves_no_partial_output(tmp_path, tokenizer, write_jsonl, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"sample {i}"} for i in range(10)])
    out = tmp_path / "out"
    cfg = PrepareConfig(data=[src], tokenizer="-", out=str(out), progress=False, batch_size=3)
    real_add, calls = ShardWriter.add, []

    def failing_add(self, sample):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("No space left on device")
        real_add(self, sample)

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    with pytest.raises(StorageFull, match=f"cannot write the shards {out} .*no space left.*Nothing was kept"):
        prepare_shards(cfg, tokenizer=tokenizer)
    assert not out.exists() and leftovers(tmp_path) == []

    monkeypatch.setattr(ShardWriter, "add", real_add)
    prepare_shards(cfg, tokenizer=tokenizer)
    monkeypatch.setattr(ShardWriter, "add", failing_add)
    calls.clear()
    with pytest.raises(StorageFull, match="The shards already there are unchanged"):
        cfg = PrepareConfig(data=[src], tokenizer="-", out=str(out), progress=False, force=True, max_length=50)
        prepare_shards(cfg, tokenizer=tokenizer)
    assert len(TokenizedDataset(out)) == 10 and leftovers(tmp_path) == []  # the old shards are intact


def test_what_a_killed_writer_left_beside_the_shards_is_removed_by_the_next_run(tmp_path, tokenizer, write_jsonl):
    """kill -9 during a write leaves `.out.tmp-*` (GBs of half-written shards) or, during the swap, `.out.old-*`;
    the next prepare of the same shards (which holds their lock) removes both, whether it reuses or rewrites."""
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": f"sample {i}"} for i in range(6)])
    out = tmp_path / "out"
    cfg = PrepareConfig(data=[src], tokenizer="-", out=str(out), progress=False)

    def litter():
        for name in (".out.tmp-killed", ".out.old-killed"):
            (tmp_path / name).mkdir()
            (tmp_path / name / INPUT_IDS).write_bytes(b"\0" * 64)
        (tmp_path / ".other.tmp-keep").mkdir()  # another path's: not ours to remove

    litter()
    assert not prepare_shards(cfg, tokenizer=tokenizer).reused
    assert leftovers(tmp_path) == [".other.tmp-keep"]
    (tmp_path / ".other.tmp-keep").rmdir()
    litter()
    assert prepare_shards(cfg, tokenizer=tokenizer).reused
    assert leftovers(tmp_path) == [".other.tmp-keep"] and len(TokenizedDataset(out)) == 6


def test_workers_give_identical_shards(tmp_path, tokenizer, write_jsonl, make_chat):
    bad_late = {"messages": [{"role": "narrator", "content": "x"}]}
    records = [make_chat(("user", f"Q{i}"), ("assistant", f"A{i} " * (i % 7))) for i in range(40)]
    src = write_jsonl(tmp_path / "a.jsonl", [*records[:30], b"{broken", *records[30:], bad_late])
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        cfg = PrepareConfig(data=[src], tokenizer="-", out=str(out), progress=False, batch_size=4, workers=workers)
        with pytest.raises(DataError, match=r"a\.jsonl:31: malformed JSON"):  # the first bad line, in file order
            prepare_shards(cfg, tokenizer=tokenizer)
        cfg.skip_bad = True
        res = prepare_shards(cfg, tokenizer=tokenizer)
        assert res.counts["skipped"] == {"malformed_json": 1, "unknown_role": 1} and res.counts["kept"] == 40
        outs.append(out)
    for name in (INPUT_IDS, "loss_mask.bin", "index.npy"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()


def test_nothing_left_is_an_error(tmp_path, tokenizer, write_jsonl):
    src = write_jsonl(tmp_path / "a.jsonl", [b"{bad", b"{bad"])
    with pytest.raises(DataError, match="no sample left"):
        cfg = PrepareConfig(data=[src], tokenizer="-", out=str(tmp_path / "out"), skip_bad=True, progress=False)
        prepare_shards(cfg, tokenizer=tokenizer)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_chat_data_without_template(tmp_path, plain_tokenizer_dir, write_jsonl, make_chat, flashdraft, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}, make_chat(("user", "Hi"), ("assistant", "Hello"))])
    for extra in ([], ["--format", "chat"], ["--skip-bad"]):
        code = flashdraft("--data", src, "--tokenizer", plain_tokenizer_dir, "--out", tmp_path / "out", *extra)
        err = capsys.readouterr().err
        assert code == 2 and "no chat template" in err and "--format text" in err, extra
    assert not (tmp_path / "out").exists()
    assert (
        flashdraft(
            "--data", src, "--tokenizer", plain_tokenizer_dir, "--out", tmp_path / "o", "--format", "text", "--skip-bad"
        )
        == 0
    )
    assert TokenizedDataset(tmp_path / "o").meta["counts"]["skipped"] == {"missing_field": 1}


def test_config_validation():
    with pytest.raises(ValueError, match="overlong"):
        PrepareConfig(data=["x"], tokenizer="t", out="o", overlong="cut")
    with pytest.raises(ValueError, match="max_length"):
        PrepareConfig(data=["x"], tokenizer="t", out="o", max_length=0)
    with pytest.raises(ValueError, match="data"):
        PrepareConfig(data=[], tokenizer="t", out="o")
    assert json.loads(json.dumps(FormatConfig().as_dict()))["format"] == "auto"
