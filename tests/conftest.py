"""Settings of the whole test session.

`pytest -m versions` selects the tests whose outcome depends on the installed torch / transformers / triton
releases: what CI runs again on the oldest supported set (.ci/run). They are chosen by path, here, so that a new
test in these places is included without remembering a marker.
"""

from pathlib import Path

import pytest

VERSION_SENSITIVE = (
    "fastpath/",  # patching transformers' Gated DeltaNet layers, the per-layer probe, doctor, every generation
    "spec/",  # the spec loop over transformers' models and caches, and the engine
    "test_target.py",  # target capture
    "drafter/test_recipe.py",  # the training recipe over a captured target
    "drafter/test_interop.py",  # checkpoints against the reference dflash 0.1.0
    "test_export.py",
)
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.resolve().relative_to(_TESTS).as_posix().startswith(VERSION_SENSITIVE):
            item.add_marker(pytest.mark.versions)
