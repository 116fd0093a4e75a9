"""`flashdraft regenerate`: the target (target.path) and its tokenizer, loaded by flashdraft.target.load, then
flashdraft.data.regenerate.regenerate (which says what the command does) with the regenerate section's settings."""

from __future__ import annotations

from pathlib import Path

from flashdraft.cli import options
from flashdraft.cli.exit_codes import EXIT_OK
from flashdraft.cli.options import Shortcut

SHORTCUTS = (
    Shortcut("target.path", flag="--target", metavar="DIR"),
    Shortcut("regenerate.data", flag="--data", repeat=True, metavar="PATH_OR_GLOB_OR_S3"),
    Shortcut("regenerate.out", metavar="OUT.jsonl"),
    *options.shortcuts("regenerate.temperature", "regenerate.max_new_tokens", "regenerate.batch_size"),
    *options.shortcuts("regenerate.limit", "regenerate.seed", "regenerate.device", "target.dtype"),
    *options.shortcuts("regenerate.backend", "target.trust_remote_code"),
    Shortcut("regenerate.progress", negate=True),
)


def add_parser(sub) -> None:
    p = sub.add_parser("regenerate", help="rewrite training responses with the target itself (resumable)")
    options.add(p, execute, SHORTCUTS)


def execute(cfg, args) -> int:
    from rich.console import Console

    from flashdraft import bundled
    from flashdraft.data.regenerate import SGLangGenerator, VLLMGenerator, choose_backend, regenerate
    from flashdraft.devices import resolve_device
    from flashdraft.target.load import load_causal_lm, load_tokenizer

    # The target is named: regenerating data with the bundled default's target by accident would go unnoticed.
    options.require(args, cfg, "regenerate.data", "regenerate.out", named=("target.path",))
    r, target = cfg.regenerate, cfg.target
    device = resolve_device(r.device, field="regenerate.device")
    backend = choose_backend(r.backend, device)
    tokenizer = load_tokenizer(target.path, trust_remote_code=target.trust_remote_code)
    if backend != "hf":
        if target.path == bundled.BUNDLED or not Path(target.path).is_dir():
            raise ValueError(f"--backend {backend} needs a model directory as --target, got {target.path!r}")
        engine = {"vllm": VLLMGenerator, "sglang": SGLangGenerator}[backend]
        model = engine(target.path, target.trust_remote_code, r.seed)
    else:
        model = load_causal_lm(
            target.path,
            dtype=target.dtype,
            device=device,
            trust_remote_code=target.trust_remote_code,
            strict=device.type == "cuda",
        )
    counts = regenerate(
        model,
        tokenizer,
        r.data,
        r.out,
        temperature=r.temperature,
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
        limit=r.limit,
        seed=r.seed,
        progress=r.progress,
    )
    empty = (
        f"; {counts['empty']} got an empty response (the target stopped at once) and were not written"
        if counts["empty"]
        else ""
    )
    Console().print(
        f"regenerated {counts['written']} records with {backend} into {r.out} "
        f"({counts['already_done']} already done, {counts['read']} read) in {counts['seconds']} s{empty}",
        soft_wrap=True,
    )
    return EXIT_OK
