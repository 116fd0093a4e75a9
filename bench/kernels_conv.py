"""causal_conv1d on a GPU: flashdraft's Triton kernels beside transformers' torch fallback, fla's Triton conv and
Dao-AILab's CUDA causal-conv1d (when importable), all measured in one process on the same inputs.

  forward   bf16, D=10240, W=4, silu, x channel-last (B, L) in (1, 8192), (4, 4096), (8, 8192)
            GB/s = (x read + y written) / median time; flashdraft and Dao also with x channel-first.
            --repeat N times each case N rounds, the providers interleaved within a round (drift during a run hits
            all of them alike): the median of the rounds, and their range; "host" is each provider's host time
            per call (launch path), flagged HOST-BOUND when it nears the kernel's
  backward  same shapes, bias None: GB/s = (x read + dy read + dx written) / median time of the backward alone
            (dweight included in the time)
  update    B=64, D=10240, W=4, one token, bf16: us per call, CUDA events around one call (host overhead included,
            as a decode step sees it) and triton.testing.do_bench (back-to-back calls)

  --sweep   instead: the forward's row-walk kernel at the channel-last shapes once per autotune config, each
            config fixed, in --repeat interleaved rounds; every round's GB/s is kept (does the autotuner pick the
            best config, and is the spread between rounds the kernel's?)
  --sweep-backward  the same for the backward's row-walk configs (whole backward timed, as in "backward" above)

Every row carries its relative error (norm) against a float32 torch computation on the same inputs; a speed-up is
reported only when both sides are correct (relerr <= 1e-2).
Run on a GPU, from the repository root: python -m bench.kernels_conv [--json OUT.json] [--quick] [--repeat N]
bench.kernels calls run_all() / print_table() as part of its run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.anchors import torch_conv_fn, torch_conv_update

DEVICE = "cuda"
D, W = 10240, 4
FWD_SHAPES = [(1, 8192), (4, 4096), (8, 8192)]
UPDATE_BATCH = 64
RELERR_OK = 1e-2


def _providers() -> dict:
    """name -> (fn(x, w, activation) -> y, update(x, state, w, activation) -> y) or a note why it is missing."""
    from flashdraft.kernels import causal_conv1d_fn, causal_conv1d_update

    out = {
        "flashdraft": (
            lambda x, w, act: causal_conv1d_fn(x, w, None, activation=act),
            lambda x, st, w, act: causal_conv1d_update(x, st, w, None, act),
        ),
        "torch": (
            lambda x, w, act: torch_conv_fn(x, w, None, act),
            lambda x, st, w, act: torch_conv_update(x, st, w, None, act),
        ),
    }
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_fn
        from fla.modules.causal_conv1d import causal_conv1d_update as fla_update

        out["fla"] = (
            lambda x, w, act: fla_fn(x.transpose(1, 2), w, None, activation=act)[0].transpose(1, 2),
            lambda x, st, w, act: fla_update(x.transpose(1, 2), st, weight=w, activation=act)[0].transpose(1, 2),
        )
    except Exception as exc:  # noqa: BLE001 - a missing anchor is reported, not fatal
        out["fla"] = f"not importable: {type(exc).__name__}: {str(exc)[:120]}"
    try:
        from causal_conv1d import causal_conv1d_fn as dao_fn
        from causal_conv1d import causal_conv1d_update as dao_update

        out["dao"] = (
            lambda x, w, act: dao_fn(x, w, None, activation=act),
            lambda x, st, w, act: dao_update(x, st, w, None, act),
        )
    except Exception as exc:  # noqa: BLE001
        out["dao"] = f"not importable: {type(exc).__name__}: {str(exc)[:120]}"
    return out


def _relerr(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _median_ms(fn) -> float:
    from triton.testing import do_bench

    fn()  # compile and autotune outside the measurement
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _host_us(fn, calls: int = 20) -> float:
    """Microseconds of host time per call, enqueueing `calls` back to back on an idle stream (fewer than the launch
    queue holds, so the host never waits for the GPU). When it nears the kernel's time, do_bench's figure (events
    around each call, after an L2 flush) includes the host's launch path: the GPU waits for it."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _event_us(fn, iters: int = 200, warmup: int = 20) -> float:
    """Median of CUDA events around a single call, synchronising between calls (microseconds)."""
    from bench.timing import events_ms

    return events_ms(fn, iters, warmup) * 1e3


def _tuned_configs() -> dict:
    """The configs flashdraft's autotuner picked, per (kernel, element size) and key."""
    from flashdraft.kernels.causal_conv1d import backward, forward

    out = {}
    for name, mod in (("fwd", forward), ("bwd", backward)):
        for (kind, size), tuner in mod.autotuned_kernel.built.items():
            for key, cfg in tuner.cache.items():
                out[f"{name}-{kind}-{size}B-{key[:3]}"] = f"{cfg.kwargs} warps={cfg.num_warps}"
    return out


def _add_speedups(rows: list[dict], key: str) -> None:
    """Each flashdraft row's speed-up over each correct anchor of the same case, only if that row is correct."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault(r["case"], []).append(r)
    for group in cases.values():
        ours = [r for r in group if r["provider"].startswith("flashdraft") and r.get("ok")]
        for mine in ours:
            for r in group:
                if not r["provider"].startswith("flashdraft") and r.get("ok"):
                    mine.setdefault("speedup_vs", {})[r["provider"]] = round(r[key] / mine[key], 3)


def bench_forward(shapes=FWD_SHAPES, repeat: int = 1) -> list[dict]:
    providers = _providers()
    rows = []
    torch.manual_seed(0)
    w = (torch.randn(D, W, device=DEVICE) * 0.5).bfloat16()
    for batch, seqlen in shapes:
        base = torch.randn(batch, seqlen, D, device=DEVICE, dtype=torch.bfloat16)
        for layout in ("channel_last", "channel_first"):
            x = base.transpose(1, 2) if layout == "channel_last" else base.transpose(1, 2).contiguous()
            ref = torch_conv_fn(x.float(), w.float(), None, "silu")
            nbytes = 2 * x.numel() * x.element_size()
            case = f"B={batch} L={seqlen} {layout}"
            case_rows, timed = [], []  # every provider's row; (row, fn) of those that run here
            for name, prov in providers.items():
                if layout == "channel_first" and name not in ("flashdraft", "dao"):
                    continue
                row = {"case": case, "provider": name, "B": batch, "L": seqlen, "layout": layout}
                case_rows.append(row)
                if isinstance(prov, str):
                    row["note"] = prov
                    continue
                fn = lambda f=prov[0], x=x: f(x, w, "silu")  # noqa: E731
                try:
                    row["relerr"] = _relerr(fn(), ref)
                    row["ok"] = row["relerr"] <= RELERR_OK
                    timed.append((row, fn))
                except Exception as exc:  # noqa: BLE001
                    row["note"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            samples = {id(row): [] for row, _ in timed}
            for _ in range(repeat):
                for row, fn in timed:
                    try:
                        samples[id(row)].append(_median_ms(fn))
                    except Exception as exc:  # noqa: BLE001
                        row["note"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            for row, fn in timed:
                ms = sorted(samples[id(row)])
                if ms and "note" not in row:
                    row["ms"] = ms[len(ms) // 2]
                    row["host_us"] = _host_us(fn)
                    row["GBps"] = nbytes / row["ms"] / 1e6
                    row["GBps_rounds"] = [nbytes / t / 1e6 for t in samples[id(row)]]
                    if repeat > 1:
                        row["GBps_range"] = [nbytes / ms[-1] / 1e6, nbytes / ms[0] / 1e6]
            for row in case_rows:
                print(_fmt(row), flush=True)
            rows += case_rows
            del ref
        del base
    _add_speedups(rows, "ms")
    return rows


def bench_backward(shapes=FWD_SHAPES) -> list[dict]:
    providers = _providers()
    rows = []
    torch.manual_seed(1)
    w0 = (torch.randn(D, W, device=DEVICE) * 0.5).bfloat16()
    for batch, seqlen in shapes:
        x0 = torch.randn(batch, seqlen, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
        dy = torch.randn(batch, seqlen, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
        xf = x0.detach().float().requires_grad_()
        wf = w0.detach().float().requires_grad_()
        dx_ref, dw_ref = torch.autograd.grad(torch_conv_fn(xf, wf, None, "silu"), (xf, wf), dy.float())
        del xf, wf
        nbytes = 3 * x0.numel() * x0.element_size()
        case = f"B={batch} L={seqlen} channel_last"
        for name, prov in providers.items():
            row = {"case": case, "provider": name, "B": batch, "L": seqlen, "layout": "channel_last"}
            if isinstance(prov, str):
                rows.append({**row, "note": prov})
                continue
            try:
                x = x0.detach().clone().requires_grad_()
                w = w0.detach().clone().requires_grad_()
                y = prov[0](x, w, "silu")
                dx, dw = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
                row["relerr"] = _relerr(dx, dx_ref)
                row["relerr_dweight"] = _relerr(dw, dw_ref)
                row["ok"] = max(row["relerr"], row["relerr_dweight"]) <= RELERR_OK
                row["ms"] = _median_ms(
                    lambda y=y, x=x, w=w, dy=dy: torch.autograd.grad(y, (x, w), dy, retain_graph=True)
                )
                row["GBps"] = nbytes / row["ms"] / 1e6
                del y, x, w, dx, dw
            except Exception as exc:  # noqa: BLE001
                row["note"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            print(_fmt(row), flush=True)
        del x0, dy, dx_ref, dw_ref
    _add_speedups(rows, "ms")
    return rows


def bench_update(batch: int = UPDATE_BATCH) -> list[dict]:
    providers = _providers()
    rows = []
    torch.manual_seed(2)
    w = (torch.randn(D, W, device=DEVICE) * 0.5).bfloat16()
    x = torch.randn(batch, D, 1, device=DEVICE, dtype=torch.bfloat16)
    state0 = torch.randn(batch, D, W, device=DEVICE, dtype=torch.bfloat16)
    state_ref = state0.float()
    y_ref = torch_conv_update(x.float(), state_ref, w.float(), None, "silu")
    case = f"B={batch} D={D} 1 token"
    for name, prov in providers.items():
        row = {"case": case, "provider": name, "B": batch}
        if isinstance(prov, str):
            rows.append({**row, "note": prov})
            continue
        try:
            state = state0.clone()
            y = prov[1](x, state, w, "silu")
            row["relerr"] = _relerr(y, y_ref)
            row["state_exact"] = bool(torch.equal(state.float(), state_ref))
            row["ok"] = row["relerr"] <= RELERR_OK and row["state_exact"]
            fn = lambda f=prov[1], state=state: f(x, state, w, "silu")  # noqa: E731
            row["us_event"] = _event_us(fn)
            row["us_bench"] = _median_ms(fn) * 1e3
        except Exception as exc:  # noqa: BLE001
            row["note"] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(_fmt(row), flush=True)
    _add_speedups(rows, "us_event")
    return rows


def _time_each_config(tuner, case: str, fn, relerr, nbytes: int, repeat: int) -> list[dict]:
    """fn() timed with the autotuner given one of its configs at a time, in `repeat` interleaved rounds; relerr()
    checks the result of the config just run. The caller puts the tuner's configs back."""
    configs = list(tuner.configs)
    rows = [{"case": case, "config": f"{c.kwargs} warps={c.num_warps}", "samples_GBps": []} for c in configs]
    for _ in range(repeat):
        for row, cfg in zip(rows, configs, strict=True):
            tuner.configs, tuner.cache = [cfg], {}
            row["relerr"] = relerr()
            row["samples_GBps"].append(nbytes / _median_ms(fn) / 1e6)
    for row in rows:
        got = sorted(row["samples_GBps"])
        row["GBps"] = got[len(got) // 2]
        rounds = ", ".join(f"{g:.0f}" for g in row["samples_GBps"])
        print(
            f"{row['case']:28s} {row['config']:55s} {row['GBps']:6.0f} GB/s (rounds {rounds})  "
            f"relerr {row['relerr']:.1e}",
            flush=True,
        )
    return rows


def sweep_forward_configs(shapes=FWD_SHAPES, repeat: int = 3) -> list[dict]:
    """The rows kernel with each of its autotune configs fixed (the tuner given that one config), channel-last x."""
    from flashdraft.kernels import causal_conv1d_fn
    from flashdraft.kernels.causal_conv1d import forward

    tuner = forward.autotuned_kernel("rows", 2)
    shipped = list(tuner.configs)
    torch.manual_seed(0)
    w = (torch.randn(D, W, device=DEVICE) * 0.5).bfloat16()
    rows = []
    try:
        for batch, seqlen in shapes:
            x = torch.randn(batch, seqlen, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
            ref = torch_conv_fn(x.float(), w.float(), None, "silu")
            fn = lambda x=x: causal_conv1d_fn(x, w, None, activation="silu")  # noqa: E731
            relerr = lambda fn=fn, ref=ref: _relerr(fn(), ref)  # noqa: E731
            case = f"B={batch} L={seqlen} channel_last"
            rows += _time_each_config(tuner, case, fn, relerr, 2 * x.numel() * x.element_size(), repeat)
            del x, ref
    finally:
        tuner.configs, tuner.cache = shipped, {}
    return rows


def sweep_backward_configs(shapes=FWD_SHAPES, repeat: int = 3) -> list[dict]:
    """The backward rows kernel with each of its autotune configs fixed, timed as bench_backward times it."""
    from flashdraft.kernels import causal_conv1d_fn
    from flashdraft.kernels.causal_conv1d import backward

    tuner = backward.autotuned_kernel("rows", 2)
    shipped = list(tuner.configs)
    torch.manual_seed(1)
    w = (torch.randn(D, W, device=DEVICE) * 0.5).bfloat16().requires_grad_()
    rows = []
    try:
        for batch, seqlen in shapes:
            x = torch.randn(batch, seqlen, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            dy = torch.randn(batch, seqlen, D, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
            xf = x.detach().float().requires_grad_()
            dx_ref = torch.autograd.grad(torch_conv_fn(xf, w.detach().float(), None, "silu"), xf, dy.float())[0]
            y = causal_conv1d_fn(x, w, None, activation="silu")
            fn = lambda y=y, x=x, dy=dy: torch.autograd.grad(y, (x, w), dy, retain_graph=True)  # noqa: E731
            relerr = lambda fn=fn, ref=dx_ref: _relerr(fn()[0], ref)  # noqa: E731
            case = f"B={batch} L={seqlen} backward"
            rows += _time_each_config(tuner, case, fn, relerr, 3 * x.numel() * x.element_size(), repeat)
            del x, dy, xf, dx_ref, y
    finally:
        tuner.configs, tuner.cache = shipped, {}
    return rows


def _fmt(r: dict) -> str:
    head = f"{r['case']:32s} {r['provider']:15s}"
    if "note" in r:
        return f"{head} -- {r['note']}"
    if "us_event" in r:
        body = f"{r['us_event']:8.1f} us/call (events) {r['us_bench']:8.1f} us (do_bench)"
    else:
        body = f"{r['ms']:8.3f} ms {r['GBps']:7.0f} GB/s"
        if "GBps_range" in r:
            body += f" ({r['GBps_range'][0]:.0f}-{r['GBps_range'][1]:.0f})"
        if "host_us" in r:
            # A host slower than ~0.7x the kernel shows in do_bench's time (flashdraft and fla launch from Python).
            body += f"  host {r['host_us']:.0f} us" + (" HOST-BOUND" if r["host_us"] > 0.7 * r["ms"] * 1e3 else "")
    err = f"relerr {r['relerr']:.1e}" + (f"/{r['relerr_dweight']:.1e}" if "relerr_dweight" in r else "")
    ok = "" if r.get("ok") else "  WRONG"
    speed = "".join(f"  {v:.2f}x {k}" for k, v in r.get("speedup_vs", {}).items())
    return f"{head} {body}  {err}{ok}{speed}"


def run_all(quick: bool = False, repeat: int = 1) -> dict:
    shapes = FWD_SHAPES[:1] if quick else FWD_SHAPES
    print(f"=== causal_conv1d forward (bf16, D=10240, W=4, silu; {repeat} interleaved round(s)) ===", flush=True)
    result = {"forward": bench_forward(shapes, repeat)}
    print("=== causal_conv1d backward (bf16, channel-last) ===", flush=True)
    result["backward"] = bench_backward(shapes)
    print("=== causal_conv1d_update (B=64, one token) ===", flush=True)
    result["update"] = bench_update()
    result["flashdraft_configs"] = _tuned_configs()
    return result


def print_table(result: dict) -> None:
    for section in ("forward", "backward", "update"):
        print(f"--- conv {section} ---")
        for r in result.get(section, []):
            print(_fmt(r))
    for k, v in result.get("flashdraft_configs", {}).items():
        print(f"config {k}: {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="only the first forward/backward shape")
    ap.add_argument("--repeat", type=int, default=1, help="forward: interleaved rounds per case (median, range)")
    ap.add_argument("--sweep", action="store_true", help="the forward row kernel once per config (see above)")
    ap.add_argument("--sweep-backward", action="store_true", help="the backward row kernel once per config")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.kernels_conv needs a CUDA device")
    if args.sweep or args.sweep_backward:
        shapes = FWD_SHAPES[:1] if args.quick else FWD_SHAPES
        result = {"sweep": sweep_forward_configs(shapes, args.repeat)} if args.sweep else {}
        if args.sweep_backward:
            result["sweep_backward"] = sweep_backward_configs(shapes, args.repeat)
        result["gpu"] = torch.cuda.get_device_name()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        return
    result = run_all(args.quick, args.repeat)
    result["gpu"] = torch.cuda.get_device_name()
    print("\n=== summary ===")
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
