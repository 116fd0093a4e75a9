"""`flashdraft regenerate`: the target and its tokenizer built from the arguments, then
flashdraft.data.regenerate.regenerate (which says what the command does)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.data.regenerate import BACKENDS, SGLangGenerator, VLLMGenerator, choose_backend, regenerate


def add_parser(sub) -> None:
    p = sub.add_parser("regenerate", help="rewrite training responses with the target itself (resumable)")
    p.add_argument("--target", required=True, help="target model directory, or 'bundled'")
    p.add_argument(
        "--data", required=True, action="append", help="input JSONL/Parquet (path, glob or s3://); repeatable"
    )
    p.add_argument("--out", required=True, help="output JSONL (appended to; rerun to resume)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="only the first N records")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: vLLM, then SGLang, when installed and on a GPU; else transformers (hf)",
    )
    p.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the target checkpoint")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console

    from flashdraft import bundled, fastpath
    from flashdraft.hub import NO_HUB_KERNELS

    for name in ("max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = choose_backend(args.backend, device)
    if backend != "hf":
        from transformers import AutoTokenizer

        if args.target == bundled.BUNDLED or not Path(args.target).is_dir():
            raise ValueError(f"--backend {backend} needs a model directory as --target, got {args.target!r}")
        tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=args.trust_remote_code)
        engine = {"vllm": VLLMGenerator, "sglang": SGLangGenerator}[backend]
        model = engine(args.target, args.trust_remote_code, args.seed)
    elif args.target == bundled.BUNDLED:
        tokenizer, model = bundled.load_tokenizer(), bundled.build_target(dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(args.target).is_dir():
            raise FileNotFoundError(f"--target {args.target}: not a model directory")
        tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            args.target, dtype=dtype, trust_remote_code=args.trust_remote_code, **NO_HUB_KERNELS
        ).to(device)
    if backend == "hf":
        fastpath.enable(model, strict=device.type == "cuda")
        model = model.eval()
    counts = regenerate(
        model,
        tokenizer,
        args.data,
        args.out,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        seed=args.seed,
        progress=not args.no_progress,
    )
    empty = (
        f"; {counts['empty']} got an empty response (the target stopped at once) and were not written"
        if counts["empty"]
        else ""
    )
    Console().print(
        f"regenerated {counts['written']} records with {backend} into {args.out} "
        f"({counts['already_done']} already done, {counts['read']} read) in {counts['seconds']} s{empty}",
        soft_wrap=True,
    )
    return EXIT_OK
