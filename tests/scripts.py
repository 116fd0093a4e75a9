"""Scripts that are not a package (examples/tiny_target/, tools/), imported by path for their tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "examples" / "tiny_target"
TOOLS = ROOT / "tools"


def load_script(path: Path):
    """The script at `path` (e.g. TOOLS / "sweep.py"), executed as a fresh module named <folder>_<name>."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
