"""Real storage faults: the kernel refuses the write, nothing is mocked.

- EFBIG: the run's file-size limit (RLIMIT_FSIZE, what `ulimit -f` sets) is lowered once its first checkpoint is
  written, as a quota reached mid-run would be; Python ignores SIGXFSZ, so the write raises instead of killing.
- ENOSPC: the output directory is a small tmpfs that holds one checkpoint but not two (a new checkpoint is written
  before the old one is pruned); skipped, with the reason, where `mount -t tmpfs` is not permitted.

Each time the run stops with exit code 4 and a message naming the path, the reason and the space needed; the
previous checkpoint still verifies; `--resume` once room is made finishes the run with the losses of an
uninterrupted run, step for step. The same for `flashdraft prepare` (no half-written shards, an older shard
directory left intact) and `flashdraft features` (no features.json, so training refuses the directory).
"""

import contextlib
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashdraft import bundled
from flashdraft.data import TokenizedDataset
from flashdraft.data.features import FeatureStore
from flashdraft.train.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RUN = ["train.max_steps=6", "log.every=1", "log.checkpoint_every=2", "data.eval_prompts=null", "train.device=cpu"]
EXIT_OUTPUT = 4
MiB = 1 << 20

# `flashdraft ARGV` whose file-size limit drops to LIMIT bytes once its first checkpoint is written.
LIMIT_AFTER_FIRST_CHECKPOINT = textwrap.dedent("""
    import resource, sys
    from flashdraft import cli
    from flashdraft.train.checkpoint import CheckpointManager

    limit, argv, save = int(sys.argv[1]), sys.argv[2:], CheckpointManager.save

    def save_then_limit(self, *args, **kwargs):
        path = save(self, *args, **kwargs)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return path

    CheckpointManager.save = save_then_limit
    sys.exit(cli.main(argv))
""")


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "COLUMNS": "250",
    }


def _flashdraft(*argv, cwd: Path, file_limit: int | None = None, runner: list[str] | None = None):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    cmd = [sys.executable, *(runner or ["-m", "flashdraft"]), *map(str, argv)]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env=_env(),
        preexec_fn=limit if file_limit is not None else None,
    )


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _clean_failure(proc, *fragments) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_OUTPUT, text[-3000:]
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text[-3000:]}"
    assert "Traceback" not in text and "internal error" not in text
    return text


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path`; the test is skipped (with mount's reason) where that is not permitted."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("a small tmpfs for a real ENOSPC needs root (mount -t tmpfs)")
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"a small tmpfs for a real ENOSPC could not be mounted: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _grow(path: Path, size: str) -> None:
    """Make room: the tmpfs at `path` grows to `size`, its files kept."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("uninterrupted")
    proc = _flashdraft("train", "--out", root / "run", *RUN, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(root / "run")


def _after_the_fault(out: Path, uninterrupted: dict, cwd: Path, make_room=None) -> None:
    """The first checkpoint verifies and nothing half-written is left; `--resume`, after `make_room`, finishes the
    run with the uninterrupted run's losses."""
    manager = CheckpointManager(out)
    assert manager.latest() == manager.path_for(2)
    assert [p.name for p in manager.root.iterdir() if p.name.startswith(".tmp-")] == []
    if make_room is not None:
        make_room()
    resumed = _flashdraft("train", "--out", out, *RUN, "--resume", cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert _losses(out) == uninterrupted


def test_train_past_the_file_size_limit_stops_cleanly_and_resumes_exactly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    runner = ["-c", LIMIT_AFTER_FIRST_CHECKPOINT, str(MiB)]
    proc = _flashdraft("train", "--out", out, *RUN, cwd=tmp_path, runner=runner)
    _clean_failure(
        proc,
        f"error: cannot write checkpoint step_00000004 at {out}/checkpoints: a file grew past the "
        "file-size limit (ulimit -f: 1.0 MiB per file); it needs about ",
        f"the newest complete checkpoint, {out}/checkpoints/step_00000002, is intact: make room, then "
        "continue with --resume",
    )
    _after_the_fault(out, uninterrupted, tmp_path)


def test_train_on_a_full_disk_stops_cleanly_and_resumes_exactly(tmp_path, uninterrupted):
    # ~1.2 MiB of shards and one ~28 MiB checkpoint fit; a second one does not.
    with tmpfs(tmp_path / "disk", "45m") as disk:
        out = disk / "run"
        proc = _flashdraft("train", "--out", out, *RUN, cwd=tmp_path)
        text = _clean_failure(
            proc,
            f"error: cannot write checkpoint step_00000004 at {out}/checkpoints: no space left "
            "on the device; it needs about ",
            f"the newest complete checkpoint, {out}/checkpoints/step_00000002, is intact",
        )
        needed = float(text.split("it needs about ")[1].split(" MiB")[0])
        written = sum(f.stat().st_size for f in (out / "checkpoints" / "step_00000002").rglob("*") if f.is_file())
        assert abs(needed * MiB - written) < 0.1 * written  # the estimate is the size of a checkpoint
        _after_the_fault(out, uninterrupted, tmp_path, make_room=lambda: _grow(disk, "200m"))


# ---- prepare ----------------------------------------------------------------------------------------------------


def _prepare(out: Path, *extra, cwd: Path, file_limit: int | None = None):
    return _flashdraft(
        "prepare",
        "--data",
        bundled.ASSETS / "train.jsonl",
        "--tokenizer",
        bundled.tokenizer_dir(),
        "--out",
        out,
        "--no-progress",
        *extra,
        cwd=cwd,
        file_limit=file_limit,
    )


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_prepare_past_the_file_size_limit_keeps_nothing_half_written(tmp_path):
    out = tmp_path / "shards"
    failed = _prepare(out, cwd=tmp_path, file_limit=256 << 10)  # the token ids of the bundled data: ~0.9 MiB
    _clean_failure(
        failed,
        f"error: cannot write the shards {out} at {tmp_path}: a file grew past the file-size "
        "limit (ulimit -f: 256.0 KiB per file); it needs about ",
        "Nothing was kept: make room, then run again",
    )
    assert not out.exists() and _leftovers(tmp_path) == []

    assert _prepare(out, cwd=tmp_path).returncode == 0
    good = TokenizedDataset(out).meta["content_hash"]
    # Rebuilding other shards over them fails the same way: the old ones stay, whole.
    failed = _prepare(out, "--force", "--overlong", "drop", cwd=tmp_path, file_limit=256 << 10)
    _clean_failure(failed, "The shards already there are unchanged: make room, then run again")
    assert TokenizedDataset(out).meta["content_hash"] == good and _leftovers(tmp_path) == []
    assert _prepare(out, "--force", "--overlong", "drop", cwd=tmp_path).returncode == 0
    assert TokenizedDataset(out).meta["content_hash"] != good


def test_prepare_on_a_full_disk_keeps_nothing_half_written(tmp_path):
    with tmpfs(tmp_path / "disk", "512k") as disk:
        out = disk / "shards"
        failed = _prepare(out, cwd=tmp_path)
        _clean_failure(failed, f"error: cannot write the shards {out} at {disk}: no space left on the device")
        assert not out.exists() and _leftovers(disk) == []
        _grow(disk, "8m")
        assert _prepare(out, cwd=tmp_path).returncode == 0 and len(TokenizedDataset(out)) > 0


# ---- features ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def few_samples(tmp_path_factory) -> Path:
    """16 rows of the bundled data: small shards, features of a few MiB."""
    path = tmp_path_factory.mktemp("data") / "few.jsonl"
    lines = (bundled.ASSETS / "train.jsonl").read_text().splitlines()[:16]
    path.write_text("\n".join(lines) + "\n")
    return path


def _features(out: Path, data: Path, cwd: Path, file_limit: int | None = None):
    return _flashdraft(
        "features",
        "--out",
        out,
        f"data.train=[{data}]",
        f"log.out={cwd / 'log'}",
        "train.device=cpu",
        cwd=cwd,
        file_limit=file_limit,
    )


def test_features_past_the_file_size_limit_leave_no_index(tmp_path, few_samples):
    out = tmp_path / "features"
    assert _features(out, few_samples, tmp_path).returncode == 0
    before = FeatureStore(str(out)).sample(3)
    failed = _features(out, few_samples, tmp_path, file_limit=MiB)
    _clean_failure(
        failed,
        f"error: cannot write the features of 16 samples at {out}: a file grew past the "
        "file-size limit (ulimit -f: 1.0 MiB per file); it needs about ",
        f"{out} has no features.json, so train refuses it",
    )
    # The old index went first: what is there now is never read as features.
    with pytest.raises(FileNotFoundError, match="no features.json there"):
        FeatureStore(str(out))
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []
    assert _features(out, few_samples, tmp_path).returncode == 0
    assert FeatureStore(str(out)).sample(3).equal(before)


def test_features_on_a_full_disk_leave_no_index(tmp_path, few_samples):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / "features"
        failed = _features(out, few_samples, tmp_path)
        _clean_failure(failed, f"error: cannot write the features of 16 samples at {out}: no space left on the device")
        with pytest.raises(FileNotFoundError, match="no features.json there"):
            FeatureStore(str(out))
        assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []
