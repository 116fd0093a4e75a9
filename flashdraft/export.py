"""`flashdraft export`: write a drafter that SGLang, vLLM, speculators and the reference `dflash` package load.

    flashdraft export --drafter runs/qwen3.5-27b/final --out exports/qwen3.5-27b-dflash --target Qwen/Qwen3.5-27B
    flashdraft export --drafter runs/dspark --out exports/dspark --target /models/Qwen3.5-27B   # DeepSpec's layout
    flashdraft export --drafter runs/dspark --out exports/dspark-spec --layout speculators --target /models/...

The output directory holds `config.json` + `model.safetensors` in a layout (`flashdraft.drafter.layouts`: by
default the one the serving engines read for the drafter's family: the reference `dflash` layout, or DeepSpec's
for DSpark, which carries the target's embedding and LM head) and a `README.md` with the serving command lines.
With `--target` (a local model directory or its config.json) the drafter is checked against the target first:
hidden size, vocabulary, captured layers. Errors exit with code 2 and one message.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from transformers import Qwen3Config

from flashdraft.drafter.config import draft_value, validate_draft_config
from flashdraft.drafter.layouts import check_layout, write_layout
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.io.atomic import atomic_directory

PLACEHOLDER_TARGET = "TARGET_MODEL"  # shown in the command lines when no --target is given


class ExportError(ValueError):
    """A drafter that cannot be exported as asked; the message says which field and both values."""


def export_drafter(
    drafter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    target: str | os.PathLike | None = None,
    layout: str | None = None,
) -> Path:
    """Check the drafter (against `target` when given) and write it to `out_dir` atomically in `layout` (None: its
    family's serving layout); return `out_dir`."""
    if not (Path(drafter_dir) / "config.json").is_file():
        raise ExportError(f"--drafter {drafter_dir}: no config.json there (give a local drafter checkpoint directory)")
    config = Qwen3Config.from_pretrained(drafter_dir)
    try:
        validate_draft_config(config)
    except ValueError as err:
        raise ExportError(f"{Path(drafter_dir) / 'config.json'}: {err}") from None
    if target is not None:
        problems = check_against_target(config, read_target_config(target))
        if problems:
            raise ExportError(f"drafter {drafter_dir} does not fit target {target}:\n  " + "\n  ".join(problems))
    drafter = DFlashDraftModel.from_pretrained(drafter_dir)
    try:
        layout = check_layout(drafter.family, layout)
    except ValueError as err:
        raise ExportError(f"--drafter {drafter_dir}: {err}") from None
    target_dir = None if target is None else (Path(target) if Path(target).is_dir() else Path(target).parent)
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        try:
            write_layout(drafter, tmp, layout, target_dir)
        except ValueError as err:
            raise ExportError(f"{layout} layout: {err}") from None
        (tmp / "README.md").write_text(readme(drafter, out, target, layout))
    return out


def read_target_config(target: str | os.PathLike) -> dict:
    """The target's text config as a dict, from a model directory or a config.json path."""
    path = Path(target)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ExportError(f"--target {target}: no config.json there (give a local model directory or its config.json)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ExportError(f"--target {path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ExportError(f"--target {path}: expected a JSON object, got {type(config).__name__}")
    # Multimodal targets (Qwen3.5 / 3.6) keep the language model's sizes in text_config.
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise ExportError(f"--target {path}: text_config must be a JSON object, got {type(text).__name__}")
    return text


def check_against_target(drafter_config: Qwen3Config, target: dict) -> list[str]:
    """Every mismatch between a drafter config and a target text config, one sentence each (empty: compatible)."""
    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if k not in target]
    if missing:
        return [f"the target config has no {', '.join(missing)}"]
    wrong = [
        f"{k} = {target[k]!r}"
        for k in ("hidden_size", "vocab_size", "num_hidden_layers")
        if not isinstance(target[k], int) or isinstance(target[k], bool)
    ]
    if wrong:
        return [f"the target config has non-integer {', '.join(wrong)}"]
    problems = []
    if drafter_config.hidden_size != target["hidden_size"]:
        problems.append(
            f"hidden_size: drafter {drafter_config.hidden_size}, target {target['hidden_size']} (they must be equal)"
        )
    mask_token_id = draft_value(drafter_config, "mask_token_id")
    if target["vocab_size"] < mask_token_id + 1:
        problems.append(
            f"vocab_size: target {target['vocab_size']} has no row for the drafter's mask_token_id {mask_token_id} "
            f"(needs vocab_size >= {mask_token_id + 1})"
        )
    num_target_layers = draft_value(drafter_config, "num_target_layers")
    if num_target_layers != target["num_hidden_layers"]:
        problems.append(
            f"num_target_layers: drafter {num_target_layers}, target num_hidden_layers {target['num_hidden_layers']}"
        )
    layer_ids = list(draft_value(drafter_config, "target_layer_ids"))
    beyond = [i for i in layer_ids if i >= target["num_hidden_layers"]]
    if beyond:
        problems.append(
            f"target_layer_ids: drafter reads target layers {beyond} (of {layer_ids}), target num_hidden_layers "
            f"{target['num_hidden_layers']}"
        )
    return problems


def serve_commands(
    drafter_path: str,
    block_size: int,
    target: str = PLACEHOLDER_TARGET,
    family: str = "dflash",
    drafts: int | None = None,
) -> dict[str, str]:
    """Command lines serving `target` with this drafter: {"sglang": ..., "vllm": ...}. `drafts`: per block
    (default block_size - 1; a DSpark drafter whose anchor slot drafts has block_size)."""
    drafts = block_size - 1 if drafts is None else drafts
    spec = {"method": family, "model": drafter_path, "num_speculative_tokens": drafts}
    spec = shlex.quote(json.dumps(spec, separators=(",", ":")))
    target, drafter_path = shlex.quote(target), shlex.quote(drafter_path)
    algorithm, size = (
        ("DSPARK", "--speculative-dspark-block-size")
        if family == "dspark"
        else ("DFLASH", "--speculative-num-draft-tokens")
    )
    sglang = (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {drafter_path} {size} {block_size}"
    )
    return {"sglang": sglang, "vllm": f"vllm serve {target} --speculative-config {spec}"}


def readme(drafter: DFlashDraftModel, out: Path, target: str | os.PathLike | None, layout: str = "reference") -> str:
    target_name = str(target) if target else PLACEHOLDER_TARGET
    commands = serve_commands(str(out.resolve()), drafter.block_size, target_name, drafter.family, drafter.num_drafts)
    name, paper = {
        "dflash": ("DFlash", "[DFlash](https://arxiv.org/abs/2602.06036)"),
        "dspark": ("DSpark", "[DSpark](https://arxiv.org/abs/2607.05147): DFlash with a Markov and a confidence head"),
        "dflash2": ("DFlash2", "DFlash2: DFlash with dynamic convolutions and a candidate selector"),
    }[drafter.family]
    return f"""# {name} drafter

A block-diffusion drafter ({paper}) for speculative decoding, exported by flashdraft in the {layout} layout. It
drafts {drafter.num_drafts} tokens per step from the target's hidden states of layers {drafter.target_layer_ids}
(of {drafter.num_target_layers}); it uses the target's embedding and LM head.

| field | value |
|---|---|
| target | {target or "not recorded"} |
| block_size | {drafter.block_size} |
| mask_token_id | {drafter.mask_token_id} |
| drafter layers | {drafter.config.num_hidden_layers} |

## Serving

SGLang:

```
{commands["sglang"]}
```

vLLM:

```
{commands["vllm"]}
```

Replace the drafter path with the Hub id once uploaded.{LOADERS[layout]}
"""


LOADERS = {
    "reference": " The reference `dflash` package loads it with `dflash.DFlashDraftModel.from_pretrained(path)`.",
    "deepspec": " vLLM and SGLang load it as `Qwen3DSparkModel` (only its vanilla Markov head is served).",
    "speculators": (
        " speculators loads it with `speculators.SpeculatorModel.from_pretrained(path)`, the embedding and LM head "
        "from the verifier its config names."
    ),
}
