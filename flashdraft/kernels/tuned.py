"""Kernel configurations Triton's autotuner chose on named GPUs, shipped so that a fresh machine skips the timing.

    tuned.apply(device)              # fill fla's autotuners with the choices shipped for this GPU
    tuned.fill(autotuner)            # one autotuner (flashdraft's conv kernels fill themselves when built)
    tuned.export(files, gpu, triton_version)   # a run's autotuning as such a file (python -m bench.kernel_configs)

Every fast kernel (fla's delta rule and norms, flashdraft's conv) is autotuned by Triton the first time it meets a
shape: each candidate config is compiled and timed. Triton keeps the results on disk, so a second process on the
same machine skips it, but a freshly started GPU machine pays it in full, for every kernel and shape of a run: most
of a short run's time can go to choosing between configs that differ by microseconds (bench/RESULTS.md has the
figures). `tuned/<GPU>.json` holds the autotuner's choices measured on that GPU (the shapes the run
`bench/gpu_run.sh` makes on it tuned: the bundled default's).
An entry is used only where everything matches: the GPU's name, the kernel's name, its whole autotuning key (the
shape values it tunes on and every tensor's dtype) and a config the kernel's own autotuner offers. Any other shape
is autotuned as before. FLASHDRAFT_SHIPPED_TUNING=0 turns this off.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

TUNED_DIR = Path(__file__).parent / "tuned"
CONFIG_FIELDS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
"""What a config is besides its kwargs (Triton's Config attributes; hooks and IR overrides are never shipped)."""
_filled: set[int] = set()  # autotuners already filled (by id): apply() runs for every model a process patches


def gpu_file(name: str) -> Path:
    """The shipped file of a GPU, by its CUDA device name ("NVIDIA H200" -> tuned/NVIDIA_H200.json)."""
    return TUNED_DIR / (re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") + ".json")


def enabled() -> bool:
    return os.environ.get("FLASHDRAFT_SHIPPED_TUNING", "1") != "0"


@functools.cache
def load(name: str) -> dict[str, list[dict]]:
    """{kernel name: [{"key": [...], "config": {...}}, ...]} shipped for the GPU called `name` ({} if none). Read
    once per process (every patched model and every conv autotuner asks); treat it as read-only."""
    path = gpu_file(name)
    if not path.is_file():
        return {}
    with open(path) as fh:
        return json.load(fh)["kernels"]


def apply(device: torch.device | str) -> int:
    """Fill every autotuner of the loaded fla kernel modules with the choices shipped for `device`'s GPU. Returns
    how many (kernel, key) choices were placed; 0 off CUDA, without a file or when turned off."""
    device = torch.device(device)
    if device.type != "cuda" or not enabled():
        return 0
    table = load(torch.cuda.get_device_name(device))
    if not table:
        return 0
    placed = 0
    for autotuner in _module_autotuners():
        placed += fill(autotuner, table)
    if placed:
        logger.info("kernel configs: %d autotuning choices shipped for %s placed", placed, torch.cuda.get_device_name())
    return placed


def fill(autotuner, table: dict[str, list[dict]] | None = None) -> int:
    """Place the shipped choices of `autotuner`'s kernel in its cache, where the key is not tuned yet and the config
    is one of its own. `table`: a loaded file (default: the current CUDA device's). Returns how many it placed."""
    if table is None:
        if not (torch.cuda.is_available() and enabled()):
            return 0
        table = load(torch.cuda.get_device_name())
    entries = table.get(kernel_name(autotuner), [])
    if not entries or id(autotuner) in _filled:
        return 0
    _filled.add(id(autotuner))
    placed = 0
    for entry in entries:
        key = tuple(entry["key"])
        own = next((c for c in autotuner.configs if describe(c) == entry["config"]), None)
        if own is not None and key not in autotuner.cache:
            autotuner.cache[key] = own
            placed += 1
    return placed


def describe(config) -> dict:
    """A triton.Config as JSON: its kwargs and launch settings (the form Triton's autotune cache files use)."""
    return {"kwargs": dict(config.kwargs), **{f: getattr(config, f, None) for f in CONFIG_FIELDS}}


def kernel_name(autotuner) -> str:
    """The name of the @triton.jit function under an autotuner (through any heuristics wrapped around it)."""
    fn = autotuner.fn
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn.__name__


def _module_autotuners():
    """Every Triton autotuner bound at module level in the loaded fla modules (heuristics unwrapped). flashdraft's
    conv autotuners are built on first use and fill themselves then."""
    from triton.runtime.autotuner import Autotuner

    seen = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            for _ in range(3):  # through Heuristics (and the like) wrapped around the autotuner
                if isinstance(value, Autotuner) or not hasattr(value, "fn"):
                    break
                value = value.fn
            if isinstance(value, Autotuner) and id(value) not in seen:
                seen.add(id(value))
                yield value


def export(autotune_files: list[Path], gpu: str, triton_version: str, keep: dict[str, list[dict]] | None = None) -> str:
    """A shipped file's text from Triton's autotune cache files (`<kernel>.autotune.json`, written where
    TRITON_CACHE_AUTOTUNING or a kernel's cache_results asks): per kernel and key, the config with the least
    median time, as the autotuner itself chose it. `keep`: a loaded file whose entries stay unless measured again
    (a run on a machine that used them autotuned only what they did not cover); of a kernel and key listed more than
    once, the last entry stays."""
    kernels: dict[str, dict[str, dict]] = {}
    for name, entries in (keep or {}).items():
        for entry in entries:
            kernels.setdefault(name, {})[json.dumps(entry["key"])] = entry
    for path in autotune_files:
        with open(path) as fh:
            data = json.load(fh)
        name = path.name.split(".autotune.json")[0]
        best = min(data["configs_timings"], key=lambda pair: pair[1])[0]
        entry = {
            "key": data["key"],
            "config": {"kwargs": best["kwargs"], **{f: best.get(f) for f in CONFIG_FIELDS}},
        }
        kernels.setdefault(name, {})[json.dumps(data["key"])] = entry
    # One line per choice: a reviewable diff when a GPU is measured again.
    lines = [f'{{"gpu": {json.dumps(gpu)}, "triton": {json.dumps(triton_version)}, "kernels": {{']
    for i, (name, by_key) in enumerate(sorted(kernels.items())):
        entries = ",\n  ".join(json.dumps(by_key[k]) for k in sorted(by_key))
        lines.append(f" {json.dumps(name)}: [\n  {entries}\n ]" + ("," if i < len(kernels) - 1 else ""))
    return "\n".join(lines) + "\n}}\n"
