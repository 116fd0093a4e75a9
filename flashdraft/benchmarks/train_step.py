"""`flashdraft bench train-step`: how fast flashdraft's own training step runs on this machine.

    flashdraft bench train-step --config examples/qwen3.5-27b.yaml            # the config's target and drafter
    flashdraft bench train-step                                               # the bundled default (a CPU)
    flashdraft bench train-step --config C.yaml --seq 8192 --steps 5 train.compile=false --json out.json

It builds the target and the drafter as `flashdraft train` does and runs `loop.train_step` — the function the
trainer runs — on synthetic sequences of `data.max_length` random tokens, all of them response tokens (so each gets
`recipe.num_anchors` blocks, the recipe's steady state), read through the trainer's data loader. It reports
steady-state seconds per step, sequence tokens/s, MFU of the trainer's cost model (`telemetry.flops.step_flops`;
the FLOP count is printed) against the GPU's peak, peak GPU memory, and a breakdown by phase from the marks
`train_step` sets (`telemetry.timer.Timer`: CUDA events on a GPU): target forward, drafter forward, loss (LM head
forward and its input gradient), drafter backward, optimizer. `bench/train_step.py` runs the same function beside a
naive trainer on a random Qwen3.5-27B-shaped target.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from flashdraft.devices import resolve_device, resolve_dtype
from flashdraft.target import load_frozen_target
from flashdraft.telemetry.flops import device_peak, step_flops
from flashdraft.telemetry.timer import Timer
from flashdraft.train import loop
from flashdraft.train.compile import compile_drafter, compile_enabled
from flashdraft.train.dataloader import DataLoader
from flashdraft.train.masks import attention_kind
from flashdraft.train.optim import build_optimizer
from flashdraft.train.setup import Setup, build_drafter, captured_layer_ids, needs_target_distribution, tokenizer_path

PHASES = ("target", "drafter_fwd", "loss", "drafter_bwd", "optimizer")


class SyntheticSequences:
    """`count` sequences of `length` random token ids (seeded per index), every position a response token.

    Duck-types the `TokenizedDataset` reads of the data loader: `len`, `[i]` → (ids, loss_mask), `epoch_order`.
    """

    def __init__(self, count: int, length: int, vocab_size: int, seed: int = 0) -> None:
        self.count, self.length, self.vocab_size, self.seed = count, length, vocab_size, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        ids = np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.length, dtype=np.int64)
        return ids, np.ones(self.length, dtype=np.uint8)

    def epoch_order(self, epoch: int, seed: int, *args, **kwargs) -> list[int]:
        return list(range(self.count))


def measure(step, device: torch.device, warmup: int, steps: int) -> dict:
    """Run `step(mark)` warmup + steps times; medians of the timed steps, peak memory of the timed steps only. The
    warm-up steps' walls are kept too: in a new process the first one is what compiling and autotuning cost, and
    its phases say where (the GPU waits for the host's compiles, so its events span them)."""
    timer = Timer(device)
    walls, phases, warmup_walls, warmup_phases = [], [], [], []
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timer.lap()  # the step's lap starts here
        step(timer.mark)
        wall, ms = timer.lap(), timer.lap_marks
        if i >= warmup:
            walls.append(wall)
            phases.append(ms)
        else:
            warmup_walls.append(wall)
            warmup_phases.append(ms)
    return {
        "step_s": statistics.median(walls),
        "steps_s": walls,
        "warmup_steps_s": warmup_walls,
        "phases_ms": {p: statistics.median(m.get(p, 0.0) for m in phases) for p in PHASES},
        "first_step_phases_ms": {p: warmup_phases[0].get(p, 0.0) for p in PHASES} if warmup_phases else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def bench_setup(cfg, target, *, tokenizer=None, steps: int = 8):
    """A training `Setup` around a loaded `FrozenTarget`: the drafter as the trainer builds it (on the target's
    device, layers compiled per `train.compile`) and `steps` steps of synthetic data of `data.max_length` tokens."""
    device = target.device
    target.configure(cfg.target)
    with torch.device(device):  # initialised in place: no CPU copy of a multi-GB drafter
        drafter = build_drafter(cfg, target, tokenizer)
    compile_drafter(drafter, cfg.train, device)
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    data = SyntheticSequences(steps * per_step, cfg.data.max_length, target.lm_head_weight.shape[0], cfg.train.seed)
    peak = device_peak(device, cfg.train.peak_tflops)
    batches = DataLoader.from_config(cfg, data, drafter, device)
    return Setup(device, tokenizer, target, drafter, batches, steps, peak=peak)


def run_train_step(s, cfg, *, warmup: int = 2, steps: int = 4) -> dict:
    """Time `loop.train_step` on `s` (from `bench_setup`, with >= warmup + steps steps of data)."""
    optimizer = build_optimizer(s.drafter.parameters(), cfg.optim, s.device)
    counts = {}

    def step(mark):
        i = counts.setdefault("step", 0)
        batch = s.batches.batch(i % s.total_steps)  # inside the timed step, as the trainer reads each step
        stats, tokens, finite = loop.train_step(s, cfg, optimizer, batch, mark=mark)
        counts.update(step=i + 1, tokens=tokens, labelled=int(stats.valid.sum()), finite=finite)

    result = measure(step, s.device, warmup, steps)
    flops = step_flops(s, counts["tokens"], counts["labelled"])
    peak = s.peak.flops if s.peak else None
    result.update(
        variant="flashdraft",
        attention=attention_kind(cfg.train.attention, s.device),
        compiled=compile_enabled(cfg.train.compile, s.device),
        seq_tokens=counts["tokens"],
        labelled=counts["labelled"],
        flops=flops,
        tok_s=counts["tokens"] / result["step_s"],
        mfu=flops / result["step_s"] / peak if peak else None,
        peak_tflops=peak / 1e12 if peak else None,
        finite=counts["finite"],
    )
    return result


def machine() -> dict:
    import platform

    import transformers

    info = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def table(rows: list[dict]) -> str:
    """One line per result: variant, seq, s/step, tok/s, MFU, peak, seconds from the loaded target to the end of the
    first step and of torch.compile inside them (where the row has them), then the phase breakdown in ms."""
    head = f"{'variant':22s} {'seq':>6s} {'s/step':>7s} {'tok/s':>8s} {'MFU':>6s} {'peak GiB':>8s} {'1st step':>8s} "
    head += f"{'compile':>8s}  "
    lines = [head + "  ".join(f"{p:>11s}" for p in PHASES)]
    for r in rows:
        mfu = f"{r['mfu'] * 100:5.1f}%" if r.get("mfu") is not None else "    -"
        peak = f"{r['peak_gib']:8.1f}" if r.get("peak_gib") is not None else "       -"
        first = f"{r['first_step_after_s']:7.1f}s" if r.get("first_step_after_s") is not None else "       -"
        compiled = r.get("compile_s", {}).get("total_wall_time")
        compiled = f"{compiled:7.1f}s" if compiled is not None else "       -"
        lines.append(
            f"{r['variant']:22s} {r['seq']:6d} {r['step_s']:7.3f} {r['tok_s']:8.0f} {mfu:>6s} {peak} {first} "
            + f"{compiled}  "
            + "  ".join(f"{r['phases_ms'][p]:11.1f}" for p in PHASES)
        )
    return "\n".join(lines)


def load_bench_target(cfg):
    """The config's frozen target and tokenizer, as `train.setup.load_inputs` loads them."""
    device = resolve_device(cfg.train.device, field="train.device")
    dtype = resolve_dtype(cfg.target.dtype, device)
    torch.manual_seed(cfg.train.seed)
    target = load_frozen_target(
        cfg.target,
        layer_ids=captured_layer_ids(cfg),
        device=device,
        dtype=dtype,
        num_features=cfg.drafter.num_layers,
        final_hidden=needs_target_distribution(cfg),
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(cfg), trust_remote_code=cfg.target.trust_remote_code)
    return target, tokenizer
