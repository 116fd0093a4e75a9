"""Hardware counters (Nsight Compute) of the channel-last conv forward at the shapes bench.kernels_conv times, each
flashdraft row-walk config beside Dao's CUDA kernel (when importable) and an elementwise kernel over the same bytes:
why one kernel moves its bytes faster than another (DRAM bytes, DRAM throughput, occupancy, waves, stalls).

  python -m bench.conv_ncu --out DIR [--configs autotuned,64/16/4/1,...]     (from the repository root)

runs itself under `ncu --clock-control none` (the GPU's clocks left as they are, as in every other benchmark here),
profiling only the measured calls (compilation and autotuning run outside the profiler's window), and prints a
table. It writes DIR/conv_ncu.json (every metric of every kernel); the report and its CSV pages go to --work (a
temporary folder unless given). A config is BLOCK_D/SUB_L/N_SUB/warps; "autotuned" is the shipped autotuner's
choice. --activation none times the kernel without SiLU (what the activation costs). The reference for bytes per
second is an elementwise torch kernel over the same bytes (y = -x; a plain copy_ is a cudaMemcpy, no kernel,
invisible to ncu). Each kernel is replayed with caches flushed before every pass, as do_bench flushes L2 before
every call.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from bench.kernels_conv import FWD_SHAPES, D, W

SECTIONS = [
    "SpeedOfLight",
    "ComputeWorkloadAnalysis",
    "InstructionStats",
    "Occupancy",
    "LaunchStats",
    "MemoryWorkloadAnalysis",
    "WarpStateStats",
]
# Raw counters beside the sections: the bytes each kernel really moved to and from DRAM.
METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum"]
DEFAULT_CONFIGS = "autotuned,64/16/8/1,64/16/4/1,128/16/4/1,256/16/8/2"

# Table columns: (heading, section metric name or raw counter, scale).
COLUMNS = [
    ("DRAM rd MB", "dram__bytes_read.sum", 1e-6),
    ("DRAM wr MB", "dram__bytes_write.sum", 1e-6),
    ("DRAM %", "DRAM Throughput", 1),
    ("L2 hit %", "L2 Hit Rate", 1),
    ("occ %", "Achieved Occupancy", 1),
    ("occ max %", "Theoretical Occupancy", 1),
    ("regs", "Registers Per Thread", 1),
    ("block", "Block Size", 1),
    ("waves", "Waves Per SM", 1),
    ("cyc/issue", "Warp Cycles Per Issued Instruction", 1),
    ("SM %", "Compute (SM) Throughput", 1),
    ("issue %", "Issue Slots Busy", 1),
    ("Minst", "Executed Instructions", 1e-6),
]


def _parse_config(spec: str):
    import triton

    try:
        block_d, sub_l, n_sub, warps = (int(p) for p in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--configs: {spec!r} is not BLOCK_D/SUB_L/N_SUB/warps") from None
    return triton.Config({"BLOCK_D": block_d, "SUB_L": sub_l, "N_SUB": n_sub}, num_warps=warps, num_stages=1)


def workload(configs: list[str], manifest_path: str, activation: str | None = "silu") -> None:
    """The profiled program: per shape, y = -x (the reference), each flashdraft config and Dao, each called once
    inside the profiler's window (after a warm-up call outside it). Writes the launches, in order, to manifest_path."""
    from flashdraft.kernels import causal_conv1d_fn
    from flashdraft.kernels.causal_conv1d import forward

    try:
        from causal_conv1d import causal_conv1d_fn as dao_fn
    except ImportError:
        dao_fn = None
    tuner = forward.autotuned_kernel("rows", 2)
    shipped = list(tuner.configs)
    torch.manual_seed(0)
    w = (torch.randn(D, W, device="cuda") * 0.5).bfloat16()
    manifest = []

    def measure(label, fn, expect, shape, nbytes):
        fn()  # compile, autotune: outside the window
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        manifest.append({"label": label, "shape": shape, "bytes": nbytes, "expect": expect})

    for batch, seqlen in FWD_SHAPES:
        x = torch.randn(batch, seqlen, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        y = torch.empty_like(x)
        shape, nbytes = f"({batch}, {seqlen})", 2 * x.numel() * x.element_size()
        measure("torch y = -x", lambda x=x, y=y: torch.neg(x, out=y), "elementwise", shape, nbytes)
        for spec in configs:
            tuner.configs, tuner.cache = (shipped if spec == "autotuned" else [_parse_config(spec)]), {}
            measure(
                f"flashdraft {spec}",
                lambda x=x: causal_conv1d_fn(x, w, None, activation=activation),
                "causal_conv1d_fwd_kernel",
                shape,
                nbytes,
            )
            if spec == "autotuned":
                best = tuner.best_config
                manifest[-1]["label"] += " = " + "/".join(str(v) for v in (*best.kwargs.values(), best.num_warps))
        if dao_fn is not None:
            measure("dao", lambda x=x: dao_fn(x, w, None, activation=activation), "channellast_fwd", shape, nbytes)
        del x, y
    tuner.configs, tuner.cache = shipped, {}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _csv_records(path: str) -> list[dict]:
    """The records of an ncu CSV page, whatever notes ncu printed before its header."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        raise SystemExit(f'{path}: no ncu CSV header (a line starting with "ID") in its {len(lines)} lines')
    return list(csv.DictReader(lines[header:]))


def _stalls(raw_csv_path: str) -> dict[str, dict[str, float]]:
    """Per kernel ID, the warp stall reasons (cycles per issued instruction) from ncu's raw page."""
    prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    out = {}
    for rec in _csv_records(raw_csv_path):
        if _number(rec.get("ID", "")) is None:  # the units row
            continue
        out[rec["ID"]] = {
            name[len(prefix) : -len(suffix)]: v
            for name, text in rec.items()
            if name.startswith(prefix) and name.endswith(suffix) and (v := _number(text)) is not None
        }
    return out


def read_report(csv_path: str, raw_csv_path: str, manifest: list[dict]) -> list[dict]:
    """One row per profiled kernel, in launch order, its metrics by name, paired with the manifest's launches."""
    kernels: dict[str, dict] = {}
    for rec in _csv_records(csv_path):
        k = kernels.setdefault(rec["ID"], {"kernel": rec["Kernel Name"], "metrics": {}})
        value = _number(rec["Metric Value"])
        if value is not None:
            k["metrics"][rec["Metric Name"]] = value
    stalls = _stalls(raw_csv_path)
    rows, pending = [], list(manifest)
    for kid in sorted(kernels, key=int):
        k = kernels[kid]
        # The first pending launch this kernel can be; launches before it left no kernel in the report.
        at = next((i for i, launch in enumerate(pending) if launch["expect"] in k["kernel"]), None)
        launch = None
        if at is not None:
            for missed in pending[:at]:
                rows.append({**missed, "label": missed["label"] + " (not found in the report)"})
            launch, pending = pending[at], pending[at + 1 :]
        row = {"label": launch["label"] if launch else f"unexpected: {k['kernel'][:60]}", **(launch or {})}
        m = k["metrics"]
        duration_ns = m.get("gpu__time_duration.sum") or m.get("Duration")
        row["us"] = duration_ns / 1e3 if duration_ns else None
        if launch and duration_ns:
            row["GBps"] = launch["bytes"] / duration_ns
        for heading, name, scale in COLUMNS:
            row[heading] = m[name] * scale if name in m else None
        row["metrics"] = m
        top = sorted(stalls.get(kid, {}).items(), key=lambda kv: -kv[1])[:3]
        row["stalls"] = ", ".join(f"{name} {v:.1f}" for name, v in top)
        rows.append(row)
    for launch in pending:
        rows.append({**launch, "label": launch["label"] + " (not found in the report)"})
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'shape':11s} {'kernel':34s} {'us':>7s} {'GB/s':>6s} " + " ".join(f"{h:>10s}" for h, _, _ in COLUMNS)
    print(head + "  top stalls (cycles per issued instruction)")
    for r in rows:
        cells = [f"{r[h]:10.1f}" if r.get(h) is not None else f"{'-':>10s}" for h, _, _ in COLUMNS]
        us = f"{r['us']:7.1f}" if r.get("us") else f"{'-':>7s}"
        gbps = f"{r['GBps']:6.0f}" if r.get("GBps") else f"{'-':>6s}"
        print(
            f"{r.get('shape', ''):11s} {r['label'][:34]:34s} {us} {gbps} "
            + " ".join(cells)
            + f"  {r.get('stalls', '')}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for conv_ncu.json")
    ap.add_argument(
        "--work", help="folder for the report, its CSV pages and the launch manifest (default: a temporary one)"
    )
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated flashdraft configs (see above)")
    ap.add_argument("--activation", choices=["silu", "none"], default="silu")
    ap.add_argument("--workload", metavar="MANIFEST", help=argparse.SUPPRESS)
    args = ap.parse_args()
    configs = args.configs.split(",")
    if args.workload:
        return workload(configs, args.workload, None if args.activation == "none" else args.activation)
    ncu = shutil.which("ncu")
    if ncu is None or not torch.cuda.is_available():
        sys.exit("bench.conv_ncu needs a CUDA device and Nsight Compute's `ncu` on PATH")
    os.makedirs(args.out, exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix="conv_ncu_")
    os.makedirs(work, exist_ok=True)
    rep, manifest_path = os.path.join(work, "conv"), os.path.join(work, "manifest.json")
    profile = [ncu, "--clock-control", "none", "--profile-from-start", "off", "-f", "-o", rep]
    profile += [a for s in SECTIONS for a in ("--section", s)]
    me = [sys.executable, "-m", "bench.conv_ncu", "--out", args.out, "--configs", args.configs]
    me += ["--activation", args.activation]
    me += ["--workload", manifest_path]
    done = subprocess.run(profile + ["--metrics", ",".join(METRICS)] + me)
    if done.returncode != 0:  # an unknown counter on this GPU or ncu: the sections alone
        print(f"ncu with --metrics exited {done.returncode}; again with the sections only", flush=True)
        done = subprocess.run(profile + me)
        if done.returncode != 0:
            sys.exit(f"ncu exited {done.returncode}")
    pages = {}
    for page in ("details", "raw"):
        pages[page] = os.path.join(work, f"conv_{page}.csv")
        with open(pages[page], "w") as f:
            subprocess.run(
                [ncu, "-i", rep + ".ncu-rep", "--csv", "--page", page, "--print-units", "base"], stdout=f, check=True
            )
    with open(manifest_path) as f:
        rows = read_report(pages["details"], pages["raw"], json.load(f))
    print_table(rows)
    print(f"report and CSV pages: {work}")
    with open(os.path.join(args.out, "conv_ncu.json"), "w") as f:
        json.dump(
            {"gpu": torch.cuda.get_device_name(), "activation": args.activation, "configs": configs, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
