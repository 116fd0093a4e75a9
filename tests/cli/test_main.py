"""The `flashdraft` entry point: what a user sees on start."""

import subprocess
import sys

import pytest

FLA_CPU_WARNING = "Triton is not supported on current platform, roll back to CPU"
QUIET = """
import warnings
from flashdraft.cli import quiet_dependency_notices
quiet_dependency_notices()
import fla.utils
warnings.warn("a warning of flashdraft's own")
warnings.warn_explicit("another warning of fla", UserWarning, "hardware.py", 1, module="fla.utils.hardware")
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_fla_cpu_warning_is_silenced_and_nothing_else():
    if FLA_CPU_WARNING not in _python("import fla.utils").stderr:
        pytest.skip("fla does not warn on this machine (a GPU driver is present)")
    run = _python(QUIET)
    assert run.returncode == 0, run.stderr
    assert FLA_CPU_WARNING not in run.stderr
    assert "a warning of flashdraft's own" in run.stderr and "another warning of fla" in run.stderr


def test_help_imports_neither_torch_nor_transformers():
    """`flashdraft --help` and every command's parser are built without the heavy libraries (the export parser once
    imported its module for a docstring: 11 s of transformers and torch for a help text)."""
    code = (
        "import sys\n"
        "from flashdraft import cli\n"
        "cli.build_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
