"""The speculative-decoding engine against transformers eager and the reference `dflash_generate`, one run.

On a Qwen3.5-27B-shaped random bf16 target (64 layers: 48 Gated DeltaNet + 16 gated attention, vocab 248320;
`--layers` for a slice) and a random 5-layer DFlash drafter with the target's sizes, batch 1, at contexts 1024
and 8192, measures:
  anchors   transformers eager decode step and 16-token verification (fast path on: fla + flashdraft conv),
            one round of the reference `dflash.model.dflash_generate` (draft, verify 16, crop)
  engine    flashdraft.speculative.engine with CUDA graphs: decode step, verify 16, draft, commit, and a full round
            (draft + verify + acceptance + exact rollback as one step, then the one host read), as `generate` runs
            it, greedy and sampled; beside it the same greedy round of separate steps (three replays, acceptance
            eager: the anchor)
  checks    engine logits vs transformers' on the same weights (prefill and a decode step); DFlash output vs the
            engine's own autoregressive greedy output (bf16), with the logits at the first difference (near-tie?)
Random drafts are rejected, so a round keeps one token: its cost is that of every round (fixed shapes). The ratio
round / decode step is what speculative decoding must beat: a round that keeps tau tokens on average is a speed-up
over autoregressive decoding when tau > round / decode.

Run (a GPU, from the repository root):  python -m bench.spec_engine [--json OUT.json]    # table last
           CPU check:                   python -m bench.spec_engine --smoke                # tiny hybrid target
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.timing import events_ms

CONTEXTS = (1024, 8192)
SMOKE_CONTEXTS = (24, 80)
BLOCK = 16
ROUNDS = 8  # rounds per timed call of the round measurement
SAMPLED = (1.0, 1.0, 0)  # the sampled round's settings (temperature, top-p, top-k)


def run_header(smoke: bool, layers: int, graphs: bool) -> dict:
    """What every engine benchmark's JSON starts with: when, on what, with which releases, at which shape."""
    import transformers

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "smoke": smoke,
        "target_layers": 8 if smoke else layers,
        "block_size": BLOCK,
        "graphs": graphs,
    }


def timed_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median ms of `fn()` (CUDA events, synchronised per call; perf_counter on a CPU)."""
    if torch.cuda.is_available():
        return events_ms(fn, iters=iters, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


def build(smoke: bool, layers: int, dtype: torch.dtype | None = None, reference: bool = True):
    """(target, our drafter, the reference package's drafter with the same weights or None, device); dtype: default
    float32 for the smoke run, bf16 on the GPU."""
    from flashdraft.drafter import DFlashDraftModel

    if smoke:
        from flashdraft.target.tiny import tiny_config

        cfg = tiny_config("qwen3_5", num_layers=8, vocab_size=256)
        device, dtype, mask = torch.device("cpu"), dtype or torch.float32, 255
    else:
        from bench.target_forward import qwen35_27b_config

        cfg = qwen35_27b_config(layers)
        cfg.rope_parameters["rope_theta"] = 1e7  # the 27B's
        device, dtype, mask = torch.device("cuda"), dtype or torch.bfloat16, 248070
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        # Weights are initialised where they live, in bf16 (transformers' normal init; seconds for 27B on a GPU).
        target = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
        drafter = (
            DFlashDraftModel.from_target(cfg, num_layers=5 if not smoke else 2, block_size=BLOCK, mask_token_id=mask)
            .to(dtype)
            .eval()
        )
    if not reference:
        return target, drafter, None, device
    reference = None
    try:
        import dflash

        with torch.device(device):
            reference = dflash.DFlashDraftModel(drafter.config).to(dtype).eval()
        reference.load_state_dict(drafter.state_dict())
    except ImportError as exc:
        print(f"reference dflash package unavailable ({exc}): its anchor is skipped", flush=True)
    return target, drafter, reference, device


@torch.inference_mode()
def hf_anchor(target, ids: torch.Tensor, iters: int) -> dict:
    """transformers eager: one-token decode step and a 16-token forward, with the cache of `ids`."""
    from flashdraft.speculative import rollback

    cache = rollback.new_cache(target)
    target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    snap = rollback.take_snapshot(cache)
    one, block = ids[:, -1:], ids[:, -BLOCK:]

    def step(x):
        target(input_ids=x, past_key_values=cache, use_cache=True)
        rollback.restore(cache, snap)  # same context every call (restore is ~0.4 ms per 16 layers, counted)

    return {"decode_ms": timed_ms(lambda: step(one), iters), "verify16_ms": timed_ms(lambda: step(block), iters)}


@torch.inference_mode()
def dflash_anchor(reference, target, ids: torch.Tensor, rounds: int) -> dict:
    """Mean time of a round of the reference `dflash_generate` (after its prefill)."""
    import dflash.model as ref

    if not torch.cuda.is_available():
        ref._cuda_time = time.perf_counter  # its timer synchronises CUDA
    ref.dflash_generate(reference, target, ids, 2, None, return_stats=True)  # warm-up
    stats = ref.dflash_generate(reference, target, ids, rounds + 1, None, return_stats=True)
    decode_s = stats.time_per_output_token * stats.num_output_tokens
    return {"round_ms": 1e3 * decode_s / len(stats.acceptance_lengths), "rounds": len(stats.acceptance_lengths)}


@torch.inference_mode()
def engine_numbers(target, drafter, ids: torch.Tensor, graphs: bool, iters: int) -> dict:
    from flashdraft.speculative.engine import rounds as loop
    from flashdraft.speculative.engine import session

    # Room for the timed rounds: greedy, a random drafter's round keeps about one token; sampled, up to a block.
    room = (2 + BLOCK) * (ROUNDS + 4) * (iters + 2) + 4 * BLOCK
    sess = session.session(target, ids.shape[1] + room, BLOCK, list(drafter.target_layer_ids), graphs)
    engine, runner = sess.engine, sess.runner(drafter)
    sampler = sess.runner(drafter, SAMPLED, torch.Generator(ids.device).manual_seed(0))
    # Captured before the prefill, as generation captures them.
    greedy, sampled = sess.one_step_round(runner), sess.one_step_round(sampler)
    logits = engine.prefill(ids[0])
    for drafting in (runner, sampler):
        drafting.prefill(engine.prompt_features)
        drafting.block_ids[0] = int(logits.argmax())
    out = {"slots": engine.slots, "captured": sess.captured, "capture_error": sess.capture_error}

    def round_(ahead: bool):
        engine.verify_ids[:1].copy_(runner.block_ids[:1])
        loop.verify_round(engine, runner, runner.drafts, None, (0.0, 1.0, 0), None, ahead)

    def decode():
        engine.decode_ids.copy_(runner.block_ids[:1])
        engine.decode()
        runner.block_ids[:1].copy_(engine.decode_logits[0].argmax().view(1))

    def rounds():
        # Back to back, as generation runs them: each round enqueues the next draft before its one host read,
        # and its commit (side stream on a GPU) overlaps that draft. The last commit is joined inside the timed
        # interval, so it is counted too (1/ROUNDS of a commit extra).
        runner.draft()
        for i in range(ROUNDS):
            round_(ahead=i + 1 < ROUNDS)
        engine.join()

    def one_step_rounds(rnd=greedy):
        # What generation runs: each round one step (one graph replay) and one read, the next round enqueued
        # before this one is read.
        rnd.start()
        rnd.runner.draft()
        for i in range(ROUNDS):
            rnd.emit(BLOCK - 1, ahead=i + 1 < ROUNDS)

    out["round_ms"] = timed_ms(one_step_rounds, iters) / ROUNDS
    out["round_sampled_ms"] = timed_ms(lambda: one_step_rounds(sampled), iters) / ROUNDS
    out["round_steps_ms"] = timed_ms(rounds, iters) / ROUNDS
    out["draft_ms"] = timed_ms(runner.draft, iters)
    out["verify16_ms"] = timed_ms(engine.verify, iters)
    engine.keep.fill_(1)
    out["commit_ms"] = timed_ms(lambda: (engine.commit(), engine.note_committed(1)), iters)
    out["decode_ms"] = timed_ms(decode, iters)
    return out


@torch.inference_mode()
def kernel_profile(engine, runner) -> dict:
    """GPU time by kernel of one eager decode step, verify 16, draft and commit (a graph replays the same
    kernels; eager keeps the profiler's view per kernel). Caches are put back after each step. On a CPU (the
    smoke run) it profiles torch ops instead."""
    from bench.timing import kernel_breakdown

    cuda = engine.device.type == "cuda"
    saved = engine.length.clone(), runner.context.clone(), runner.pending.clone(), engine.num_tokens
    steps = {
        "decode": engine.steps["decode"].fn,
        "verify16": engine.steps["verify"].fn,
        "draft": runner.step.fn,
        "commit": engine.steps["commit"].fn,
    }
    engine.keep.fill_(1)
    out = {}
    for name, fn in steps.items():
        fn()  # warm (allocator, autotune caches)
        out[name] = kernel_breakdown(fn, cuda)
        engine.length.copy_(saved[0])
        runner.context.copy_(saved[1])
        runner.pending.copy_(saved[2])
        engine.num_tokens = saved[3]
    return out


def print_profile(ctx: int, profile: dict) -> None:
    steps = list(profile)
    print(f"\n#### ctx {ctx}: GPU time by kernel family, eager steps (ms; kernel count in brackets)")
    print("| family | " + " | ".join(steps) + " |")
    print("|---|" + "---|" * len(steps))
    families = sorted(
        {f for p in profile.values() for f in p["families"]},
        key=lambda f: -profile["verify16"]["families"].get(f, {"ms": 0})["ms"],
    )
    for fam in families:
        cells = []
        for st in steps:
            got = profile[st]["families"].get(fam)
            cells.append(f"{got['ms']:.3f} ({got['count']})" if got else "-")
        print(f"| {fam} | " + " | ".join(cells) + " |")
    print(
        "| **sum of kernel times** | "
        + " | ".join(f"{profile[s]['gpu_ms']:.3f} ({profile[s]['kernels']})" for s in steps)
        + " |"
    )
    for st in ("decode", "verify16"):
        print(
            f"top kernels, {st}: "
            + "; ".join(f"{t['name'][:60]} x{t['count']} {t['ms']:.3f}" for t in profile[st]["top"][:8])
        )


@torch.inference_mode()
def near_tie(engine, ids: torch.Tensor, greedy: list[int], spec: list[int], j: int) -> dict:
    """Where DFlash and greedy decoding first disagree (token j >= 1): the target's logits for that token as the
    decode step computed them (what greedy decoding saw) and as a 16-token verification computed them (what
    DFlash saw), on the same prefix. A near-tie: on each path the two tokens are closer than the largest logit
    difference between the paths."""
    start = max(0, j - (BLOCK - 1))  # the block greedy[start : start + 16] predicts greedy[start + 1 ..]
    engine.prefill(ids[0])

    def decode(token):
        engine.decode_ids.fill_(token)
        engine.decode()

    for token in greedy[:start]:
        decode(token)
    engine.verify_ids.copy_(torch.tensor(greedy[start : start + BLOCK], device=ids.device))
    engine.verify()  # the caches do not advance (no commit)
    verified = engine.verify_logits[j - 1 - start].float().clone()
    for token in greedy[start:j]:
        decode(token)
    decoded = engine.decode_logits[0].float().clone()

    def top2(x):
        values, index = x.topk(2)
        return [int(i) for i in index], float(values[0] - values[1])

    (d_top, d_margin), (v_top, v_margin) = top2(decoded), top2(verified)
    diff = float((decoded - verified).abs().max())
    mine, theirs = greedy[j], spec[j]
    # How far apart the two tokens are on each path; both within the paths' difference = a rounding near-tie.
    decode_gap = float(decoded[mine] - decoded[theirs])
    verify_gap = float(verified[theirs] - verified[mine])
    return {
        "position": j,
        "greedy_token": mine,
        "dflash_token": theirs,
        "decode_top2": d_top,
        "decode_margin": d_margin,
        "verify_top2": v_top,
        "verify_margin": v_margin,
        "decode_gap": decode_gap,
        "verify_gap": verify_gap,
        "max_abs_logit_diff": diff,
        "logit_scale": float(decoded.abs().max()),
        "near_tie": max(decode_gap, verify_gap) <= diff,
    }


@torch.inference_mode()
def checks(target, drafter, ids: torch.Tensor, graphs: bool) -> dict:
    """Engine vs transformers logits on the same weights; DFlash vs the engine's own greedy decoding."""
    from flashdraft.speculative import autoregressive_generate, generate
    from flashdraft.speculative.engine import session as loop

    hf = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    sess = loop.session(target, ids.shape[1] + 64, BLOCK, list(drafter.target_layer_ids), graphs)
    mine = sess.engine.prefill(ids[0]).float()
    ref = hf.logits[0, -1].float()
    token = int(ref.argmax())
    step = target(input_ids=torch.tensor([[token]], device=ids.device), past_key_values=hf.past_key_values)
    sess.engine.decode_ids.fill_(token)
    sess.engine.decode()
    # (decode_logits is the engine's static buffer: read it before the engine runs again)
    ref2, mine2 = step.logits[0, -1].float(), sess.engine.decode_logits[0].float().clone()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    n = 48
    spec = generate(target, drafter, ids, n, engine=True)
    auto = autoregressive_generate(target, ids, n, engine=True)
    first_diff = next((i for i, (a, b) in enumerate(zip(spec.tokens, auto.tokens, strict=True)) if a != b), None)
    if first_diff is None and os.environ.get("SPEC_ENGINE_TEST_NEAR_TIE"):  # exercise the diagnosis on a CPU
        first_diff = int(os.environ["SPEC_ENGINE_TEST_NEAR_TIE"])
    tie = None if not first_diff else near_tie(sess.engine, ids, auto.tokens, spec.tokens, first_diff)
    return {
        "first_difference": tie,
        "prefill_logits_rel_err": rel(mine, ref),
        "decode_logits_rel_err": rel(mine2, ref2),
        "same_argmax": bool(mine.argmax() == ref.argmax() and mine2.argmax() == ref2.argmax()),
        "greedy_tokens": n,
        "dflash_equals_engine_greedy": spec.tokens == auto.tokens,
        "first_difference_at": first_diff,
        "backend": spec.backend,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny hybrid target on the CPU, graphs off")
    ap.add_argument("--layers", type=int, default=64, help="target layers (a multiple of 4; 64 = the 27B)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    ap.add_argument(
        "--context",
        type=int,
        action="append",
        default=None,
        help=f"context length to measure (repeatable; default {' and '.join(map(str, CONTEXTS))})",
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--profile", action="store_true", help="GPU time by kernel of each step, per context")
    a = ap.parse_args()
    if a.layers % 4:
        raise SystemExit(f"--layers must be a multiple of 4 (3 linear + 1 full attention), got {a.layers}")
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    contexts = a.context or (SMOKE_CONTEXTS if a.smoke else CONTEXTS)
    iters = a.iters or (3 if a.smoke else 10)
    graphs = not a.smoke
    t0 = time.perf_counter()
    from flashdraft import fastpath

    target, drafter, reference, device = build(a.smoke, a.layers)
    fastpath.enable(target, strict=not a.smoke, run_probe=not a.smoke)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    report = {**run_header(a.smoke, a.layers, graphs), "contexts": {}}
    for ctx in contexts:
        ids = torch.randint(0, vocab, (1, ctx), generator=g).to(device)
        row = {"hf": hf_anchor(target, ids, iters)}
        print(ctx, row, flush=True)
        if reference is not None:
            try:
                row["dflash_reference"] = dflash_anchor(reference, target, ids, rounds=iters)
            except Exception as exc:  # noqa: BLE001 - an anchor that fails on this stack is reported, not fatal
                row["dflash_reference"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(ctx, row["dflash_reference"], flush=True)
        row["engine"] = engine_numbers(target, drafter, ids, graphs, iters)
        print(ctx, row["engine"], flush=True)
        if a.profile:
            from flashdraft.speculative.engine import session as loop

            sess = loop.current_session(target)
            row["profile"] = kernel_profile(sess.engine, sess.runner(drafter))
        report["contexts"][ctx] = row
    report["checks"] = checks(
        target, drafter, torch.randint(0, vocab, (1, contexts[0]), generator=g).to(device), graphs
    )
    report["seconds"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    print_table(report, a.smoke)
    for ctx, row in report["contexts"].items():
        if "profile" in row:
            print_profile(ctx, row["profile"])


def print_table(report: dict, smoke: bool) -> None:
    ctxs = list(report["contexts"])
    scale = "" if smoke or report["target_layers"] == 64 else f" (a {report['target_layers']}-layer slice, not scaled)"
    what = "tiny hybrid target, CPU, graphs off (smoke)" if smoke else f"Qwen3.5-27B-shaped random bf16{scale}"
    print(
        f"\n### spec engine — {what}; batch 1, block {BLOCK}; {report['device']}, torch {report['torch']}, "
        f"transformers {report['transformers']}"
    )
    print("| ms | " + " | ".join(f"ctx {c}" for c in ctxs) + " |")
    print("|---|" + "---|" * len(ctxs))

    def row(label, get, fmt="{:.2f}"):
        cells = []
        for c in ctxs:
            try:
                cells.append(fmt.format(get(report["contexts"][c])))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("-")
        print(f"| {label} | " + " | ".join(cells) + " |")

    row("transformers eager decode step (anchor)", lambda r: r["hf"]["decode_ms"])
    row("transformers eager verify 16 (anchor)", lambda r: r["hf"]["verify16_ms"])
    row("dflash_generate round (anchor)", lambda r: r["dflash_reference"]["round_ms"])
    row("**engine decode step**", lambda r: r["engine"]["decode_ms"])
    row("engine verify 16", lambda r: r["engine"]["verify16_ms"])
    row("engine draft (drafter + LM head on 15 rows)", lambda r: r["engine"]["draft_ms"])
    row("engine commit (exact rollback)", lambda r: r["engine"]["commit_ms"])
    row(
        "engine round of separate steps (anchor: three replays, acceptance eager)",
        lambda r: r["engine"]["round_steps_ms"],
    )
    row("**engine round** (draft + verify + accept + commit as one step, one read)", lambda r: r["engine"]["round_ms"])
    row("round / engine decode step", lambda r: r["engine"]["round_ms"] / r["engine"]["decode_ms"])
    row(
        f"engine round sampled (T={SAMPLED[0]:g}, block verification; draws before the step)",
        lambda r: r["engine"]["round_sampled_ms"],
    )
    row("engine decode speedup vs transformers", lambda r: r["hf"]["decode_ms"] / r["engine"]["decode_ms"], "{:.1f}x")
    row(
        "engine round speedup vs dflash_generate",
        lambda r: r["dflash_reference"]["round_ms"] / r["engine"]["round_ms"],
        "{:.1f}x",
    )
    for ctx in ctxs:
        failed = report["contexts"][ctx].get("dflash_reference", {}).get("error")
        if failed:
            print(f"ctx {ctx}: the dflash_generate anchor failed on this stack: {failed}")
        engine = report["contexts"][ctx]["engine"]
        if not smoke and not engine["captured"]:
            print(f"WARNING ctx {ctx}: CUDA graphs were not captured ({engine['capture_error']}): eager engine timings")
    c = report["checks"]
    print(
        f"checks: engine vs transformers logits rel. err. prefill {c['prefill_logits_rel_err']:.2e}, decode "
        f"{c['decode_logits_rel_err']:.2e}, same argmax {c['same_argmax']}; DFlash ({c['backend']}) == engine "
        f"greedy over {c['greedy_tokens']} tokens: {c['dflash_equals_engine_greedy']} "
        f"(first difference {c['first_difference_at']}); {report['seconds']:.0f} s in all"
    )
    if c.get("first_difference"):
        t = c["first_difference"]
        print(
            f"first difference at token {t['position']}: greedy {t['greedy_token']}, DFlash {t['dflash_token']}; "
            f"decode top-2 {t['decode_top2']} (margin {t['decode_margin']:.4f}), verify top-2 {t['verify_top2']} "
            f"(margin {t['verify_margin']:.4f}); gap between the two tokens: decode {t['decode_gap']:.4f}, verify "
            f"{t['verify_gap']:.4f}; max |decode - verify| logit {t['max_abs_logit_diff']:.4f} of "
            f"{t['logit_scale']:.2f} -> near-tie: {t['near_tie']}"
        )


if __name__ == "__main__":
    main()
