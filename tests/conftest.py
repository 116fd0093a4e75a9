"""Fixtures shared by the test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
