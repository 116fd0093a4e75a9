"""The target's own multi-token-prediction (MTP) layer: read it from the checkpoint, build it, run it.

    head = load_mtp(target, "path/to/Qwen3.5-27B")     # MTPHead in the target's dtype and device
    has_mtp("path/to/Qwen3.5-27B")                      # whether the checkpoint ships one

Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints carry one extra decoder layer that transformers skips at load
(`_keys_to_ignore_on_load_unexpected = ["^mtp.*"]`). What the serving engines (vLLM's Qwen3.5 / Qwen3-Next MTP
models, SGLang's NEXTN) read and run:

- tensors at the checkpoint's top level, also in the multimodal layout whose text weights sit under
  `model.language_model.`: `mtp.fc.weight` (D x 2D, no bias), `mtp.pre_fc_norm_embedding.weight`,
  `mtp.pre_fc_norm_hidden.weight`, `mtp.layers.0.*` (a full-attention decoder layer of the target's own kind —
  gated attention, q/k norms, a dense or MoE MLP — named as the target's layers are), `mtp.norm.weight`; the
  norms are the target's (Qwen3.5's zero-centred `1 + w` RMSNorm). No embedding and no LM head: both are the
  target's. The config says `mtp_num_hidden_layers: 1` (in `text_config` for the multimodal layout; vLLM also
  reads `num_nextn_predict_layers`).
- at position p: `x = fc(cat[norm_emb(embed(token p + 1)), norm_hidden(h_p)])` through the layer (rotary position
  p, causal attention over the MTP layer's own cache of the positions it has seen), then `mtp.norm`, then the
  target's LM head, which predicts token p + 2. h_p is the target's hidden state *after* its final norm — the
  LM head's input, which both engines hand to the draft model — and, for the second and later drafts of a chain,
  the MTP layer's own output of the previous step.

Only one MTP layer is supported (what the released checkpoints ship); dedicated MTP embeddings are refused.
`write_mtp` adds a head to a single-file checkpoint under the same names (how the bundled target carries its own).
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache

from flashdraft.drafter.config import target_text_config
from flashdraft.io.atomic import atomic_directory

PREFIX = "mtp."
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
# Config fields that state the number of MTP layers: Qwen3.5 / Qwen3.6 / Qwen3-Next's, and vLLM's other name for it.
LAYER_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


class MTPHead(nn.Module):
    """One MTP decoder layer with its input fusion and output norm; the embedding, LM head and rotary embedding
    stay the target's (passed in), so `state_dict()` holds exactly the checkpoint's `mtp.*` tensors."""

    def __init__(self, config, decoder_layer: type[nn.Module], norm: type[nn.Module]):
        super().__init__()
        self.config = config
        size, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.pre_fc_norm_embedding = norm(size, eps=eps)
        self.pre_fc_norm_hidden = norm(size, eps=eps)
        self.layers = nn.ModuleList([decoder_layer(config, 0)])
        self.norm = norm(size, eps=eps)
        # The decoder layer's cache keyword: `cache` in the newer transformers releases, `past_key_values` before.
        parameters = inspect.signature(self.layers[0].forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"

    @classmethod
    def for_target(cls, target: nn.Module) -> MTPHead:
        """An MTP head shaped for `target` (randomly initialised; `load_mtp` fills it), in the target's dtype."""
        decoder = target.get_decoder()
        head = cls(mtp_config(target), type(decoder.layers[0]), type(decoder.norm))
        parameter = next(target.parameters())
        return head.to(dtype=parameter.dtype, device=parameter.device)

    def new_cache(self) -> DynamicCache:
        """An empty cache for the MTP layer's keys and values (one full-attention layer)."""
        return DynamicCache(config=self.config)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(B, T, D)` token embeddings (of tokens p + 1) and hidden states (at p) -> `(B, T, D)` normed outputs.

        position_embeddings: the target's rotary embedding of `position_ids` (`(B, T)`, the positions p). With a
        `cache`, the new keys and values are appended to it and the queries also attend to what it holds.
        attention_mask: a boolean `(1, 1, T, T + cached)` mask instead of the causal one (`chained` training)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = _causal_mask(x.shape[1], past, x.device)
        x = self.layers[0](
            x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            **{self._cache_keyword: cache},
        )
        return self.norm(x)


def _causal_mask(length: int, past: int, device: torch.device) -> torch.Tensor | None:
    """Query i (at past + i) sees keys 0 .. past + i; None where SDPA's own causal flag is exact (no past) or
    nothing needs masking (one query)."""
    if past == 0 or length == 1:
        return None
    keys = torch.arange(past + length, device=device)
    queries = torch.arange(past, past + length, device=device)
    return (keys[None, :] <= queries[:, None])[None, None]


def mtp_config(target: nn.Module):
    """The MTP layer's config: the target's text config with one full-attention layer (SDPA, boolean masks)."""
    config = copy.deepcopy(target_text_config(target.config))
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    config._attn_implementation = "sdpa"
    return config


def rotary_embedding(target: nn.Module, x: torch.Tensor, positions: torch.Tensor):
    """The target's rotary embedding (cos, sin) of `(B, T)` positions. Qwen3.5's multimodal RoPE reads them per
    axis, `(3, B, T)`, text tokens at the same position on all three; some transformers releases (5.17) no longer
    expand `(B, T)` themselves."""
    rotary = target.get_decoder().rotary_emb
    if hasattr(rotary, "mrope_section"):
        positions = positions[None].expand(3, *positions.shape)
    return rotary(x, positions)


def teacher_forced(head: MTPHead, target: nn.Module, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP layer over whole sequences, as trained: `(B, T)` token ids and the target's final-normed hidden
    states `(B, T, D)` -> `(B, T - 1, D)` outputs at positions 0 .. T - 2, whose logits predict tokens 2 .. T."""
    embeds = target.get_input_embeddings()(input_ids[:, 1:])
    positions = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    return head(embeds, hidden[:, :-1], rotary_embedding(target, embeds, positions), positions)


def chained(
    head: MTPHead, target: nn.Module, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The MTP layer over whole sequences as serving chains it, `steps` drafts deep: per step, `(B, n, D)` outputs
    at anchors 0 .. n - 1, n = T - steps - 1.

    Step k (1-based) at anchor i reads the embedding of token i + k and, for k > 1, the layer's own step-(k - 1)
    output at i (for k = 1, the target's hidden state at i), sits at position i + k - 1, and attends to what the
    serving cache holds then: step 1's entries of positions 0 .. i and this chain's own entries of steps 2 .. k.
    Its logits predict token i + k + 1, which exists for every step at these anchors. The tokens read at steps > 1
    are the sequence's own (teacher forcing: a later draft only counts if the ones before it were right). Step 1 is
    `teacher_forced` on the first n positions.
    """
    batch, length = input_ids.shape
    n = length - steps - 1
    if n < 1:
        raise ValueError(f"chained: sequences of {length} tokens are too short for {steps} steps")
    device = input_ids.device
    embed = target.get_input_embeddings()
    anchors = torch.arange(n, device=device)
    inputs, positions, outputs = [], [], []
    for k in range(1, steps + 1):
        inputs.append(embed(input_ids[:, k : k + n]))
        positions.append(anchors + (k - 1))
        embeds = torch.cat(inputs, dim=1)
        previous = [hidden[:, :n]] + outputs  # step k reads step k - 1's output at the same anchor
        pos = torch.cat(positions)[None].expand(batch, -1)
        out = head(
            embeds,
            torch.cat(previous, dim=1),
            rotary_embedding(target, embeds, pos),
            pos,
            attention_mask=_chain_mask(n, k, device),
        )
        outputs.append(out[:, -n:])
    return outputs


def _chain_mask(n: int, steps: int, device: torch.device) -> torch.Tensor:
    """Entries (step s, anchor i), s-major: step 1 is causal over its anchors; (s > 1, i) sees step 1's anchors
    0 .. i and its own chain's entries of steps 2 .. s."""
    step = torch.arange(steps, device=device).repeat_interleave(n)
    anchor = torch.arange(n, device=device).repeat(steps)
    first = (step[None, :] == 0) & (anchor[None, :] <= anchor[:, None])
    same_chain = (step[None, :] > 0) & (step[None, :] <= step[:, None]) & (anchor[None, :] == anchor[:, None])
    return (first | same_chain)[None, None]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def mtp_tensor_files(directory: str | Path) -> dict[str, Path]:
    """Name -> safetensors file of every `mtp.*` tensor of a checkpoint directory (sharded via its index json,
    or every `*.safetensors` file in it). Only the files' headers are read."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return {name: directory / file for name, file in weight_map.items() if name.startswith(PREFIX)}
    found: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found.update({name: file for name in f.keys() if name.startswith(PREFIX)})
    return found


def has_mtp(directory: str | Path) -> bool:
    """Whether the checkpoint in `directory` ships MTP weights."""
    return bool(mtp_tensor_files(directory))


def require_mtp(directory: str | Path) -> dict[str, Path]:
    """`mtp_tensor_files(directory)`, or a ValueError saying that the checkpoint has no MTP weights."""
    files = mtp_tensor_files(directory)
    if not files:
        raise ValueError(
            f"target checkpoint {directory} has no MTP weights (no 'mtp.*' tensors in its safetensors files); "
            "MTP decoding (`flashdraft eval --baselines mtp`) needs a checkpoint that ships its MTP layer, as "
            "Qwen3.5, Qwen3.6 and Qwen3-Next do"
        )
    return files


def declared_mtp_layers(directory: str | Path) -> int | None:
    """The number of MTP layers `config.json` declares (top level or `text_config`), or None if it says nothing."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return None
    config = _read_json(config_path)
    for section in (config.get("text_config") or {}, config):
        for key in LAYER_FIELDS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def load_mtp(target: nn.Module, directory: str | Path) -> MTPHead:
    """The MTP head of the checkpoint in `directory` (the one `target` was loaded from), in the target's dtype and
    device. A checkpoint without MTP weights, or with ones that do not fit the target, raises a ValueError naming
    the directory and the tensors."""
    directory = Path(directory)
    files = require_mtp(directory)
    layer_ids = sorted({name.split(".")[2] for name in files if name.startswith(PREFIX + "layers.")})
    if layer_ids != ["0"]:
        raise ValueError(f"{directory}: MTP layers {layer_ids} in the weights; flashdraft runs exactly one (layer 0)")
    declared = declared_mtp_layers(directory)
    if declared not in (None, 0, 1):
        raise ValueError(f"{directory}/config.json: declares {declared} MTP layers; flashdraft runs exactly one")
    if PREFIX + "embed_tokens.weight" in files:
        raise ValueError(f"{directory}: the MTP layer has its own embedding (mtp.embed_tokens); not supported")

    head = MTPHead.for_target(target)
    expected = head.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if files.get(name) == file:
                    loaded[name.removeprefix(PREFIX)] = f.get_tensor(name)
    loaded = _fuse_experts(loaded)
    problems = [f"missing {PREFIX}{k}" for k in sorted(set(expected) - set(loaded))]
    problems += [f"unexpected {PREFIX}{k}" for k in sorted(set(loaded) - set(expected))]
    problems += [
        f"{PREFIX}{k}: {tuple(loaded[k].shape)}, expected {tuple(v.shape)}"
        for k, v in expected.items()
        if k in loaded and loaded[k].shape != v.shape
    ]
    if problems:
        raise ValueError(f"{directory}: the MTP weights do not fit the target:\n  " + "\n  ".join(problems[:12]))
    head.load_state_dict(loaded)
    return head.eval().requires_grad_(False)


def _fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE tensors (`mlp.experts.E.{gate,up,down}_proj.weight`, as Qwen3-Next ships them) -> the fused
    `mlp.experts.gate_up_proj` (E, 2I, D: gate rows, then up rows) and `mlp.experts.down_proj` (E, D, I) that
    transformers' MoE layers hold (its own conversion of these checkpoints does the same); fused weights pass."""
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        at = parts.index("experts") if "experts" in parts else -1
        if 0 <= at < len(parts) - 3 and parts[at + 1].isdigit() and parts[-1] == "weight":
            per_expert.setdefault((".".join(parts[: at + 1]), parts[at + 2]), {})[int(parts[at + 1])] = tensor
        else:
            out[name] = tensor
    for (prefix, projection), experts in per_expert.items():
        ids = sorted(experts)
        if projection == "down_proj":
            out[f"{prefix}.down_proj"] = torch.stack([experts[e] for e in ids])
        elif projection == "gate_proj":
            ups = per_expert.get((prefix, "up_proj"), {})
            if sorted(ups) != ids:
                raise ValueError(f"{PREFIX}{prefix}: gate_proj and up_proj are given for different experts")
            out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e], ups[e]]) for e in ids])
        elif projection != "up_proj":
            out.update({f"{prefix}.{e}.{projection}.weight": experts[e] for e in ids})
    return out


def write_mtp(checkpoint: str | Path, head: MTPHead, out: str | Path | None = None) -> Path:
    """The single-file checkpoint `checkpoint` with `head`'s tensors added as `mtp.*` to its model.safetensors and
    `mtp_num_hidden_layers: 1` in its config.json (in `text_config` when there is one), written to `out` (default:
    `checkpoint` itself) as one atomic directory swap. MTP tensors already there are replaced; other files are
    copied unchanged."""
    checkpoint = Path(checkpoint)
    out = checkpoint if out is None else Path(out)
    weights_path = checkpoint / WEIGHTS
    if not weights_path.is_file() or (checkpoint / INDEX).exists():
        raise ValueError(f"{checkpoint}: expected a single-file checkpoint ({WEIGHTS}, no {INDEX})")
    with safe_open(weights_path, framework="pt") as f:
        metadata = f.metadata() or {"format": "pt"}
    weights = {name: t for name, t in load_file(weights_path).items() if not name.startswith(PREFIX)}
    weights.update({PREFIX + name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()})
    config = _read_json(checkpoint / "config.json")
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    with atomic_directory(out, fsync=True) as tmp:
        for file in checkpoint.iterdir():
            if file.is_file() and file.name not in (WEIGHTS, "config.json"):
                shutil.copy2(file, tmp / file.name)
        save_file(weights, str(tmp / WEIGHTS), metadata=metadata)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
    return out
