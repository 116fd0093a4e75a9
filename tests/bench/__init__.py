import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m bench.<module> ARGS` from the repository root, as a user runs it; it must exit 0."""
    run = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run
