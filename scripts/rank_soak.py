#!/usr/bin/env python
"""Rank soak: SIGKILL a random rank of a 2-rank torchrun job (gloo on the CPU) at random moments, let torchrun restart
it (`--max-restarts`), and prove that the job resumed by itself and lost nothing.

    python scripts/rank_soak.py                                   # 6 kills, seed 0, 16 steps: ~5 min on 2 cores
    python scripts/rank_soak.py --kills 40 --seed 7 --steps 80 --workdir /tmp/rank-soak

Two torchrun jobs of `flashdraft train`, 2 ranks, with the same overrides (`OVERRIDES`, a collective timeout of
TIMEOUT_S): a reference that runs uninterrupted, then the killed job, launched once with `--max-restarts K` for K
kills and left alone otherwise. Kill i of K waits until the job's current attempt has logged step i*N/K (one kill in
four instead waits a random 1-8 s after the attempt's workers appear: a kill during start-up or the resume), then a
random 0-1.5 s more, and SIGKILLs rank 0 or rank 1, at random. torchrun then stops the other rank and starts both
again; they find the newest complete checkpoint in OUT by themselves.

Checked: the job exits 0 after exactly K restarts; after every kill the next attempt started within RESTART_LIMIT_S
(the other rank left by itself, before torchrun's SIGKILL of a worker that outlives its SIGTERM by 30 s); every
`checkpoints/step_*` verifies and `latest()` is the last step; metrics.jsonl equals the reference's (every value but
the timings; one record per step); the final checkpoint's files (weights, optimizer shards, scheduler, loader
state, torch's RNG) are the reference's, bit for bit. Prints a table; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 5
OVERRIDES = [
    "train.device=cpu",
    "train.batch_size=2",
    "log.every=1",
    "log.checkpoint_every=2",
    "data.eval_prompts=null",
    f"train.collective_timeout_s={TIMEOUT_S}",
]
TIMING_KEYS = {"tok_s", "draft_tok_s", "mfu", "mem_gib"}
RESTART_LIMIT_S = 25
# Files of a checkpoint that differ between any two runs: DCP's metadata names its temporary directory and a save id;
# rng.pt holds python's and numpy's generators, which nothing seeds or draws from (its torch state is compared).
UNEQUAL = {"sharded/.metadata", "rng.pt"}
JOB_LIMIT_S = 1800
POLL_S = 0.05


class SoakError(RuntimeError):
    """The soak itself cannot go on (a job failed or hung); the message says which and where its log is."""


@dataclass
class Kill:
    index: int
    aim: str
    rank: int
    attempt: int
    at_step: int  # the last step in metrics.jsonl when it was killed
    restart_s: float = float("nan")  # from the kill to the next attempt's workers

    def line(self) -> str:
        return (
            f"kill {self.index:3d}  {self.aim:<8}  rank {self.rank}  attempt {self.attempt:3d}  "
            f"last step {self.at_step:3d}  next attempt after {self.restart_s:5.1f} s"
        )


@dataclass
class Summary:
    kills: list[Kill] = field(default_factory=list)
    steps: int = 0
    restarts: int = 0
    exit_code: int | None = None
    curve_equal: bool = False
    state_equal: bool = False
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        by_rank = {r: sum(1 for k in self.kills if k.rank == r) for r in (0, 1)}
        by_aim = {a: sum(1 for k in self.kills if k.aim == a) for a in ("step", "start-up")}
        slowest = max((k.restart_s for k in self.kills), default=0.0)
        rows = [
            (
                "kills",
                f"{len(self.kills)} (rank 0: {by_rank[0]}, rank 1: {by_rank[1]}; mid-run {by_aim['step']}, "
                f"in start-up {by_aim['start-up']})",
            ),
            ("torchrun restarts", self.restarts),
            ("job exit status", self.exit_code),
            ("slowest restart after a kill", f"{slowest:.1f} s (limit {RESTART_LIMIT_S} s)"),
            ("final curve == uninterrupted run", _yes(self.curve_equal, f"{self.steps} steps, every non-timing value")),
            (
                "final checkpoint == uninterrupted run's",
                _yes(self.state_equal, "weights, optimizer, scheduler, torch RNG"),
            ),
            ("wall time", f"{self.seconds:.0f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines + ([f"FAILED: {f}" for f in self.failures] or ["all checks passed"]))


def _yes(ok: bool, detail: str) -> str:
    return f"yes ({detail})" if ok else "NO"


def job_command(out: Path, steps: int, restarts: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        "-m",
        "flashdraft",
        "train",
        "--out",
        str(out),
        f"train.max_steps={steps}",
        *OVERRIDES,
    ]


def launch(out: Path, steps: int, restarts: int, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        # cwd outside the repository: `python -m` would put the cwd first on sys.path.
        return subprocess.Popen(job_command(out, steps, restarts), cwd=out.parent, env=env, stdout=f, stderr=f)


def workers(agent: int) -> dict[int, tuple[int, int]]:
    """{rank: (pid, attempt)} of the torchrun agent's live workers (Linux /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent or stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = dict(
                item.split("=", 1) for item in Path(f"/proc/{entry}/environ").read_text().split("\0") if "=" in item
            )
        except (OSError, ValueError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = (int(entry), int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    return found


def _attempt(agent: int, attempt: int) -> dict[int, tuple[int, int]] | None:
    """Both workers of `attempt` once they are running, else None."""
    live = workers(agent)
    return live if len(live) == 2 and all(a == attempt for _, a in live.values()) else None


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def last_step(path: Path) -> int:
    try:
        lines = path.read_bytes().split(b"\n")[:-1]
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, ValueError, KeyError, IndexError):
        return 0


def _wait(proc: subprocess.Popen, predicate, what: str, log: Path):
    deadline = time.monotonic() + JOB_LIMIT_S
    while proc.poll() is None:
        hit = predicate()
        if hit:
            return hit
        if time.monotonic() > deadline:
            raise SoakError(f"waited {JOB_LIMIT_S} s for {what}; the job hung? log: {log}")
        time.sleep(POLL_S)
    raise SoakError(f"the job exited ({proc.returncode}) while the soak waited for {what}; log: {log}")


def soak(workdir: str | os.PathLike, *, kills: int = 6, seed: int = 0, steps: int = 16) -> Summary:
    """Run the whole soak in `workdir` (reference/, killed/, logs/); see the module docstring."""
    started = time.monotonic()
    workdir = Path(workdir)
    ref_out, out, logs = workdir / "reference", workdir / "killed", workdir / "logs"
    for d in (ref_out, out):
        d.mkdir(parents=True, exist_ok=False)
    rng = random.Random(seed)
    summary = Summary(steps=steps)
    reference = launch(ref_out, steps, 0, logs / "reference.log")
    if reference.wait(timeout=JOB_LIMIT_S) != 0:
        raise SoakError(f"the reference run exited {reference.returncode}; log: {logs / 'reference.log'}")
    log = logs / "killed.log"
    job = launch(out, steps, kills, log)
    try:
        for i in range(kills):
            aim = "start-up" if rng.random() < 0.25 else "step"
            ready = _wait(job, lambda i=i: _attempt(job.pid, i), f"attempt {i}'s workers", log)
            if aim == "step":
                # Each attempt rewrites metrics.jsonl (a new inode) as it starts: wait for this attempt's own lines.
                target = max(1, round((i + 1) * steps / (kills + 1)))
                before = _inode(out / "metrics.jsonl")

                def reached(target=target, before=before):
                    path = out / "metrics.jsonl"
                    return _inode(path) not in (None, before) and last_step(path) >= target

                _wait(job, reached, f"step {target} of attempt {i}", log)
                time.sleep(rng.uniform(0, 1.5))
            else:
                time.sleep(rng.uniform(1, 8))
            rank = rng.choice([0, 1])
            pid, attempt = ready[rank]
            at = last_step(out / "metrics.jsonl")
            killed_at = time.monotonic()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                raise SoakError(f"rank {rank} of attempt {attempt} was gone before its kill; log: {log}") from None
            kill = Kill(i, aim, rank, attempt, at)
            summary.kills.append(kill)
            _wait(job, lambda i=i: _attempt(job.pid, i + 1), f"attempt {i + 1}'s workers", log)
            kill.restart_s = time.monotonic() - killed_at
            summary.restarts = i + 1
            if kill.restart_s >= RESTART_LIMIT_S:
                summary.failures.append(f"kill {i}: the next attempt started {kill.restart_s:.1f} s later")
        summary.exit_code = job.wait(timeout=JOB_LIMIT_S)
    finally:
        if job.poll() is None:
            for pid, _ in workers(job.pid).values():
                os.kill(pid, signal.SIGKILL)
            job.kill()
            job.wait()
    if summary.exit_code != 0:
        summary.failures.append(f"the killed job exited {summary.exit_code}; log: {log}")
    if summary.restarts != kills:
        summary.failures.append(f"torchrun started {summary.restarts} attempts after the first, not {kills}")
    compare(ref_out, out, steps, summary)
    summary.seconds = time.monotonic() - started
    return summary


def compare(ref_out: Path, out: Path, steps: int, summary: Summary) -> None:
    import torch

    from flashdraft.telemetry.metrics import read_metrics
    from flashdraft.train.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(out)
    for _, path in manager.checkpoints():
        try:
            manager.verify(path)
        except CheckpointError as exc:
            summary.failures.append(f"{path.name} does not verify: {exc}")
    if manager.latest() != manager.path_for(steps):
        summary.failures.append(f"latest() is {manager.latest()}, not step {steps}")

    def values(root: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(root / "metrics.jsonl")]

    ref, got = values(ref_out), values(out)
    summary.curve_equal = ref == got and [r["step"] for r in got] == list(range(1, steps + 1))
    if not summary.curve_equal:
        diff = next((f"{a} != {b}" for a, b in zip(ref, got, strict=False) if a != b), f"{len(ref)} vs {len(got)}")
        summary.failures.append(f"metrics differ from the uninterrupted run's: {diff}")

    def hashes(root: Path) -> dict:
        manifest = json.loads((CheckpointManager(root).path_for(steps) / "MANIFEST.json").read_text())
        return {name: entry["sha256"] for name, entry in manifest["files"].items() if name not in UNEQUAL}

    def torch_rng(root: Path):
        return torch.load(CheckpointManager(root).path_for(steps) / "rng.pt", weights_only=True)["torch"]

    a, b = hashes(ref_out), hashes(out)
    summary.state_equal = a == b and torch.equal(torch_rng(ref_out), torch_rng(out))
    if not summary.state_equal:
        summary.failures.append(f"final checkpoint files differ: {sorted(n for n in a | b if a.get(n) != b.get(n))}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=6, help="SIGKILLs of a rank (>= 1; default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the random delays")
    p.add_argument("--steps", type=int, default=16, help="train.max_steps of both runs (default 16)")
    p.add_argument("--workdir", default=None, help="where the runs go (default: a new temporary directory, kept)")
    args = p.parse_args(argv)
    if args.kills < 1 or args.steps < 2 * args.kills:
        p.error("--kills must be >= 1 and --steps >= 2 x --kills (each kill waits for a step of its own)")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rank_soak-"))
    print(
        f"rank soak: {args.kills} kills, seed {args.seed}, {args.steps} steps, 2 ranks; runs and logs in {workdir}",
        flush=True,
    )
    summary = soak(workdir, kills=args.kills, seed=args.seed, steps=args.steps)
    print("\n".join(k.line() for k in summary.kills), end="\n\n")
    print(summary.table())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
