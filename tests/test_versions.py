"""flashdraft.versions: the supported ranges (in step with pyproject.toml), refusal at import, the cache keyword."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement

from flashdraft import versions
from flashdraft.target.tiny import random_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_supported_ranges_are_the_pins():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pins = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(line)
        pins[req.name] = str(req.specifier)
    for dist in versions.SUPPORTED:
        assert sorted(pins[dist].split(",")) == sorted(versions.supported_range(dist).split(",")), dist


@pytest.mark.parametrize(
    "dist,version,expected",
    [
        ("transformers", "5.13.1", "too old"),
        ("transformers", "5.14.0", "ok"),
        ("transformers", "5.25.0", "ok"),
        ("transformers", "5.26.0.dev0", "untested"),
        ("torch", "2.10.0+cu128", "too old"),
        ("torch", "2.11.0+cu130", "ok"),
        ("torch", "2.15.0", "ok"),
        ("torch", "2.16.0a0+git1234", "untested"),
        ("triton", "3.4.0", "too old"),
        ("triton", "3.9.0", "ok"),
    ],
)
def test_status(dist, version, expected):
    assert versions.status(dist, version) == expected


def test_the_installed_releases_are_supported():
    for dist in versions.SUPPORTED:
        assert versions.status(dist) in ("ok", "missing"), (dist, versions.installed(dist))


def test_import_refuses_a_release_older_than_supported(tmp_path):
    # A distribution record that shadows the installed transformers for importlib.metadata.
    record = tmp_path / "transformers-5.2.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.2.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run(
        [sys.executable, "-c", "import flashdraft"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: flashdraft needs transformers >=5.14,<5.26; this environment has transformers "
        "5.2.0, older than the oldest supported release. Install a supported one: "
        "pip install 'transformers>=5.14,<5.26'"
    )


def test_cache_keyword_of_the_installed_release():
    model = random_tiny_model("qwen3", num_layers=2)
    cache = transformers.DynamicCache(config=model.config)
    kwargs = versions.cache_kwargs(cache)
    renamed = versions.Version(transformers.__version__).release >= (5, 24)
    assert list(kwargs) == (["cache"] if renamed else ["past_key_values"])
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=True, **kwargs)
    assert versions.returned_cache(out) is cache and cache.get_seq_length() == 3
