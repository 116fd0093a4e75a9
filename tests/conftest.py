"""Settings and fixtures of the whole test session.

`pytest -m versions` selects the tests whose outcome depends on the installed torch / transformers / triton
releases: what CI runs again on the oldest supported set (.ci/run), less the `distribution` tests (chi-square tests
of sampled decoding: the arithmetic they check is the same on every release, and the greedy and cache tests of the
same loops run there). They are chosen by path, here, so that a new test in these places is included without
remembering a marker.

The `slow` and `distribution` tests are collected first: a run split over workers (pytest-xdist) then does not end
waiting on one of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION_SENSITIVE = (
    "fastpath/",  # patching transformers' Gated DeltaNet layers, the per-layer probe, doctor, every generation
    "speculative/",  # the speculative loop over transformers' models and caches, and the engine
    "target/",  # target loading and capture
    "train/test_blocks.py",  # the training recipe over a captured target
    "train/test_masks.py",
    "train/loss/",
    "drafter/test_interop.py",  # checkpoints against the reference dflash 0.1.0
    "test_export.py",
)
_TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    """Under pytest-xdist (`-n`), each worker's torch takes its share of the cores, not all of them each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().relative_to(_TESTS).as_posix().startswith(VERSION_SENSITIVE):
            item.add_marker(pytest.mark.versions)
    items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in ("slow", "distribution")))


@pytest.fixture(scope="session")
def env_without(tmp_path_factory):
    """`env_without("matplotlib", ...)`: an environment for a subprocess in which those top-level packages cannot
    be imported, as if they were not installed, whatever this machine has: a sitecustomize puts None in their
    sys.modules slots, which makes `import` raise ModuleNotFoundError and `importlib.util.find_spec` answer None."""

    def make(*packages: str) -> dict:
        site = tmp_path_factory.mktemp("without")
        (site / "sitecustomize.py").write_text(
            f"import sys\n\nfor _name in {packages!r}:\n    sys.modules[_name] = None\n"
        )
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}

    return make
