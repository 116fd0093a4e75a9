"""tools/third_party_prompts.py on a made-up site-packages: one window per package, tests,
vendored code and flashdraft skipped, the same set for the same seed, a clear stop when there are too few."""

import json
import sys

import pytest

from tests.scripts import TOOLS, load_script


@pytest.fixture
def script(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts examples/tiny_target/ (corpus.py) on it
    return load_script(TOOLS / "third_party_prompts.py")


def code(name: str, lines: int = 60) -> str:
    return "".join(f"def {name}_{i}(x):\n    return x + {i}\n" for i in range(lines))


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site-packages"
    for i in range(6):
        (root / f"pkg{i}" / "sub").mkdir(parents=True)
        (root / f"pkg{i}" / "sub" / "core.py").write_text(code(f"core{i}"))
        (root / f"pkg{i}" / "tests").mkdir()
        (root / f"pkg{i}" / "tests" / "test_core.py").write_text(code(f"test{i}"))
        (root / f"pkg{i}" / "_vendor").mkdir()
        (root / f"pkg{i}" / "_vendor" / "lib.py").write_text(code(f"vendored{i}"))
    (root / "flashdraft").mkdir()
    (root / "flashdraft" / "mine.py").write_text(code("mine"))
    (root / "tiny").mkdir()
    (root / "tiny" / "short.py").write_text("x = 1\n")  # too short for a window: not a candidate
    (root / "pkg0-1.0.dist-info").mkdir()
    return root


def test_one_window_per_package_from_library_code_only(script, site, tmp_path):
    out = tmp_path / "prompts.jsonl"
    script.main(["--root", str(site), "--count", "5", "--prompt-chars", "100", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and {r["category"] for r in rows} == {"third-party"}
    assert len({r["source"].split("/")[0] for r in rows}) == 5
    for row in rows:
        assert row["source"].endswith("/sub/core.py") and len(row["prompt"]) == 100
        assert row["prompt"] in (site / row["source"]).read_text()
        start = (site / row["source"]).read_text().index(row["prompt"])
        assert start == 0 or (site / row["source"]).read_text()[start - 1] == "\n"  # windows start at a line start
    script.main(["--root", str(site), "--count", "5", "--prompt-chars", "100", "--out", str(tmp_path / "again.jsonl")])
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()
    script.main(["--root", str(site), "--count", "5", "--prompt-chars", "100", "--seed", "1", "--out", str(out)])
    assert (tmp_path / "again.jsonl").read_text() != out.read_text()


def test_too_few_packages_is_a_clear_stop(script, site, tmp_path):
    with pytest.raises(SystemExit, match="6 packages with library code .* fewer than --count 7"):
        script.main(["--root", str(site), "--count", "7", "--prompt-chars", "100", "--out", str(tmp_path / "p")])
