"""The scripts of examples/tiny_target, imported by path for their tests (they are scripts, not a package)."""

import importlib.util
from pathlib import Path

TINY_TARGET = Path(__file__).resolve().parents[2] / "examples" / "tiny_target"


def load_script(name: str):
    """examples/tiny_target/<name>.py, executed as a fresh module named tiny_target_<name>."""
    spec = importlib.util.spec_from_file_location(f"tiny_target_{name}", TINY_TARGET / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
