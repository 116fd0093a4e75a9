"""Exact rollback of a target's cache after a speculative verification.

A verification forward appends a whole block to the cache; only a prefix of it is accepted. Attention layers
store one key/value row per token, so cropping the rows of the rejected tokens restores them exactly. A
Gated DeltaNet layer (qwen3_5, qwen3_5_moe, qwen3_next) folds every token into two fixed-size states — the last
`W` conv inputs and the delta-rule matrix — and the fold cannot be undone exactly. transformers'
`activate_past_recording()` + `crop()` rewinds the conv window but leaves the recurrent state advanced over the
rejected tokens (next-logit errors of 1e-4 to 1e-2 on the tiny targets, even in float64; see tests/spec).

So before a verification we copy the linear-attention states (`take_snapshot`), and afterwards `rollback` either
keeps everything (all accepted: no copy back) or puts the copy back and crops the attention layers to the same
point. The accepted tokens are then *not* in the cache; the decoding loop feeds them again at the front of the
next verification (see `flashdraft.speculative.generate`), which advances the states over exactly the accepted tokens
without an extra forward. Caches without linear-attention layers roll back to any prefix by cropping.

Supported cache layers: transformers' `DynamicLayer` (full attention), `LinearAttentionLayer`,
`LinearAttentionAndFullAttentionLayer` and `DummyLayer` (5.23+: a layer that caches nothing). Anything else
(sliding-window, static, quantized) raises: those need their own exact rollback, and a silent approximation is
what this module exists to avoid. From transformers 5.25 a linear-attention layer also counts its tokens
(`cumulative_length_linear`, what the model reads its positions from): the snapshot restores it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

# Layer classes whose key/value rows we crop by slicing. Subclasses (sliding window, indexed, quantized) keep
# other bookkeeping, so only these exact types are accepted.
_KV_TYPES = ("DynamicLayer", "LinearAttentionAndFullAttentionLayer")
_LINEAR_TYPES = ("LinearAttentionLayer", "LinearAttentionAndFullAttentionLayer")
_EMPTY_TYPES = ("DummyLayer",)


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache laid out for `model` (linear-attention layers get conv/recurrent state slots)."""
    return DynamicCache(config=model.config)


def _check_supported(cache: DynamicCache) -> None:
    for idx, layer in enumerate(cache.layers):
        name = type(layer).__name__
        if name not in _KV_TYPES + _LINEAR_TYPES + _EMPTY_TYPES:
            raise ValueError(
                f"cache layer {idx} is a {name}; exact rollback supports "
                f"{sorted(set(_KV_TYPES + _LINEAR_TYPES + _EMPTY_TYPES))} "
                "(a sliding-window or static cache needs its own snapshot)"
            )
        if getattr(layer, "record_past", False):
            raise ValueError(
                f"cache layer {idx} records past states (activate_past_recording was called); flashdraft's rollback "
                "needs the default fixed-size conv window"
            )


def _has_kv(layer) -> bool:
    return isinstance(layer, DynamicLayer)


def _has_linear(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def kv_length(cache: DynamicCache) -> int:
    """Number of tokens held by the attention layers (0 for an empty cache)."""
    for layer in cache.layers:
        if _has_kv(layer):
            return layer.get_seq_length()
    return 0


def is_hybrid(cache: DynamicCache) -> bool:
    """Whether `cache` has linear-attention layers (which only roll back by snapshot)."""
    return any(_has_linear(layer) for layer in cache.layers)


def crop_kv(cache: DynamicCache, length: int) -> None:
    """Drop the key/value rows of every attention layer after the first `length` tokens (exact)."""
    for layer in cache.layers:
        if _has_kv(layer) and layer.get_seq_length() > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@dataclass
class CacheSnapshot:
    """The state of a cache before a verification: attention length and copies of the linear-attention states.

    The copies live in buffers that `take_snapshot(cache, reuse=old)` fills again, so a decoding loop allocates
    them once.
    """

    length: int
    hybrid: bool
    # (layer index, state index) -> copy; a state that was not yet initialised is absent.
    conv: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    recurrent: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    has_previous: dict[tuple[int, int], bool] = field(default_factory=dict)
    # layer index -> copy of its token count (transformers 5.25+ linear-attention layers; a device tensor).
    linear_length: dict[int, torch.Tensor] = field(default_factory=dict)


def _copy_into(buffers: dict, key, src: torch.Tensor) -> None:
    buf = buffers.get(key)
    if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.device != src.device:
        buffers[key] = src.clone()
    else:
        buf.copy_(src)


def take_snapshot(cache: DynamicCache, reuse: CacheSnapshot | None = None) -> CacheSnapshot:
    """Record `cache` so that `rollback` can return to exactly this point.

    Costs one copy of the linear-attention states (none for plain attention caches). Pass the previous
    snapshot as `reuse` to refill its buffers instead of allocating new ones.
    """
    _check_supported(cache)
    hybrid = is_hybrid(cache)
    snap = reuse if reuse is not None else CacheSnapshot(0, hybrid)
    snap.length, snap.hybrid = kv_length(cache), hybrid
    snap.has_previous.clear()
    for idx, layer in enumerate(cache.layers):
        if not _has_linear(layer):
            continue
        count = getattr(layer, "cumulative_length_linear", None)
        if count is not None:
            _copy_into(snap.linear_length, idx, count)
        for s in range(layer.number_of_states):
            snap.has_previous[idx, s] = layer.has_previous_state[s]
            if layer.is_conv_states_initialized[s]:
                _copy_into(snap.conv, (idx, s), layer.conv_states[s])
            if layer.is_recurrent_states_initialized[s]:
                _copy_into(snap.recurrent, (idx, s), layer.recurrent_states[s])
    return snap


def restore(cache: DynamicCache, snap: CacheSnapshot) -> None:
    """Put `cache` back exactly as it was when `snap` was taken."""
    crop_kv(cache, snap.length)
    for idx, layer in enumerate(cache.layers):
        if not _has_linear(layer):
            continue
        for s in range(layer.number_of_states):
            # Copy into the live tensors rather than rebinding them: the conv state is updated in place by
            # `causal_conv1d_update`, and static addresses matter for CUDA graphs.
            if (idx, s) in snap.conv:
                layer.conv_states[s].copy_(snap.conv[idx, s])
            elif layer.is_conv_states_initialized[s]:
                layer.conv_states[s].zero_()
            if (idx, s) in snap.recurrent:
                layer.recurrent_states[s].copy_(snap.recurrent[idx, s])
            elif layer.is_recurrent_states_initialized[s]:
                layer.recurrent_states[s].zero_()
            layer.has_previous_state[s] = snap.has_previous.get((idx, s), False)
        if idx in snap.linear_length:
            layer.cumulative_length_linear.copy_(snap.linear_length[idx])


def rollback(cache: DynamicCache, snap: CacheSnapshot, keep: int, appended: int | None = None) -> int:
    """After forwards that appended `appended` tokens to the state `snap` recorded, keep only the first `keep`.

    Returns how many of the `keep` tokens are now in the cache: `keep` for plain attention caches (cropped)
    and when all are kept; 0 for a hybrid cache otherwise (restored to `snap`) — the caller must feed those
    tokens again before anything else. `appended` defaults to the growth of the attention layers.
    """
    if appended is None:
        appended = kv_length(cache) - snap.length
    if not 0 <= keep <= appended:
        raise ValueError(f"keep must be in [0, {appended}] (tokens appended since the snapshot), got {keep}")
    if keep == appended:
        return keep
    if not snap.hybrid:
        crop_kv(cache, snap.length + keep)
        return keep
    restore(cache, snap)
    return 0
