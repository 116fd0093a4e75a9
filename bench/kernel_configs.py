"""Write a GPU's shipped kernel configs (flashdraft/kernels/tuned/<GPU>.json) from a run's autotuning on it.

    TRITON_PRINT_AUTOTUNING=1 flashdraft train ...            # on a freshly started GPU machine: Triton times
    python -m bench.kernel_configs ~/.triton/cache --out DIR   # every config; this keeps each kernel's choice

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
    p.add_argument("dir", type=Path, help="a folder holding Triton's *.autotune.json files (searched recursively)")
    p.add_argument("--gpu", help="the CUDA device name as torch reports it (default: this machine's GPU)")
    p.add_argument("--triton", help="the Triton version that measured them (default: the installed one)")
    p.add_argument("--out", type=Path, default=None, help="a folder for <GPU>.json (default: flashdraft's tuned/)")
    args = p.parse_args(argv)
    files = sorted(f for f in args.dir.rglob("*") if f.is_file() and ".autotune.json" in f.name)
    if not files:
        # Also what a run covered whole by the shipped file leaves: nothing was timed, nothing to add.
        print(f"{args.dir}: no *.autotune.json files (nothing was autotuned, or not cached): nothing written")
        return 0
    if args.gpu is None:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: name the GPU that measured them with --gpu")
        args.gpu = torch.cuda.get_device_name()
    if args.triton is None:
        import triton

        args.triton = triton.__version__
    # What this GPU's shipped file holds stays unless measured again: the run used it and timed only the rest.
    text = tuned.export(files, args.gpu, args.triton, keep=tuned.load(args.gpu))
    out = tuned.gpu_file(args.gpu) if args.out is None else args.out / tuned.gpu_file(args.gpu).name
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    kernels = json.loads(text)["kernels"]
    print(f"{out}: {sum(map(len, kernels.values()))} choices for {len(kernels)} kernels, from {len(files)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
