"""What one `causal_conv1d_update` call costs, and the floor of the method that times it.

CUDA events around a single call include the host's launch path (Python, the driver); an empty Triton kernel timed
the same way is the floor any Triton (or CUDA-extension) implementation pays. Inside a captured CUDA graph (how the
decode engine runs a step) only the GPU time remains: the update is timed replayed from a graph too.
Run on a GPU, from the repository root: python -m bench.update_floor [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from bench.timing import events_ms
from flashdraft.kernels import causal_conv1d_update


@triton.jit
def _empty_kernel(x):
    pass


def _events_us(fn, iters=200, warmup=20):
    return events_ms(fn, iters, warmup) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.update_floor needs a CUDA device")
    B, D, W = 64, 10240, 4
    x = torch.randn(B, D, 1, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(D, W, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(B, D, W, device="cuda", dtype=torch.bfloat16)
    dummy = torch.empty(1, device="cuda")
    rows = {
        "empty_triton_kernel_events_us": _events_us(lambda: _empty_kernel[(1,)](dummy)),
        "empty_torch_op_events_us": _events_us(lambda: dummy.add_(0)),
        "update_events_us": _events_us(lambda: causal_conv1d_update(x, state, w, None, "silu")),
    }
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            causal_conv1d_update(x, state, w, None, "silu")
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(100):
            causal_conv1d_update(x, state, w, None, "silu")
    rows["update_in_cuda_graph_us_per_call"] = _events_us(graph.replay, iters=50, warmup=5) / 100
    for k, v in rows.items():
        print(f"{k:36s} {v:8.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
