"""Write a GPU's shipped kernel configs (flashdraft/kernels/tuned/<GPU>.json) from a run's autotuning on it.

    TRITON_PRINT_AUTOTUNING=1 flashdraft train ...            # on a freshly started GPU machine: Triton times
    python -m bench.kernel_configs ~/.triton/cache --out DIR   # every config; this keeps each kernel's choice
    python -m bench.kernel_configs --keep A.json --keep B.json # one GPU's files from several runs, merged

(from the repository root, on the machine that ran it: the GPU's name and Triton's version are read there;
`bench/gpu_run.sh`'s first-step stage does both and leaves the file in its folder). Reads every
`*.autotune.json` under the folder: Triton writes one per kernel and key where a kernel caches its results (fla's
and flashdraft's do). The file is what `flashdraft.kernels.tuned` places in the autotuners of a fresh process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashdraft.io.atomic import atomic_write_text
from flashdraft.kernels import tuned


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_configs", description=__doc__.splitlines()[0])
    p.add_argument(
        "dirs", type=Path, nargs="*", help="folders holding Triton's *.autotune.json files (searched recursively)"
    )
    p.add_argument("--gpu", help="the CUDA device name as torch reports it (default: this machine's GPU)")
    p.add_argument("--triton", help="the Triton version that measured them (default: the installed one)")
    p.add_argument("--out", type=Path, default=None, help="a folder for <GPU>.json (default: flashdraft's tuned/)")
    p.add_argument(
        "--keep",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a <GPU>.json written by another run (repeatable): its choices stay unless measured here; names the GPU",
    )
    args = p.parse_args(argv)
    files = sorted(f for d in args.dirs for f in d.rglob("*") if f.is_file() and ".autotune.json" in f.name)
    if not files and not args.keep:
        # Also what a run covered whole by the shipped file leaves: nothing was timed, nothing to add.
        where = ", ".join(map(str, args.dirs)) or "no folder given"
        print(f"{where}: no *.autotune.json files (nothing was autotuned, or not cached): nothing written")
        return 0
    kept = [read_kept(p, path) for path in args.keep]
    for path, (gpu, triton_version, _) in zip(args.keep, kept, strict=True):
        if args.gpu not in (None, gpu):
            p.error(f"--keep {path}: measured on {gpu!r}, not {args.gpu!r}")
        args.gpu = gpu
        args.triton = args.triton or triton_version
    if args.gpu is None:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: name the GPU that measured them with --gpu")
        args.gpu = torch.cuda.get_device_name()
    if args.triton is None:
        import triton

        args.triton = triton.__version__
    # What this GPU's shipped file holds stays unless measured again: the run used it and timed only the rest.
    # The shipped file's entries, then each --keep file's: `export` keeps the last entry of a kernel and key.
    keep: dict[str, list[dict]] = {}
    for table in (tuned.load(args.gpu), *(kernels for _, _, kernels in kept)):
        for name, entries in table.items():
            keep.setdefault(name, []).extend(entries)
    text = tuned.export(files, args.gpu, args.triton, keep=keep)
    out = tuned.gpu_file(args.gpu) if args.out is None else args.out / tuned.gpu_file(args.gpu).name
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    kernels = json.loads(text)["kernels"]
    print(f"{out}: {sum(map(len, kernels.values()))} choices for {len(kernels)} kernels, from {len(files)} files")
    return 0


def read_kept(parser: argparse.ArgumentParser, path: Path) -> tuple[str, str, dict[str, list[dict]]]:
    """(GPU, Triton version, kernels) of a file this command wrote; a parser error naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
        return data["gpu"], data["triton"], data["kernels"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"--keep {path}: not a kernel-configs file ({type(exc).__name__}: {exc})")


if __name__ == "__main__":
    raise SystemExit(main())
