"""Recipe ablation on the tiny target: train each variant with the same budget, measure τ at T=0 and T=1.

    python tools/sweep.py --data build/tiny_target/regen_t0.jsonl build/tiny_target/regen_t1.jsonl \\
        --steps 300 --out build/tiny_target/sweep [--variants baseline,dpace,lk] [--set train.compile=false ...]

Every variant is `examples/tiny_target/drafter.yaml` plus its own overrides (VARIANTS below; `a+b` takes both a's and
b's, e.g. `dpace+late`), trained from a fresh drafter for the same `--steps` on the same data with the same seed, one
after the other in this process. Each is then decoded on the same held-out prompts (default: the package's 64,
`flashdraft/bundled/eval.jsonl`) at T=0 and T=1, block 16 (`--block-size`: trained and decoded at that size);
prompt lookup decodes the same prompts with the same settings once per temperature, at the start. Writes to --out: sweep.json (after every variant, so a cut-short sweep
keeps what it measured), sweep.md (the table) and sweep.png (a bar chart; needs matplotlib). `--deadline-s` skips the
variants that would end after it; `--redraw` rewrites the table and the chart from --out's sweep.json (e.g. on a
machine with matplotlib); `--merge DIR ...` joins the sweep.json of several runs (a sweep split over processes sharing
one GPU, or over machines) into --out, after checking they measured alike (steps, prompts, settings, prompt lookup's τ
within 1%). `--lookup FILE` keeps prompt lookup's decodes in FILE and reuses them when FILE exists and was
measured alike (same target, prompts, lengths, seed and device), so runs split over processes decode it once. Keep
it to one machine: another host's bf16 can break a near-tie differently, and the greedy check compares tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch

TINY_TARGET = Path(__file__).resolve().parents[1] / "examples" / "tiny_target"
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("drafter.yaml: 3 layers on target layers 1-5, 128 anchors, CE, exp(-(k-1)/7)", []),
    "dpace": ("D-PACE position weights (alpha 0.5)", ["recipe.loss_weighting=dpace"]),
    "lk": ("LK^lambda token loss (eta 3)", ["recipe.loss=lk"]),
    "dpace_lk": ("D-PACE weights and the LK loss", ["recipe.loss_weighting=dpace", "recipe.loss=lk"]),
    # Against the target's whole next-token distribution rather than its sampled or greedy token.
    "target_labels": ("KL to the target's distribution", ["recipe.labels=target"]),
    "target_lk": ("LK against the target's distribution", ["recipe.labels=target", "recipe.loss=lk"]),
    "dpace_target": (
        "D-PACE weights, KL to the target's distribution",
        ["recipe.loss_weighting=dpace", "recipe.labels=target"],
    ),
    "gamma4": ("faster decay, gamma 4", ["recipe.gamma=4"]),
    "gamma14": ("slower decay, gamma 14", ["recipe.gamma=14"]),
    "anchors256": ("256 anchors per sequence", ["recipe.num_anchors=256"]),
    "stratified": ("anchors stratified over the response", ["recipe.anchor_sampling=stratified"]),
    "layers5": ("5 drafter layers", ["drafter.num_layers=5"]),
    "spread": ("target layers 1, 3, 5, 6, 7", ["drafter.target_layer_ids=[1, 3, 5, 6, 7]"]),
    "late": ("target layers 3-7 (the last five)", ["drafter.target_layer_ids=[3, 4, 5, 6, 7]"]),
    # Every layer causal in the block with a window over the context (one rule for all layers, as training needs).
    "window128": (
        "sliding-window layers, 128 tokens",
        [
            "drafter.overrides.layer_types=[sliding_attention, sliding_attention, sliding_attention]",
            "drafter.overrides.sliding_window=128",
        ],
    ),
    # Trained on FP8 features, decoded against the bf16 target like every variant (a GPU with FP8: sm89+).
    "fp8": ("the target's linear layers in FP8 while training", ["target.precision=fp8"]),
    # The drafter families (docs/families.md): DSpark's heads, DFlash2's convolutions and selector, each with its loss.
    "dflash": ("DFlash: the backbone alone, its block cross-entropy", ["drafter.family=dflash"]),
    "dspark": ("DSpark: Markov (rank 256) and confidence heads, its loss", ["drafter.family=dspark"]),
    "dspark_slots": (
        "DSpark in DFlash's block slots (the anchor's slot drafts nothing)",
        ["drafter.family=dspark", "drafter.dspark.sample_from_anchor=false"],
    ),
    "dflash2": (
        "DFlash2: dynamic convolutions and a candidate selector, its loss",
        ["drafter.family=dflash2"],
    ),
    "from_shipped": ("started from the shipped drafter (flashdraft/bundled/drafter)", ["drafter.init_from=bundled"]),
}
DEFAULT_VARIANTS = "baseline,dpace,lk,spread,gamma4,layers5,anchors256"
TEMPERATURES = (0.0, 1.0)
COMBINE = "+"  # "dpace+late": both variants' overrides, in that order


def variant(name: str) -> tuple[str, list[str]]:
    """What a variant is and its overrides; `a+b` combines variants a and b."""
    parts = [VARIANTS[part] for part in name.split(COMBINE)]
    return "; ".join(what for what, _ in parts), [o for _, overrides in parts for o in overrides]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/tiny_target/sweep"))
    p.add_argument(
        "--config", type=Path, default=TINY_TARGET / "drafter.yaml", help="the recipe every variant starts from"
    )
    p.add_argument("--target", default="bundled", help="target directory, or 'bundled' (default)")
    p.add_argument("--data", nargs="+", default=None, help="training JSONL (default: the config's data.train)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (the same for all)")
    p.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help=f"comma-separated, of: {', '.join(VARIANTS)}; a+b combines two (e.g. dpace+late)",
    )
    p.add_argument("--set", nargs="*", default=[], metavar="section.field=value", help="overrides for every variant")
    p.add_argument("--prompts", type=Path, default=None, help="held-out prompts (default: the package's 64)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="tokens per block, as trained and as decoded")
    p.add_argument("--seed", type=int, default=0, help="sampling seed at T=1 (prompt i: seed + i)")
    p.add_argument("--deadline-s", type=float, default=None, help="skip variants that would end later than this")
    p.add_argument(
        "--lookup",
        type=Path,
        default=None,
        help="prompt lookup's decodes: read from this JSON if measured alike, else written",
    )
    p.add_argument("--redraw", action="store_true", help="only rewrite sweep.md and sweep.png from --out/sweep.json")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="DIR", help="join these runs' sweep.json")
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in a.variants if not all(part in VARIANTS for part in v.split(COMBINE))]
    if unknown or not a.variants:
        p.error(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    if a.steps < 1 or a.max_new_tokens < 1 or a.block_size < 2 or (a.limit is not None and a.limit < 1):
        p.error("--steps, --max-new-tokens and --limit must be >= 1, --block-size >= 2")
    return a


def variant_config(a: argparse.Namespace, name: str):
    from flashdraft.config import load_config

    run = a.out / "runs" / name
    base = [
        f"target.path={a.target}",
        f"log.out={run}",
        f"train.max_steps={a.steps}",
        f"drafter.block_size={a.block_size}",  # trained at the block size it is decoded with
        f"data.shards={a.out / 'shards'}",  # tokenised once, by the first run, reused by the others
        "data.eval_prompts=null",  # this script measures τ itself, on every variant alike
        "log.heldout_every=0",
        f"log.checkpoint_every={a.steps}",
        "log.keep_checkpoints=1",
        f"log.every={max(1, a.steps // 20)}",
    ]
    if a.data:
        base.append(f"data.train=[{', '.join(a.data)}]")
    return load_config(a.config, [*base, *a.set, *variant(name)[1]])


def train_variant(cfg) -> dict:
    from rich.console import Console

    from flashdraft.train.loop import train

    start = time.perf_counter()
    result = train(cfg, console=Console(quiet=True))
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = rows[1:] or rows  # the first window carries the warm-up
    return {
        "train_s": seconds,
        "tok_s": sum(r["tok_s"] for r in steady) / len(steady),
        "steps": result.steps,
        "loss": result.loss,
        "sim_tau": result.sim_tau,
        "drafter": str(result.checkpoint / "drafter"),
    }


class Decoder:
    """The target and prompts, loaded once; decodes a method over every prompt at one temperature."""

    def __init__(self, a: argparse.Namespace, device: torch.device):
        from flashdraft import bundled
        from flashdraft.speculative.prompts import load_prompts
        from flashdraft.target import load_causal_lm

        self.a, self.device = a, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.target = load_causal_lm(a.target, dtype=self.dtype, device=device)
        if a.target == bundled.BUNDLED:
            tokenizer = bundled.load_tokenizer()
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(a.target)
        self.prompts = load_prompts(a.prompts or bundled.eval_prompts(), tokenizer, a.limit)
        eos = {getattr(self.target.generation_config, "eos_token_id", None), tokenizer.eos_token_id}
        self.stops = sorted(int(e) for e in eos if isinstance(e, int))

    def run(self, method: str, temperature: float, drafter=None) -> tuple[float, list[list[int]]]:
        """(τ over all rounds of all prompts, each prompt's tokens)."""
        from flashdraft.speculative import generate, prompt_lookup_generate
        from flashdraft.speculative.tally import Tally

        tally, outputs = Tally(), []
        for i, prompt in enumerate(self.prompts):
            gen = None
            if temperature > 0:
                gen = torch.Generator(device=self.device).manual_seed(self.a.seed + i)
            common = dict(temperature=temperature, block_size=self.a.block_size, stop_token_ids=self.stops)
            ids = prompt.input_ids.to(self.device)
            with torch.no_grad():
                if method == "dflash":
                    result = generate(self.target, drafter, ids, self.a.max_new_tokens, generator=gen, **common)
                else:
                    result = prompt_lookup_generate(self.target, ids, self.a.max_new_tokens, generator=gen, **common)
            tally.add(result)
            outputs.append(result.tokens)
        return tally.tau, outputs

    def drafter(self, path: str):
        from flashdraft.drafter import DFlashDraftModel

        return DFlashDraftModel.from_pretrained(path, dtype=self.dtype).to(self.device).eval()


def write_report(out: Path, report: dict) -> None:
    (out / "sweep.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "sweep.md").write_text(table(report) + "\n")
    fig = chart(report)
    if fig is not None:
        fig.savefig(out / "sweep.png", dpi=120, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)


def chart(report: dict):
    """The bar chart of τ per variant at both temperatures, each bar labelled with its value, prompt lookup's τ as
    lines, the legend beside the axes (never over a bar); None without matplotlib or a measured variant."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report["variants"] if "tau_t0" in r]
    if not done:
        return None
    fig, ax = plt.subplots(figsize=(1.2 * len(done) + 2, 4))
    x = range(len(done))
    for t, offset in zip(TEMPERATURES, (-0.2, 0.2), strict=True):
        bars = ax.bar([i + offset for i in x], [r[f"tau_t{t:g}"] for r in done], width=0.4, label=f"drafter T={t:g}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    for t, style in zip(TEMPERATURES, ("--", ":"), strict=True):
        ax.axhline(
            report["prompt_lookup"][f"tau_t{t:g}"], color="gray", linestyle=style, label=f"prompt lookup T={t:g}"
        )
    ax.set_xticks(list(x), [r["name"] for r in done], rotation=20)
    ax.set_ylabel("τ (tokens per verification)")
    tallest = max([*(r[f"tau_t{t:g}"] for r in done for t in TEMPERATURES), *report["prompt_lookup"].values()])
    ax.set_ylim(0, 1.1 * tallest + 0.1)  # room for the bar labels
    ax.set_title(
        f"{report['steps']} steps per variant, {report['num_prompts']} held-out prompts, block {report['block_size']}"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def table(report: dict) -> str:
    lookup = report["prompt_lookup"]
    lines = [
        f"{report['steps']} steps per variant; {report['num_prompts']} held-out prompts, {report['max_new_tokens']} "
        f"new tokens, block {report['block_size']}; prompt lookup τ {lookup['tau_t0']:.2f} (T=0), "
        f"{lookup['tau_t1']:.2f} (T=1).",
        *(
            [
                f"Joined from {len(report['merged_from'])} runs: τ compares across them; training seconds and tokens/s "
                "only within a run (runs sharing one device slow each other)."
            ]
            if report.get("merged_from")
            else []
        ),
        "",
        "| variant | τ T=0 | τ T=1 | × prompt lookup (T=0) | training s | tokens/s | final loss | what |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["variants"]:
        if "tau_t0" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r.get('failed', '?')}"
            lines.append(f"| {r['name']} | – | – | – | – | – | – | {why} |")
            continue
        lines.append(
            f"| {r['name']} | {r['tau_t0']:.2f} | {r['tau_t1']:.2f} | {r['tau_t0'] / lookup['tau_t0']:.2f}× | "
            f"{r['train_s']:.0f} | {r['tok_s']:,.0f} | {r['loss']:.3f} | {r['what']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.redraw or a.merge:
        report = merge(a.merge) if a.merge else json.loads((a.out / "sweep.json").read_text())
        a.out.mkdir(parents=True, exist_ok=True)
        write_report(a.out, report)
        print(table(report))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.variants:
        variant_config(a, name)  # every variant's config checked before anything trains
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    decoder = Decoder(a, device)
    report = {
        "steps": a.steps,
        "num_prompts": len(decoder.prompts),
        "max_new_tokens": a.max_new_tokens,
        "block_size": a.block_size,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "common_overrides": a.set,
        "data": a.data,
        "prompt_lookup": {},
        "variants": [],
    }
    report["prompt_lookup"], lookup_tokens = prompt_lookup(a, decoder, report)
    print(f"prompt lookup: τ {report['prompt_lookup']} ({time.perf_counter() - start:.0f} s)", flush=True)
    write_report(a.out, report)
    longest = 0.0
    for name in a.variants:
        what, overrides = variant(name)
        row = {"name": name, "what": what, "overrides": overrides}
        report["variants"].append(row)
        began = time.perf_counter()
        if a.deadline_s is not None and began - start + 1.2 * longest > a.deadline_s:
            row["skipped"] = f"the {a.deadline_s:.0f} s deadline"
            print(f"{name}: skipped (deadline)", flush=True)
            write_report(a.out, report)
            continue
        try:
            measure(a, decoder, name, row, lookup_tokens)
        except Exception as exc:  # one variant failing (out of memory, say) must not cost the others
            row["failed"] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: failed: {row['failed']}", flush=True)
            write_report(a.out, report)
            continue
        finally:
            _release(decoder.target)
            longest = max(longest, time.perf_counter() - began)
        print(
            f"{name}: τ {row['tau_t0']:.2f} (T=0) {row['tau_t1']:.2f} (T=1), train {row['train_s']:.0f} s at "
            f"{row['tok_s']:,.0f} tok/s, eval {row['eval_s']:.0f} s",
            flush=True,
        )
        write_report(a.out, report)
    report["total_s"] = time.perf_counter() - start
    write_report(a.out, report)
    print(table(report))
    return 1 if any("failed" in r for r in report["variants"]) else 0


def prompt_lookup(a: argparse.Namespace, decoder: Decoder, report: dict) -> tuple[dict, dict]:
    """Prompt lookup's τ per temperature and its tokens per prompt: decoded here, or read from `a.lookup` when that
    file holds a decode measured alike (SystemExit naming the field when it was not). Writes `a.lookup` after a
    decode."""
    settings = {  # what a kept file must share with this run to stand for its decodes
        "target": a.target,
        "prompts": str(a.prompts) if a.prompts else None,
        "limit": a.limit,
        "max_new_tokens": a.max_new_tokens,
        "block_size": a.block_size,
        "seed": a.seed,
        "device": report["device"],
    }
    if a.lookup is not None and a.lookup.is_file():
        try:
            kept = json.loads(a.lookup.read_text())
            differs = [key for key, value in settings.items() if kept["settings"].get(key) != value]
            taus, tokens = kept["tau"], {float(t): rows for t, rows in kept["tokens"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SystemExit(f"--lookup: cannot read {a.lookup}: {type(exc).__name__}: {exc}") from None
        if differs:
            key = differs[0]
            raise SystemExit(
                f"--lookup: {a.lookup} was measured with {key} = {kept['settings'].get(key)!r}, this run has "
                f"{settings[key]!r}; give another file or remove it"
            )
        if sorted(tokens) != sorted(TEMPERATURES) or any(len(rows) != len(decoder.prompts) for rows in tokens.values()):
            raise SystemExit(f"--lookup: {a.lookup} does not hold one decode per prompt at T = {TEMPERATURES}")
        print(f"prompt lookup: read from {a.lookup}", flush=True)
        return taus, tokens
    taus, tokens = {}, {}
    for t in TEMPERATURES:
        taus[f"tau_t{t:g}"], tokens[t] = decoder.run("prompt_lookup", t)
    if a.lookup is not None:
        from flashdraft.io.atomic import atomic_write_text

        a.lookup.parent.mkdir(parents=True, exist_ok=True)
        kept = {"settings": settings, "tau": taus, "tokens": {f"{t:g}": rows for t, rows in tokens.items()}}
        atomic_write_text(a.lookup, json.dumps(kept))
    return taus, tokens


PROMPT_LOOKUP_RTOL = 0.01
# What two runs must share for their rows to sit in one table.
SAME = ("steps", "num_prompts", "max_new_tokens", "block_size", "device", "common_overrides", "data")


def merge(dirs: list[Path]) -> dict:
    """One report from the sweep.json of several runs; SystemExit naming the run and field that differ."""
    reports = []
    for d in dirs:
        path = d / "sweep.json"
        try:
            reports.append((path, json.loads(path.read_text())))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--merge: cannot read {path}: {exc}") from None
    (first_path, merged), *rest = reports
    merged = {**merged, "variants": list(merged["variants"]), "merged_from": [str(d) for d in dirs]}
    for path, report in rest:
        for key in SAME:
            if report.get(key) != merged.get(key):
                raise SystemExit(f"--merge: {path} has {key} = {report.get(key)!r}, {first_path} {merged.get(key)!r}")
        # Greedy prompt lookup repeats within a machine; in bf16 another host can break a near-tie the other way
        # (0.2% apart on two H200s). More than PROMPT_LOOKUP_RTOL means other prompts, another target or other code.
        ours, theirs = report["prompt_lookup"]["tau_t0"], merged["prompt_lookup"]["tau_t0"]
        if abs(ours - theirs) > PROMPT_LOOKUP_RTOL * theirs:
            raise SystemExit(
                f"--merge: prompt lookup's τ at T=0 is {ours} in {path}, {theirs} in {first_path}: more than "
                f"{PROMPT_LOOKUP_RTOL:.0%} apart, not the same measurement"
            )
        names = {r["name"] for r in merged["variants"]}
        twice = [r["name"] for r in report["variants"] if r["name"] in names]
        if twice:
            raise SystemExit(f"--merge: {path} measured {twice} again")
        merged["variants"] += report["variants"]
        merged.setdefault("prompt_lookup_by_run", [merged["prompt_lookup"]]).append(report["prompt_lookup"])
        merged["total_s"] = max(merged.get("total_s", 0.0), report.get("total_s", 0.0))
    return merged


def measure(a: argparse.Namespace, decoder: Decoder, name: str, row: dict, lookup_tokens: dict) -> None:
    """Train variant `name` and decode with it at both temperatures, into `row`."""
    began = time.perf_counter()
    row.update(train_variant(variant_config(a, name)))
    drafter = decoder.drafter(row["drafter"])
    for t in TEMPERATURES:
        row[f"tau_t{t:g}"], tokens = decoder.run("dflash", t, drafter)
        if t == 0:  # both decodings are lossless: each must be the target's greedy output
            row["greedy_mismatches"] = sum(x != y for x, y in zip(tokens, lookup_tokens[t], strict=True))
    row["eval_s"] = time.perf_counter() - began - row["train_s"]


def _release(target) -> None:
    """Free a finished variant's decoding state (the engine keeps one runner, with its graphs, per drafter)."""
    from flashdraft.speculative.engine.session import drop_session

    drop_session(target)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
