"""Running flashdraft under torchrun in tests: 2 processes with gloo on the CPU, a short run of the bundled default."""

import os
import subprocess
import textwrap
from pathlib import Path

from flashdraft.distributed import job
from tests import SHIPPED_DRAFTER

ROOT = Path(__file__).resolve().parents[2]
# 4 steps, a checkpoint every 2; no measured τ (decoding is rank 0's alone and tested elsewhere).
RUN = [
    *SHIPPED_DRAFTER,
    "train.max_steps=4",
    "log.every=1",
    "log.checkpoint_every=2",
    "data.eval_prompts=null",
    "train.batch_size=2",
    "train.device=cpu",
]  # gloo on the CPU even where a GPU is visible (2 ranks cannot share one with NCCL)


def run_env(extra_path: Path | None = None) -> dict:
    paths = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def torchrun(args: list[str], nproc: int = 2, env: dict | None = None, timeout: int = 300):
    cmd = job.torchrun_command(nproc, args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or run_env())


def site(tmp_path: Path, code: str) -> Path:
    """A directory with a sitecustomize.py running `code` at the start of every worker (it reads RANK)."""
    directory = tmp_path / "site"
    directory.mkdir()
    (directory / "sitecustomize.py").write_text("import os\nRANK = os.environ.get('RANK')\n" + textwrap.dedent(code))
    return directory


def descendants(pid: int) -> list[int]:
    """The pids of every process below `pid` (Linux /proc), children first."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found
