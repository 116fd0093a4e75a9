"""The target's own MTP layer on the speculative-decoding engine, beside DFlash: round times and a greedy check.

On a Qwen3.5-27B-shaped random target (64 layers: 48 Gated DeltaNet + 16 gated attention, vocab 248320; `--layers`
for a slice) with a random MTP layer of its shapes (`flashdraft.target.mtp.MTPHead`: fc over [embedding; hidden],
one gated-attention decoder layer, norm, the target's LM head) and a random 5-layer DFlash drafter, batch 1:
  check     in float32: MTP decoding on the engine (CUDA graphs) equals the target's greedy output token for token —
            the engine's own autoregressive decoding, and transformers' forwards one token at a time (the prompt
            is 64 tokens, so that both prefills run the exact recurrent kernel rather than TF32 chunks)
  timings   per dtype (`--dtypes`, default float32 then bfloat16), at each context: the engine's decode step,
            DFlash's draft (15 drafts, one pass) and round, MTP's draft (the pending verified rows, then k chained
            one-token steps, each through the target's LM head) and round; a round = draft + verify 16 + accept +
            commit + the one host read, back to back as generation runs them
The drafts of random heads are rejected, so every round keeps one token: what is timed is the cost of a round at
fixed shapes; which method is faster end to end also depends on its tau (`flashdraft eval` measures both).

Run (a GPU, from the repository root):  python -m bench.spec_engine_mtp --json OUT.json    # table last
           CPU check:                   python -m bench.spec_engine_mtp --smoke              # tiny target, graphs off
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.spec_engine import BLOCK, ROUNDS, build, engine_numbers, run_header, timed_ms

GREEDY_PROMPT, GREEDY_TOKENS = 64, 48


def random_head(target):
    """A random MTP layer of the target's shapes, initialised as the target's own layers are."""
    from flashdraft.target.mtp import MTPHead

    torch.manual_seed(2)
    head = MTPHead.for_target(target)
    head.apply(target._init_weights)
    return head.eval().requires_grad_(False)


@torch.inference_mode()
def mtp_engine_numbers(target, head, ids: torch.Tensor, graphs: bool, iters: int, num_drafts: int) -> dict:
    """The MTP runner on the engine: its draft (pending rows + the chain) and a full round, as `engine_numbers`."""
    from flashdraft.speculative.engine import session as loop
    from flashdraft.speculative.engine.rounds import verify_round

    greedy = (0.0, 1.0, 0)
    sess = loop.session(target, ids.shape[1] + (ROUNDS + 4) * (iters + 2) + 4 * BLOCK, BLOCK, None, graphs)
    engine, runner = sess.engine, sess.mtp_runner(head, num_drafts, greedy, None)
    logits = engine.prefill(ids[0])
    runner.prefill(ids[0], logits.argmax())
    out = {"num_drafts": num_drafts, "captured": sess.captured, "capture_error": sess.capture_error}

    def rounds():
        runner.draft()
        for i in range(ROUNDS):
            engine.verify_ids[:1].copy_(runner.block_ids)
            verify_round(engine, runner, runner.drafts, None, greedy, None, i + 1 < ROUNDS)
        engine.join()

    out["round_ms"] = timed_ms(rounds, iters) / ROUNDS
    context = runner.context.clone()

    def draft():  # from the same pending position every call
        runner.context.copy_(context)
        runner.pending.fill_(1)
        runner.draft()

    out["draft_ms"] = timed_ms(draft, iters)
    return out


@torch.inference_mode()
def reference_greedy(target, ids: torch.Tensor, n: int) -> list[int]:
    """transformers' forwards with its cache, one token per forward (prompt included): the target's greedy output."""
    from flashdraft.speculative import rollback
    from flashdraft.versions import cache_kwargs

    cache = rollback.new_cache(target)
    for i in range(ids.shape[1] - 1):
        target(input_ids=ids[:, i : i + 1], use_cache=True, **cache_kwargs(cache))
    token, out = ids[:, -1:], []
    for _ in range(n):
        out.append(int(target(input_ids=token, use_cache=True, **cache_kwargs(cache)).logits[0, -1].argmax()))
        token = torch.tensor([[out[-1]]], device=ids.device)
    return out


@torch.inference_mode()
def greedy_check(target, head, ids: torch.Tensor, num_drafts: int) -> dict:
    from flashdraft.speculative import autoregressive_generate, mtp_generate

    mtp = mtp_generate(target, head, ids, GREEDY_TOKENS, num_drafts=num_drafts, engine=True)
    auto = autoregressive_generate(target, ids, GREEDY_TOKENS, engine=True)
    reference = reference_greedy(target, ids, GREEDY_TOKENS)
    first = next((i for i, (a, b) in enumerate(zip(mtp.tokens, reference, strict=True)) if a != b), None)
    return {
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "prompt_tokens": ids.shape[1],
        "greedy_tokens": GREEDY_TOKENS,
        "backend": mtp.backend,
        "rounds": mtp.num_rounds,
        "mtp_equals_engine_greedy": mtp.tokens == auto.tokens,
        "mtp_equals_transformers_greedy": mtp.tokens == reference,
        "engine_greedy_equals_transformers_greedy": auto.tokens == reference,
        "first_difference_at": first,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny hybrid target on the CPU, graphs off")
    ap.add_argument("--layers", type=int, default=64, help="target layers (a multiple of 4; 64 = the 27B)")
    ap.add_argument("--context", type=int, action="append", default=None, help="context to time (default 1024)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="timed in each; the first also runs the check")
    ap.add_argument("--mtp-drafts", type=int, default=3, help="chained MTP drafts per round")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    if a.layers % 4:
        raise SystemExit(f"--layers must be a multiple of 4 (3 linear + 1 full attention), got {a.layers}")
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU check")
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    contexts = a.context or ([40] if a.smoke else [1024])
    iters = a.iters or (3 if a.smoke else 10)
    graphs = not a.smoke
    t0 = time.perf_counter()

    from flashdraft import fastpath
    from flashdraft.speculative.engine import session

    target, drafter, _, device = build(a.smoke, a.layers, dtype=dtypes[0], reference=False)
    head = random_head(target)
    fastpath.enable(target, strict=not a.smoke, run_probe=not a.smoke)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    report = {**run_header(a.smoke, a.layers, graphs), "mtp_drafts": a.mtp_drafts, "timings": {}}
    prompt = torch.randint(0, vocab, (1, GREEDY_PROMPT), generator=g).to(device)
    report["check"] = greedy_check(target, head, prompt, a.mtp_drafts)
    print("check", report["check"], flush=True)
    for dtype in dtypes:
        if dtype != next(target.parameters()).dtype:
            session.drop_session(target)
            target, drafter, head = target.to(dtype), drafter.to(dtype), head.to(dtype)
        name = str(dtype).removeprefix("torch.")
        for ctx in contexts:
            ids = torch.randint(0, vocab, (1, ctx), generator=g).to(device)
            row = {"dflash": engine_numbers(target, drafter, ids, graphs, iters)}
            row["mtp"] = mtp_engine_numbers(target, head, ids, graphs, iters, a.mtp_drafts)
            print(name, ctx, row, flush=True)
            report["timings"][f"{name} ctx {ctx}"] = row
    report["seconds"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(report: dict) -> None:
    columns = list(report["timings"])
    what = (
        "tiny hybrid target, CPU, graphs off (smoke)"
        if report["smoke"]
        else (f"{report['target_layers']}-layer Qwen3.5-27B-shaped random target")
    )
    print(
        f"\n### MTP on the engine beside DFlash: {what}, batch 1, verification block {BLOCK}, {report['mtp_drafts']} "
        f"MTP drafts; {report['device']}, torch {report['torch']}, transformers {report['transformers']}"
    )
    print("| ms | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    rows = [
        ("engine decode step", "dflash", "decode_ms"),
        ("DFlash draft (15 drafts, one pass)", "dflash", "draft_ms"),
        ("**DFlash round**", "dflash", "round_ms"),
        (f"MTP draft ({report['mtp_drafts']} chained steps)", "mtp", "draft_ms"),
        ("**MTP round**", "mtp", "round_ms"),
    ]
    for label, method, key in rows:
        print(f"| {label} | " + " | ".join(f"{report['timings'][c][method][key]:.2f}" for c in columns) + " |")
    for c in columns:
        for method in ("dflash", "mtp"):
            if not report["timings"][c][method]["captured"] and report["graphs"]:
                print(f"WARNING {c}: {method} graphs not captured ({report['timings'][c][method]['capture_error']})")
    c = report["check"]
    print(
        f"check ({c['dtype']}, {c['prompt_tokens']}-token prompt, {c['greedy_tokens']} tokens, {c['backend']}, "
        f"{c['rounds']} rounds): MTP == engine greedy {c['mtp_equals_engine_greedy']}; MTP == transformers greedy "
        f"{c['mtp_equals_transformers_greedy']} (first difference {c['first_difference_at']}); engine greedy == "
        f"transformers greedy {c['engine_greedy_equals_transformers_greedy']}; {report['seconds']:.0f} s in all"
    )


if __name__ == "__main__":
    main()
