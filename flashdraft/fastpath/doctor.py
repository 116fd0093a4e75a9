"""`flashdraft doctor`: is every fast path of a hybrid target active here, and if not, what to do.

Each check has a status (ok / warn / fail / info), a one-line detail and a one-line fix. The per-layer probe table
of a model (the caller builds it, with random weights: `flashdraft doctor --model`, a tiny hybrid by default;
flashdraft.target.tiny) is part of the verdict.
Exit code 0 only when the fast path is complete; on a machine without a CUDA device it cannot be, and doctor says so.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from flashdraft import versions

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0  # how long the check took (the first GPU run compiles Triton kernels: tens of seconds)


# Known causal-conv1d build failures (pip log text) -> (meaning, fix). Matched by `diagnose_build_log`.
BUILD_FAILURES = [
    (
        r"NameError: name 'bare_metal_version' is not defined",
        "no nvcc: causal-conv1d's setup.py reads the CUDA compiler version outside its `CUDA_HOME` check",
        "not needed with flashdraft (its Triton conv replaces it); otherwise install the CUDA toolkit and set CUDA_HOME",
    ),
    (
        r"CUDA_HOME environment variable is not set|CUDA_HOME.*(not set|None)",
        "CUDA_HOME is unset, so the extension cannot find nvcc",
        "export CUDA_HOME=/usr/local/cuda (or skip causal-conv1d: flashdraft does not need it)",
    ),
    (
        r"The detected CUDA version \(.*\) mismatches the version that was used to compile\s*PyTorch",
        "nvcc's CUDA version differs from the one torch was built with",
        "use an nvcc matching torch.version.cuda, or skip causal-conv1d (flashdraft does not need it)",
    ),
    (
        r"No module named 'wheel'|invalid command 'bdist_wheel'",
        "pip's isolated build environment lacks the undeclared `wheel` build dependency",
        "pip install wheel && pip install --no-build-isolation causal-conv1d (or skip it: flashdraft does not need it)",
    ),
    (
        r"No module named 'torch'",
        "the isolated build environment has no torch (causal-conv1d does not declare it)",
        "pip install --no-build-isolation causal-conv1d (or skip it: flashdraft does not need it)",
    ),
    (
        r"(urlopen error|Connection refused|Temporary failure in name resolution|HTTPError).*",
        "setup.py tried to download a prebuilt wheel from GitHub and had no network; it then compiles for ~10 archs",
        "expect a multi-minute compile, or skip causal-conv1d: flashdraft does not need it",
    ),
]


def diagnose_build_log(text: str) -> list[tuple[str, str]]:
    """(meaning, fix) for every known causal-conv1d build failure found in a pip log."""
    return [(meaning, fix) for pattern, meaning, fix in BUILD_FAILURES if re.search(pattern, text)]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_machine() -> bool:
    """No CUDA device and no NVIDIA driver: a CPU machine, where the torch reference is the right path (a driver
    without a usable device is a broken GPU set-up, and stays a failure)."""
    return not torch.cuda.is_available() and shutil.which("nvidia-smi") is None


def check_gpu() -> Check:
    if cpu_machine():
        return Check(
            "gpu",
            INFO,
            "no CUDA device (a CPU machine): runs use the torch reference (correct, slow); the fast kernels need an "
            "NVIDIA GPU",
            "",
        )
    if not torch.cuda.is_available():
        return Check(
            "gpu",
            FAIL,
            "no CUDA device: the fast kernels cannot run; CPU runs use the torch reference (correct, slow)",
            "run on a machine with an NVIDIA GPU (compute capability >= 8.0) to train at speed",
        )
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    status = OK if major >= 8 else WARN
    fix = "" if status == OK else "fla's kernels are tuned for sm_80+; expect lower speed"
    return Check("gpu", status, f"{name}, compute capability {major}.{minor}", fix)


def _untested(dist: str, version: str) -> Check | None:
    """A warning when `version` is newer than the newest release flashdraft was tested with."""
    if versions.status(dist, version) != "untested":
        return None
    return Check(
        dist,
        WARN,
        f"{dist} {version} is newer than the releases flashdraft was tested with",
        f"if something fails, pip install '{dist}{versions.supported_range(dist)}' (tested)",
    )


def check_torch() -> Check:
    cuda = torch.version.cuda
    detail = f"torch {torch.__version__}, built for CUDA {cuda}" if cuda else f"torch {torch.__version__} (CPU build)"
    if cuda is None and torch.cuda.device_count() == 0 and shutil.which("nvidia-smi"):
        return Check("torch", FAIL, detail + " but an NVIDIA driver is present", "pip install a CUDA build of torch")
    untested = _untested("torch", torch.__version__)
    if untested is not None:
        untested.detail = detail + "; newer than the releases flashdraft was tested with"
        return untested
    return Check("torch", OK, detail)


def check_driver() -> Check:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Check("driver", INFO if not torch.cuda.is_available() else WARN, "nvidia-smi not found", "")
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        version = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "?"
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("driver", WARN, f"nvidia-smi failed: {exc}", "check the NVIDIA driver installation")
    return Check("driver", OK, f"NVIDIA driver {version}")


def check_triton() -> Check:
    version = _version("triton")
    if version is None:
        return Check(
            "triton", FAIL, "triton not installed", f"pip install 'triton{versions.supported_range('triton')}'"
        )
    untested = _untested("triton", version)
    if untested is not None:
        return untested
    if not torch.cuda.is_available():
        return Check("triton", INFO, f"triton {version}; no CUDA device to compile for", "")
    try:
        from flashdraft.kernels import causal_conv1d_fn, causal_conv1d_ref

        x = torch.randn(2, 64, 37, device="cuda")
        w = torch.randn(64, 4, device="cuda")
        err = (causal_conv1d_fn(x, w, activation="silu") - causal_conv1d_ref(x, w, activation="silu")).abs().max()
        if not err < 1e-3:
            return Check(
                "triton",
                FAIL,
                f"triton {version}: our conv kernel compiled but is wrong (err {err:.2e})",
                "report this with `flashdraft doctor --json`",
            )
    except Exception as exc:
        return Check(
            "triton",
            FAIL,
            f"triton {version} cannot compile for this GPU: {type(exc).__name__}: {exc}",
            f"install the triton your torch was built with (pip install 'triton{versions.supported_range('triton')}')",
        )
    return Check("triton", OK, f"triton {version} compiles and runs flashdraft's causal_conv1d on this GPU")


def check_fla() -> Check:
    """Importable, and where its kernels can run. Running them is the probe's job: a separate run here would
    autotune fla's chunk kernels at other shapes, doubling a first run's compile time (54 s of it on an H200)."""
    from flashdraft.fastpath.backends import import_status

    mod, why = import_status("fla.ops.gated_delta_rule")
    version = _version("fla-core") or _version("flash-linear-attention")
    if mod is None:
        return Check("fla-core", FAIL, why, "pip install fla-core==0.6.0 (pure Python + Triton; no build)")
    if not torch.cuda.is_available():
        return Check("fla-core", INFO, f"fla-core {version} importable; its kernels need a CUDA device", "")
    return Check("fla-core", OK, f"fla-core {version} importable; the probe runs its delta-rule kernels per layer")


def check_causal_conv1d() -> Check:
    """The pip package is optional. If absent, predict whether building it here would fail, and why."""
    from flashdraft.fastpath.backends import import_status

    version = _version("causal-conv1d")
    mod, why = import_status("causal_conv1d")
    if mod is not None:
        return Check(
            "causal-conv1d",
            OK,
            f"causal-conv1d {version} importable (optional; flashdraft's Triton conv is used by default)",
        )
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
    )
    problems = []
    if nvcc is None or not os.path.exists(nvcc):
        problems.append("no nvcc -> its setup.py fails with `NameError: name 'bare_metal_version' is not defined`")
    elif torch.version.cuda:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"release (\d+\.\d+)", out)
        if m and m.group(1).split(".")[0] != torch.version.cuda.split(".")[0]:
            problems.append(
                f"nvcc {m.group(1)} vs torch CUDA {torch.version.cuda} -> 'detected CUDA version mismatches'"
            )
    if not os.environ.get("CUDA_HOME") and nvcc is None:
        problems.append("CUDA_HOME unset")
    if _version("wheel") is None:
        problems.append("no `wheel` -> build isolation fails; needs --no-build-isolation")
    detail = "not installed (not needed: flashdraft's Triton causal_conv1d is a drop-in replacement)"
    if version is not None:
        detail = f"causal-conv1d {version} installed but not importable: {why}"
    if problems:
        detail += "; building it here would fail: " + "; ".join(problems)
    return Check("causal-conv1d", INFO, detail, "nothing to do: flashdraft does not need it")


def transformers_generation(version: str) -> str:
    """How a transformers release looks up the Gated DeltaNet kernels (see fastpath/patch.py)."""
    status = versions.status("transformers", version)
    if status == "too old":
        return f"unsupported (flashdraft needs {versions.supported_range('transformers')})"
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    if (major, minor) <= (5, 14):
        gen = "5.2-5.14: kernels imported at module import; per-layer attributes"
    elif (major, minor) < (5, 25):
        gen = "5.15-5.24: hub-kernel decorator resolves each function once at import; module globals"
    else:
        gen = "5.25+: module globals, and transformers sends CPU inputs to its torch reference itself"
    return gen + ("; newer than the releases flashdraft was tested with" if status == "untested" else "")


def check_transformers() -> Check:
    import transformers

    version = transformers.__version__
    gen = transformers_generation(version)
    status = {"too old": FAIL, "untested": WARN}.get(versions.status("transformers", version), OK)
    fix = f"pip install 'transformers{versions.supported_range('transformers')}' (tested)" if status != OK else ""
    return Check("transformers", status, f"transformers {version} — {gen}", fix)


def run_doctor(build_model: Callable[[str, torch.dtype], nn.Module], progress=None) -> dict:
    """All checks, then the per-layer probe of `build_model(device, dtype)` (flashdraft.devices' auto: bf16 on the GPU
    when there is one, else float32 on the CPU), then its linears as FP8. progress(line): told before and after each step (slow ones compile
    Triton kernels on a first GPU run), so that a long first run is never silent."""
    progress = progress or (lambda line: None)
    steps = [
        ("gpu", check_gpu),
        ("torch", check_torch),
        ("driver", check_driver),
        ("triton (compiles flashdraft's conv on a GPU)", check_triton),
        ("fla-core", check_fla),
        ("causal-conv1d", check_causal_conv1d),
        ("transformers", check_transformers),
    ]
    checks = [_timed(progress, label, fn) for label, fn in steps]
    probed: dict = {}
    announce = "probe: a prefill and a decode step, per layer (a first GPU run autotunes fla's kernels: ~1 min)"
    checks.append(_timed(progress, "probe", lambda: _probe(build_model, probed), announce))
    if probed.get("report") is not None:
        checks.append(_timed(progress, "fp8 linears", lambda: check_fp8(probed["model"])))
    ok = all(c.status != FAIL for c in checks)
    layers = probed["report"].to_dict()["layers"] if probed.get("report") is not None else []
    return {"ok": ok, "checks": [asdict(c) for c in checks], "layers": layers, "_report": probed.get("report")}


def _timed(progress, label: str, fn, announce: str | None = None) -> Check:
    progress(f"{announce or label} ...")
    start = time.perf_counter()
    check = fn()
    check.seconds = round(time.perf_counter() - start, 2)
    progress(f"{label}: {check.seconds:.1f} s")
    return check


def _probe(build_model, probed: dict) -> Check:
    """The per-layer probe; the model and its report go into `probed`."""
    from flashdraft import fastpath
    from flashdraft.devices import resolve_device, resolve_dtype

    try:
        device = resolve_device("auto")
        probed["model"] = build_model(str(device), resolve_dtype("auto", device))
        report = probed["report"] = fastpath.enable(probed["model"], strict=False)
    except Exception as exc:
        return Check(
            "probe",
            FAIL,
            f"could not build or probe the model: {type(exc).__name__}: {exc}",
            "pass --model with a config.json or model directory of a supported family",
        )
    # On a CPU machine every layer falls back by design ("no CUDA device"): reported, not a failure.
    status = OK if report.ok else (INFO if cpu_machine() else FAIL)
    return Check("probe", status, report.summary(), "" if status != FAIL else _probe_fix(report))


def check_fp8(model) -> Check:
    """`target.precision: fp8` on this machine: the probe model's linears converted to FP8 and probed again."""
    from flashdraft import fastpath
    from flashdraft.fastpath import fp8

    reason = fp8.unsupported_reason(next(model.parameters()).device)
    if reason is not None:
        return Check("fp8 linears", INFO, f"target.precision=fp8 unavailable: {reason}")
    fp8.convert_linears(model)
    use = fastpath.probe(model).fp8
    if use is None:
        return Check("fp8 linears", INFO, "the probe model has no linear that FP8 converts")
    return Check("fp8 linears", OK if use.ok else FAIL, use.summary(), "" if use.ok else "use target.precision=bf16")


def _probe_fix(report) -> str:
    text = report.failure_message()
    if "no CUDA device" in text:
        return "run on a GPU; on a CPU the torch reference is used (correct, slow)"
    if "fla" in text and "not importable" in text:
        return "pip install fla-core==0.6.0"
    return "see the per-layer table; `flashdraft.fastpath.enable(model)` patches every layer"


def _progress_to_stderr(line: str) -> None:
    # stderr, so that `--json` keeps stdout one JSON object
    print(f"[doctor] {line}", file=sys.stderr, flush=True)


def main(argv_json: bool, build_model: Callable[[str, torch.dtype], nn.Module], build_log: str | None = None) -> int:
    """The report of `run_doctor(build_model)`, as JSON or tables; the exit code (0: fast path complete)."""
    result = run_doctor(build_model, progress=_progress_to_stderr)
    report = result.pop("_report")
    if build_log:
        with open(build_log, errors="replace") as fh:
            found = diagnose_build_log(fh.read())
        result["build_log"] = [{"meaning": m, "fix": f} for m, f in found]
    if argv_json:
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="flashdraft doctor")
    for col in ("check", "status", "detail", "fix", "s"):
        table.add_column(col, overflow="fold")
    colour = {OK: "green", WARN: "yellow", FAIL: "red", INFO: "cyan"}
    for c in result["checks"]:
        table.add_row(
            c["name"], f"[{colour[c['status']]}]{c['status']}[/]", c["detail"], c["fix"], f"{c['seconds']:.1f}"
        )
    console.print(table)
    if report is not None and report.layers:
        console.print(report.table())
    for item in result.get("build_log", []):
        console.print(f"[yellow]build log:[/] {item['meaning']} — fix: {item['fix']}")
    if cpu_machine():
        verdict = "[yellow]a CPU machine[/]: no fast path to prove here (runs use the torch reference)"
    else:
        verdict = "[green]fast path complete[/]" if result["ok"] else "[red]fast path incomplete[/] (exit 1)"
    console.print(verdict)
    return 0 if result["ok"] else 1
