"""The checkpoint layouts other programs read, written from a drafter (what `flashdraft export` writes).

| layout | families | read by | config.json | weights |
|---|---|---|---|---|
| reference | dflash, dflash2 | the `dflash` package, SGLang (`DFLASH`), vLLM (`dflash`); DFlash2: z-lab's `DFlash2DraftModel` and the engines that key on it | flashdraft's own: a Qwen3 config with `block_size`, `dflash_config` (DFlash2: `block_size` and the family's fields inside `dflash_config` alone, `is_causal`, as z-lab publishes them) | the backbone (and DFlash2's convolutions and selector) |
| deepspec | dspark | vLLM (`dspark`), SGLang (`DSPARK`) | DeepSpec's: `architectures: ["Qwen3DSparkModel"]`, the DSpark fields, `block_size`, `mask_token_id`, `target_layer_ids` at the top level | the backbone, the heads, and copies of the target's `embed_tokens` and `lm_head` |
| speculators | dflash, dspark, dflash2 | speculators 0.9 (vLLM's format library) | `speculators_model_type`, the drafter's layers as `transformer_layer_config`, `aux_hidden_state_layer_ids` (a target layer id + 1: an index of `output_hidden_states`), `speculators_config.verifier` | the backbone and the heads; the embedding and LM head reload from the verifier |

Weight names are the same in all three (`fc`, `hidden_norm`, `norm`, `layers.N.*`, `markov_head.*`,
`confidence_head.*`, `layers.N.{attention,mlp}_conv.*`, `candidate_selector.*` with its codebooks as bare tensors):
the layouts differ in their config and in what else they carry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashdraft.drafter.families import FAMILIES, family_value

LAYOUTS = {"reference": ("dflash", "dflash2"), "deepspec": ("dspark",), "speculators": ("dflash", "dspark", "dflash2")}
DEFAULT_LAYOUT = {"dflash": "reference", "dspark": "deepspec", "dflash2": "reference"}
SPECULATORS_VERSION = "0.9.0"
# What only flashdraft's own config holds (the other layouts state it their way, or not at all).
_FLASHDRAFT_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def check_layout(family: str, layout: str | None) -> str:
    """`layout` (None: the family's default) if it can hold a drafter of `family`; else a ValueError naming both."""
    layout = DEFAULT_LAYOUT[family] if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: must be one of {', '.join(LAYOUTS)}")
    if family not in LAYOUTS[layout]:
        raise ValueError(f"the {layout} layout holds {' or '.join(LAYOUTS[layout])} drafters, not {family}")
    return layout


def write_layout(drafter, directory: str | os.PathLike, layout: str, target_dir: str | os.PathLike | None) -> None:
    """Write `drafter` in `layout` into the existing `directory`. `target_dir`: the target's model directory (the
    deepspec layout copies its embedding and LM head; the speculators layout names it as the verifier)."""
    directory = Path(directory)
    if layout == "reference":
        drafter.write_checkpoint(directory)
        return
    weights = {name: tensor.detach().contiguous() for name, tensor in drafter.state_dict().items()}
    if layout == "deepspec":
        if target_dir is None:
            raise ValueError("the deepspec layout carries the target's embedding and LM head: give the target")
        weights.update(target_head_weights(target_dir, drafter.config.vocab_size, next(iter(weights.values())).dtype))
        config = deepspec_config(drafter)
    else:
        config = speculators_config(drafter, target_dir)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _layer_config(drafter) -> dict:
    """The drafter's Qwen3 fields alone, as a plain dict."""
    config = drafter.config.to_dict()
    for key in _FLASHDRAFT_KEYS:
        config.pop(key, None)
    config["model_type"] = "qwen3"
    return config


def _family_fields(drafter) -> dict:
    return {name: family_value(drafter.config, name) for name in FAMILIES[drafter.family].fields}


def deepspec_config(drafter) -> dict:
    """DeepSpec's flat DSpark config (what vLLM's and SGLang's `Qwen3DSparkModel` read)."""
    fields = _family_fields(drafter)
    if not fields["enable_confidence_head"]:
        fields.pop("confidence_head_with_markov")  # DeepSpec writes it only beside an enabled head
    return {
        **_layer_config(drafter),
        "architectures": ["Qwen3DSparkModel"],
        "head_dim": drafter.config.head_dim,
        "block_size": drafter.block_size,
        "num_target_layers": drafter.num_target_layers,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": drafter.target_layer_ids,
        "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": drafter.target_layer_ids},
        **fields,
        "tie_word_embeddings": False,
    }


def speculators_config(drafter, target_dir: str | os.PathLike | None) -> dict:
    """speculators' config of a DFlash or DSpark drafter; its verifier is `target_dir` (None: unnamed, and then
    whoever loads it must supply the embedding and LM head)."""
    family = drafter.family
    verifier = {"name_or_path": None, "architectures": []}
    if target_dir is not None:
        target_config = json.loads((Path(target_dir) / "config.json").read_text())
        verifier = {"name_or_path": str(Path(target_dir).resolve()), "architectures": target_config["architectures"]}
    config = {
        "architectures": [FAMILIES[family].architecture],
        "speculators_model_type": family,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(drafter),
        "draft_vocab_size": drafter.config.vocab_size,
        "block_size": drafter.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in drafter.target_layer_ids],
        "mask_token_id": drafter.mask_token_id,
        "sample_from_anchor": drafter.draft_offset == 1,
        # Bidirectional inside the block on sliding layers: DFlash2's rule (speculators' default for it).
        "sliding_window_non_causal": family == "dflash2",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": family,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": drafter.num_drafts,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
    }
    if family in ("dspark", "dflash2"):
        config.update({k: v for k, v in _family_fields(drafter).items() if k != "sample_from_anchor"})
    return config


def target_head_weights(target_dir: str | os.PathLike, vocab_size: int, dtype: torch.dtype) -> dict:
    """`embed_tokens.weight` and `lm_head.weight` of the target in `target_dir` (safetensors; a tied head is the
    embedding), in `dtype`."""
    found = {}
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                for name in ("embed_tokens.weight", "lm_head.weight"):
                    if (key == name or key.endswith("." + name)) and not key.startswith("mtp."):
                        found.setdefault(name, f.get_tensor(key))
    if "embed_tokens.weight" not in found:
        raise ValueError(f"target {target_dir}: no embed_tokens.weight in its safetensors")
    found.setdefault("lm_head.weight", found["embed_tokens.weight"])
    for name, tensor in found.items():
        if tensor.shape[0] != vocab_size:
            raise ValueError(
                f"target {target_dir}: {name} has {tensor.shape[0]} rows, the drafter's vocabulary {vocab_size}"
            )
    return {name: tensor.to(dtype).contiguous() for name, tensor in found.items()}


__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "check_layout",
    "deepspec_config",
    "speculators_config",
    "target_head_weights",
    "write_layout",
]
