#!/usr/bin/env python
"""Crash soak: `kill -9` the CPU training of the bundled default at chosen and random moments, resume, and prove
that nothing was lost.

    python scripts/crash_soak.py                                   # 20 kills, seed 0, 40 steps: ~2.5 min on 2 cores
    python scripts/crash_soak.py --kills 200 --seed 7 --steps 200 --workdir /tmp/soak

Two runs of `python -m flashdraft train` with the same short overrides (`OVERRIDES`): a reference that runs
uninterrupted, and a crashed run that gets SIGKILL `--kills` times and is restarted after each kill — with `--resume`
once a verified checkpoint exists; a run killed before its first checkpoint simply starts again from scratch, as a
user would (there is nothing to resume, and `--resume` without a checkpoint is an error by design). The reference
runs beside the crashed run (the machine has 2 cores; each trainer uses one thread).

Where the kills land (kill i of K waits until training has reached step i*N/K, so they spread over the whole run):
  write:STAGE  two thirds of them, at a stage of a checkpoint write found by polling the checkpoint directory:
               the moment a new `.tmp-step_*` directory appears (start), the moment one of its files appears
               (drafter/model.safetensors, optimizer.pt, ..., MANIFEST.json), or the moment it is renamed to
               `step_*` (the kill then lands in the pointer update or pruning); every stage before any repeats
  step         the other third, a random 0-0.5 s (at most 2 steps) after the run logged its step (mid-step, in
               the metrics write, ...)
  shards       the first run, while it writes its tokenised data shards
  first-step   after step 1, before the first checkpoint (the restart starts from scratch)
  after-final  after the final checkpoint: while the run plots its curve, or the moment the curve is written
               (while it measures tau)
Three restarts (a quarter, half and three quarters through) first damage the newest checkpoint: bytes flipped in
drafter/model.safetensors, optimizer.pt truncated, MANIFEST.json deleted. The restarted run must warn naming it and
resume from the previous one.

Checked after every kill, with the trainer dead: every `checkpoints/step_*` directory verifies against its manifest
(a torn checkpoint never looks complete) and `CheckpointManager.latest()` is the newest of them; no checkpoint the
trainer reported written is gone; metrics.jsonl holds steps 1, 2, ... exactly once each, at least up to the
resumable checkpoint (lines after it are dropped and recomputed by the resumed run, by design), with at most a torn
last line. At the end: the crashed run's metrics.jsonl equals the reference's (every value but the timings: exactly
one record per step), the final drafter weights, optimizer and scheduler states are bit-identical, and so is the
measured tau. Prints a summary table; exits 1 when any check failed. tests/reliability/test_crash_safety.py runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Short overrides of the bundled default: the CPU even where there is a GPU, a log line per step, a checkpoint every 2 steps (a kill between two
#: checkpoints leaves metrics lines the resumed run must drop), one short held-out prompt evaluated at step 0 and at the end.
OVERRIDES = [
    "train.device=cpu",
    "log.every=1",
    "log.checkpoint_every=2",
    "data.eval_limit=1",
    "data.eval_max_new_tokens=4",
]
#: Values of a metrics record that depend on the wall clock, not on the computation.
TIMING_KEYS = {"tok_s", "draft_tok_s", "mfu", "mem_gib"}
#: Files of a checkpoint in the order `CheckpointManager.save` writes them (names the phase a kill interrupted).
WRITE_ORDER = (
    "drafter/config.json",
    "drafter/model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng.pt",
    "trainer_state.json",
    "MANIFEST.json",
)
DAMAGE = ("flip bytes in drafter/model.safetensors", "truncate optimizer.pt", "delete MANIFEST.json")
#: Where kills aimed at a checkpoint write land: as the temporary directory appears, as each file of it appears,
#: and just after the rename that publishes it (then in the pointer update or pruning).
WRITE_STAGES = ("start", *WRITE_ORDER[1:], "renamed")
POLL_S = 0.001
LAUNCH_TIMEOUT_S = 600
_WRITTEN = re.compile(r"checkpoint \S*step_(\d+) written")
_TMP_STEP = re.compile(r"^\.tmp-step_(\d+)-")
# Where a checkpoint is being written: its temporary directory, or (a broken, non-atomic save) a new step_ directory.
_WRITING = re.compile(r"^(?:\.tmp-)?step_(\d+)(?:-|$)")


class SoakError(RuntimeError):
    """The soak itself cannot go on (a trainer failed or hung); the message says which launch and where its log is."""


@dataclass
class Kill:
    index: int
    aim: str
    resumed_from: int | None  # checkpoint step the killed launch resumed from; None: it started from scratch
    at_step: int  # the last step in metrics.jsonl when it was killed
    seconds: float  # from the launch to the kill
    in_write: str | None = None  # the checkpoint write it interrupted and how far that write had got
    after_commit: str | None = None  # the work after a checkpoint's rename it interrupted (pointer, pruning)

    def line(self) -> str:
        start = "from scratch" if self.resumed_from is None else f"resumed at {self.resumed_from}"
        where = self.in_write and f"in a checkpoint write ({self.in_write})" or self.after_commit or "between writes"
        return f"kill {self.index:3d}  {self.aim:<31}  {start:<13}  {self.seconds:5.1f} s  last step {self.at_step:3d}  {where}"


@dataclass
class Summary:
    kills: list[Kill] = field(default_factory=list)
    launches: int = 0
    fresh_restarts: int = 0  # restarts without --resume: killed before the first checkpoint
    damaged: list[str] = field(default_factory=list)  # "step_X: how"
    damage_skipped_with_warning: int = 0
    torn_visible: int = 0  # step_* directories that did not verify after a kill
    checkpoints_lost: int = 0
    records_lost: int = 0
    records_duplicated: int = 0
    torn_lines: int = 0  # torn last lines of metrics.jsonl seen after kills (allowed: they are dropped)
    curve_equal: bool = False
    weights_identical: bool = False
    state_identical: bool = False
    tau_equal: bool = False
    steps: int = 0
    seconds: float = 0.0
    litter: list[str] = field(default_factory=list)  # .tmp names left in the run directory at the end (not failures)
    failures: list[str] = field(default_factory=list)

    @property
    def kills_in_write(self) -> list[Kill]:
        return [k for k in self.kills if k.in_write]

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        aims: dict[str, int] = {}
        for k in self.kills:
            aim = "a write stage" if k.aim.startswith("write:") else k.aim
            aims[aim] = aims.get(aim, 0) + 1
        phases: dict[str, int] = {}
        for k in self.kills_in_write:
            phases[k.in_write] = phases.get(k.in_write, 0) + 1
        survived = len(self.kills) if self.ok else f"{len(self.kills)} (with failures)"
        rows = [
            ("kills survived", survived),
            ("  aimed at", ", ".join(f"{n} {a}" for a, n in aims.items())),
            ("kills during a checkpoint write", len(self.kills_in_write)),
            ("  write interrupted", "; ".join(f"{n}x {p}" for p, n in sorted(phases.items())) or "-"),
            ("kills after a rename, in the pointer update or pruning", sum(1 for k in self.kills if k.after_commit)),
            ("restarts from scratch (killed before the first checkpoint)", self.fresh_restarts),
            ("damaged checkpoints warned about, skipped", f"{self.damage_skipped_with_warning} / {len(self.damaged)}"),
            ("  damaged", "; ".join(self.damaged) or "-"),
            ("torn checkpoints visible as complete", self.torn_visible),
            ("checkpoints lost", self.checkpoints_lost),
            ("records lost / duplicated (summed over the checks)", f"{self.records_lost} / {self.records_duplicated}"),
            ("torn last metrics lines (dropped on resume)", self.torn_lines),
            ("final curve == uninterrupted run", _yes(self.curve_equal, f"{self.steps} steps, every non-timing value")),
            ("final drafter weights bit-identical", _yes(self.weights_identical)),
            ("optimizer + scheduler state bit-identical", _yes(self.state_identical)),
            ("measured tau identical", _yes(self.tau_equal)),
            ("temporary files left in the run directory", ", ".join(self.litter) or "none"),
            ("wall time", f"{self.seconds:.0f} s ({self.launches} launches of the crashed run)"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines += [f"FAILED: {f}" for f in self.failures] or ["all checks passed"]
        return "\n".join(lines)


def _yes(ok: bool, detail: str = "") -> str:
    return ("yes" if ok else "NO") + (f" ({detail})" if detail and ok else "")


# ---- launching and killing --------------------------------------------------------------------------------------


def trainer_command(out: Path, steps: int, resume: bool) -> list[str]:
    command = [sys.executable, "-m", "flashdraft", "--debug", "train", "--out", str(out)]
    return command + (["--resume"] if resume else []) + [f"train.max_steps={steps}", *OVERRIDES]


def launch(out: Path, steps: int, resume: bool, log: Path) -> subprocess.Popen:
    # One thread per trainer: the reference and the crashed run share 2 cores, and start-up (imports) costs less.
    # The reference uses the same environment, so both compute with the same thread count (same float sums).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLUMNS": "160"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        # cwd outside the repository: `python -m` would put the cwd first on sys.path.
        return subprocess.Popen(
            trainer_command(out, steps, resume),
            cwd=out.parent,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(proc: subprocess.Popen, predicate, what: str, log: Path):
    """Poll `predicate` until it returns something truthy (returned), or the trainer exits (None)."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while proc.poll() is None:
        hit = predicate()
        if hit:
            return hit
        if time.monotonic() > deadline:
            _kill(proc)
            raise SoakError(f"waited {LAUNCH_TIMEOUT_S} s for {what}; the trainer hung? log: {log}")
        time.sleep(POLL_S)
    return None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the trainer we started (by its pid) and reap it."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _last_logged_step(path: Path, inode: int | None) -> int:
    """The last complete record's step in metrics.jsonl, once this launch has (re)written the file (new inode):
    before that, the file still holds the killed launch's lines past its checkpoint."""
    try:
        if os.stat(path).st_ino == inode:
            return 0
        lines = path.read_bytes().split(b"\n")[:-1]  # the part after the last newline may be torn
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


# ---- checks -----------------------------------------------------------------------------------------------------


class Checker:
    """The invariants that must hold whenever the trainer is dead (see the module docstring)."""

    def __init__(self, out: Path, summary: Summary):
        self.out, self.summary = out, summary
        self.committed = 0  # newest checkpoint step known to be committed (seen verified, or reported written)
        self.damaged: set[int] = set()  # steps damaged on purpose and not yet rewritten

    def manager(self):
        from flashdraft.train.checkpoint import CheckpointManager

        return CheckpointManager(self.out)  # a fresh one each time: nothing cached from an earlier verification

    def verified_steps(self, where: str) -> list[int]:
        """Steps of the step_* directories that verify; any other one (not damaged on purpose) is a failure."""
        from flashdraft.train.checkpoint import CheckpointError

        manager, good = self.manager(), []
        for step, path in manager.checkpoints():
            try:
                manager.verify(path)
            except CheckpointError as exc:
                if step not in self.damaged:
                    self.summary.torn_visible += 1
                    self.summary.failures.append(f"{where}: {path.name} is visible but does not verify: {exc}")
                continue
            self.damaged.discard(step)  # rewritten since it was damaged
            good.append(step)
        return good

    def after_kill(self, where: str, log: Path) -> int | None:
        """Check everything; returns the step a restart resumes from (None: no checkpoint, start from scratch)."""
        s = self.summary
        good = self.verified_steps(where)
        latest = self.manager().latest()
        newest = max(good) if good else None
        if (latest is None) != (newest is None) or (latest is not None and latest.name != f"step_{newest:08d}"):
            s.failures.append(f"{where}: latest() is {latest}, the newest verified checkpoint is step {newest}")
        reported = [int(m) for m in _WRITTEN.findall(log.read_text())] if log.exists() else []
        self.committed = max([self.committed, *reported])
        if (newest or 0) < self.committed:
            lost = sorted({n for n in [self.committed, *reported] if n > (newest or 0)})
            s.checkpoints_lost += len(lost)
            s.failures.append(f"{where}: checkpoint(s) {lost} were committed but the newest left is {newest}")
        self.committed = max(self.committed, newest or 0)
        self.check_records(where, newest or 0)
        return newest

    def check_records(self, where: str, upto: int, final: bool = False) -> None:
        s, path = self.summary, self.out / "metrics.jsonl"
        raw = path.read_text().split("\n") if path.exists() else []
        steps, torn = [], 0
        for n, line in enumerate(raw):
            if not line.strip():
                continue
            try:
                steps.append(json.loads(line)["step"])
            except ValueError:
                torn += 1
                if n != len(raw) - 1 or final:
                    s.failures.append(f"{where}: metrics.jsonl line {n + 1} is not JSON and not a torn last line")
        s.torn_lines += torn
        missing = sorted(set(range(1, upto + 1)) - set(steps))
        duplicated = len(steps) - len(set(steps))
        s.records_lost += len(missing)
        s.records_duplicated += duplicated
        trained = steps[1:] if steps[:1] == [0] else steps  # step 0: the evaluation before the first step
        if missing or duplicated or trained != list(range(1, len(trained) + 1)):
            s.failures.append(f"{where}: metrics.jsonl steps {_ranges(steps)}; the checkpoint is at step {upto}")

    def damage_newest(self, how: str, where: str) -> int | None:
        """Damage the newest checkpoint when an older good one exists; returns the step a restart must use."""
        good = self.verified_steps(where)
        if len(good) < 2:
            return None
        path = self.out / "checkpoints" / f"step_{good[-1]:08d}"
        if how.startswith("flip"):
            weights = path / "drafter" / "model.safetensors"
            data = bytearray(weights.read_bytes())
            for i in range(len(data) - 64, len(data)):  # the last tensor's bytes: same size, different content
                data[i] ^= 0xFF
            weights.write_bytes(bytes(data))
        elif how.startswith("truncate"):
            optimizer = path / "optimizer.pt"
            optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
        else:
            (path / "MANIFEST.json").unlink()
        self.damaged.add(good[-1])
        self.summary.damaged.append(f"{path.name}: {how}")
        self.committed = good[-2]
        return good[-2]


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return f"{steps[0]}..{steps[-1]}"
    return str(steps)


# ---- the soak ---------------------------------------------------------------------------------------------------


def plan_kills(kills: int, steps: int, rng: random.Random) -> list[tuple[str, int]]:
    """(aim, step to reach first) per kill: the edges first and last; in between, two thirds aimed at the stages of
    a checkpoint write (each stage once before any repeats), one third at random moments of steps; shuffled."""
    middle = max(0, kills - 3)
    n_write = (2 * middle + 2) // 3
    stages = []
    while len(stages) < n_write:
        stages += rng.sample(WRITE_STAGES, len(WRITE_STAGES))
    aims = [f"write:{stage}" for stage in stages[:n_write]] + ["step"] * (middle - n_write)
    rng.shuffle(aims)
    aims = (["shards", "first-step"] + aims + ["after-final"])[:kills]
    return [(aim, i * steps // kills) for i, aim in enumerate(aims)]


def _kill_when_aimed(proc, aim: str, target: int, out: Path, steps: int, log: Path, rng: random.Random) -> str | None:
    """Wait for the moment `aim` describes (not before training reaches `target`), then SIGKILL; returns the aim
    (amended when the moment was missed), or None when the trainer exited by itself first."""
    ckpt, metrics = out / "checkpoints", out / "metrics.jsonl"
    stale = set(_listdir(ckpt))
    inode = _inode(metrics)

    def new_write():
        for name in _listdir(ckpt):
            m = _WRITING.match(name)
            if m and name not in stale and int(m.group(1)) >= target:
                return name
        return None

    def shards():
        names = _listdir(out)
        if any(n.startswith(".shards.tmp-") for n in names):
            return "shards"
        # Too quick to be seen (the poll missed it): the shards are in place, kill before the first checkpoint.
        return "shards (missed: before the first checkpoint)" if "shards" in names else None

    def logged(step):
        return lambda: _last_logged_step(metrics, inode) >= step

    if aim == "shards":
        aim = _wait_for(proc, shards, "shard writing", log)
    elif aim == "first-step":
        aim = _wait_for(proc, logged(1), "step 1", log) and aim
    elif aim.startswith("write:"):
        tmp = _wait_for(proc, new_write, f"a checkpoint write of step >= {target}", log)
        aim = tmp and _wait_for_stage(proc, ckpt, tmp, aim.removeprefix("write:"), log) and aim
    elif aim == "step":
        aim = _wait_for(proc, logged(max(target, 1)), f"step {target}", log) and aim
        if aim:
            # A random moment of the next steps: up to 0.5 s, but at most 2 more steps (a fast machine must not
            # finish the run first).
            deadline = time.monotonic() + rng.uniform(0, 0.5)
            _wait_for(proc, lambda: time.monotonic() > deadline or logged(max(target, 1) + 2)(), "a delay", log)
    elif aim == "after-final":
        done = (f"step_{steps:08d} written", f"step_{steps:08d} (step {steps})")  # trained to the end / resumed there
        aim = _wait_for(proc, lambda: any(d in log.read_text() for d in done), "the final checkpoint", log) and aim
        curve, inode = out / "training_curve.png", _inode(out / "training_curve.png")
        if aim and rng.random() < 0.5:
            time.sleep(rng.uniform(0, 0.1))  # closing the metrics, plotting the curve
            aim = "after-final (plot)"
        elif aim:  # measuring tau: the curve is written (atomically: a new inode) just before
            new_curve = _wait_for(proc, lambda: _inode(curve) not in (None, inode), "the training curve", log)
            aim = new_curve and "after-final (tau)"
    else:
        raise ValueError(f"unknown kill aim {aim!r}")
    if not aim or proc.poll() is not None:
        return None
    _kill(proc)
    return aim


def _wait_for_stage(proc, ckpt: Path, tmp: str, stage: str, log: Path) -> bool | None:
    """Wait until the write in `ckpt/tmp` reaches `stage` (a file of WRITE_ORDER appears; "start": at once;
    "renamed": the directory has its final name). A stage passed before the poll saw it counts as reached."""
    final = ckpt / f"step_{_WRITING.match(tmp).group(1)}"

    def reached():
        if stage == "renamed":
            if tmp == final.name:  # written in place: nothing is renamed, the manifest is the last thing written
                return (final / "MANIFEST.json").exists()
            return not (ckpt / tmp).exists() and final.exists()
        return stage == "start" or (ckpt / tmp / stage).exists() or not (ckpt / tmp).exists()

    return _wait_for(proc, reached, f"stage {stage} of {tmp}", log)


def _where_killed(out: Path, before: set[str]) -> tuple[str | None, str | None]:
    """(how far the checkpoint write a kill interrupted had got, or None; the post-rename work it interrupted, or None).

    `before`: the names in checkpoints/ before the launch. A new `.tmp-step_*` directory left behind means the kill
    was inside a write; its phase is the last file of WRITE_ORDER present. A new `.tmp-del-*`/`.tmp-old-*`/
    `.tmp-latest`, or a new `step_*` directory the `latest` pointer does not name yet, means it was after a rename.
    """
    ckpt = out / "checkpoints"
    names = set(_listdir(ckpt)) - before
    for name in names:
        if _TMP_STEP.match(name):
            present = [f for f in WRITE_ORDER if (ckpt / name / f).exists()]
            if not present:
                return "before any file", None
            if present[-1] == "MANIFEST.json":
                return "MANIFEST.json written, not yet renamed", None
            return f"in/after {present[-1]}", None
    for name in names:
        if name.startswith("step_") and not (ckpt / name / "MANIFEST.json").exists():
            return "a step_ directory written in place, without its manifest", None
    if any(n.startswith((".tmp-del-", ".tmp-old-", ".tmp-latest")) for n in names):
        return None, "after a rename: in the pointer update or pruning"
    new_steps = sorted(n for n in names if n.startswith("step_"))
    pointer = ckpt / "latest"
    if new_steps and (not pointer.exists() or pointer.read_text().strip() != new_steps[-1]):
        return None, "after a rename, before the pointer update"
    return None, None


def _tail(log: Path, n: int = 3000) -> str:
    return log.read_text()[-n:] if log.exists() else "(no log)"


def soak(workdir: str | os.PathLike, *, kills: int = 20, seed: int = 0, steps: int = 40) -> Summary:
    """Run the whole soak in `workdir` (reference/, crashed/, logs/); see the module docstring."""
    from flashdraft.telemetry.metrics import read_metrics

    started = time.monotonic()
    workdir = Path(workdir)
    ref_out, out, logs = workdir / "reference", workdir / "crashed", workdir / "logs"
    for d in (ref_out, out):
        d.mkdir(parents=True, exist_ok=False)
    rng = random.Random(seed)
    summary = Summary(steps=steps)
    checker = Checker(out, summary)
    reference = launch(ref_out, steps, False, logs / "reference.log")
    plan = plan_kills(kills, steps, rng)
    damage_at = {round(kills * q): how for q, how in zip((0.25, 0.5, 0.75), DAMAGE, strict=True)}
    pending_damage: list[str] = []
    resume_from: int | None = None
    proc = None
    try:
        for i, (aim, target) in enumerate([*plan, ("none", steps)]):
            last = i == len(plan)
            if i in damage_at:
                pending_damage.append(damage_at[i])
            expect_from = None
            fallback = checker.damage_newest(pending_damage[0], f"before launch {i}") if pending_damage else None
            if fallback is not None:
                damaged = summary.damaged[-1].split(":")[0]
                pending_damage.pop(0)
                expect_from, resume_from = (damaged, fallback), fallback
            log = logs / f"launch_{i:03d}.log"
            if resume_from is None and i > 0:
                summary.fresh_restarts += 1
            stale = set(_listdir(out / "checkpoints"))
            t0 = time.monotonic()
            proc = launch(out, steps, resume_from is not None, log)
            summary.launches += 1
            if last:
                try:
                    proc.wait(timeout=LAUNCH_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    _kill(proc)
                    raise SoakError(f"the final launch did not finish in {LAUNCH_TIMEOUT_S} s; log: {log}") from None
                if proc.returncode != 0:
                    raise SoakError(f"the final launch exited {proc.returncode}; log {log}:\n{_tail(log)}")
            else:
                if resume_from is not None and resume_from >= steps:
                    aim = "after-final"  # resumed at the end already: only the plot and tau are left to kill
                planned, aim = aim, _kill_when_aimed(proc, aim, target, out, steps, log, rng)
                if aim is None:
                    raise SoakError(
                        f"launch {i} exited ({proc.returncode}) before its kill ({planned}, step >= "
                        f"{target}); log {log}:\n{_tail(log)}"
                    )
                records = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
                kill = Kill(
                    i,
                    aim,
                    resume_from,
                    records[-1]["step"] if records else 0,
                    time.monotonic() - t0,
                    *_where_killed(out, stale),
                )
                summary.kills.append(kill)
            if expect_from is not None:
                _check_fallback(log, out, *expect_from, summary)
            resume_from = checker.after_kill(f"after launch {i}" + ("" if last else f" (kill: {aim})"), log)
        reference.wait(timeout=LAUNCH_TIMEOUT_S)
        if reference.returncode != 0:
            raise SoakError(f"the reference run exited {reference.returncode}:\n{_tail(logs / 'reference.log')}")
    finally:
        for p in (reference, proc):  # only when the soak itself failed
            if p is not None and p.poll() is None:
                _kill(p)
    if pending_damage:
        summary.failures.append(f"damage not applied (never two good checkpoints at a restart): {pending_damage}")
    compare_final(ref_out, out, steps, summary, checker)
    summary.seconds = time.monotonic() - started
    return summary


def _check_fallback(log: Path, out: Path, damaged: str, fallback: int, summary: Summary) -> None:
    """The launch after damaging `damaged` must warn naming it and resume from the checkpoint before it."""
    text = log.read_text()
    warned = text.count(f"skipping checkpoint {out / 'checkpoints' / damaged},")
    resumed = f"resumed from {out / 'checkpoints' / f'step_{fallback:08d}'} (step {fallback})" in text
    if warned == 1 and resumed:
        summary.damage_skipped_with_warning += 1
    else:
        summary.failures.append(
            f"{log.name}: after damaging {damaged}: warned about it {warned} times (once "
            f"expected); resumed from step {fallback}: {resumed}"
        )


def compare_final(ref_out: Path, out: Path, steps: int, summary: Summary, checker: Checker) -> None:
    import torch
    from safetensors.torch import load_file

    from flashdraft.telemetry.metrics import read_metrics

    checker.check_records("final", steps, final=True)
    checker.after_kill("final", out / "none")  # the checkpoint invariants once more, with the run complete
    ckpt = out / "checkpoints"
    pointer = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    if pointer != f"step_{steps:08d}":
        summary.failures.append(f"final: {ckpt / 'latest'} names {pointer}, not step_{steps:08d}")
    if leftovers := sorted(n for n in _listdir(ckpt) if n.startswith(".tmp-")):
        summary.failures.append(f"final: interrupted saves left {leftovers} in {ckpt} (the next save removes them)")
    summary.litter = sorted(n for n in _listdir(out) if ".tmp" in n)
    ref, got = read_metrics(ref_out / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")

    def values(records):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]

    summary.curve_equal = values(ref) == values(got) and [r["step"] for r in got] == list(range(steps + 1))
    if not summary.curve_equal:
        diff = next(
            (f"step {a.get('step')}: {a} != {b}" for a, b in zip(values(ref), values(got), strict=False) if a != b), ""
        )
        summary.failures.append(
            f"final metrics differ from the uninterrupted run ({len(ref)} vs {len(got)} records) {diff}"
        )
    final = f"checkpoints/step_{steps:08d}"
    a = load_file(ref_out / final / "drafter" / "model.safetensors")
    b = load_file(out / final / "drafter" / "model.safetensors")
    summary.weights_identical = a.keys() == b.keys() and all(_bits(a[k]) == _bits(b[k]) for k in a)
    if not summary.weights_identical:
        summary.failures.append("final drafter weights differ from the uninterrupted run's")

    def load(root, name):
        return torch.load(root / final / name, map_location="cpu", weights_only=True)

    summary.state_identical = all(_same(load(ref_out, n), load(out, n)) for n in ("optimizer.pt", "scheduler.pt"))
    if not summary.state_identical:
        summary.failures.append("final optimizer/scheduler state differs from the uninterrupted run's")
    taus = [json.loads((d / "measured_tau.json").read_text()) for d in (ref_out, out)]
    summary.tau_equal = taus[0] == taus[1]
    if not summary.tau_equal:
        summary.failures.append(f"measured tau {taus[1]} != uninterrupted {taus[0]}")


def _bits(t) -> bytes:
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _same(a, b) -> bool:
    """Bitwise equality of nested state dicts (tensors compared by their bytes)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and _bits(a) == _bits(b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs of the crashed run (>= 8; default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan and the random delays")
    p.add_argument("--steps", type=int, default=40, help="train.max_steps of both runs (default 40)")
    p.add_argument("--workdir", default=None, help="where the runs go (default: a new temporary directory, kept)")
    args = p.parse_args(argv)
    if args.kills < 8 or args.steps < 8:
        p.error("--kills and --steps must be >= 8 (3 of the restarts damage a checkpoint, each needs an older one)")
    import tempfile

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="crash_soak-"))
    logging.getLogger("flashdraft").setLevel(logging.ERROR)  # the damaged checkpoints' warnings are expected
    print(
        f"crash soak: {args.kills} kills, seed {args.seed}, {args.steps} steps of the bundled default; "
        f"runs and logs in {workdir}",
        flush=True,
    )
    summary = soak(workdir, kills=args.kills, seed=args.seed, steps=args.steps)
    print("\n".join(k.line() for k in summary.kills), end="\n\n")
    print(summary.table())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
