"""Exact cache rollback: after verifying 8 tokens and keeping k of them, decoding continues as if the 8 - k
rejected tokens had never been seen — equal to a forward without cache, in float64, to 1e-10."""

import inspect

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from flashdraft.speculative import rollback
from flashdraft.target.tiny import ALL_FAMILIES, HYBRID_FAMILIES
from flashdraft.versions import cache_kwargs

from . import one_thread, ready, tiny_target  # noqa: F401 (one_thread: autouse fixture)

PREFIX, BLOCK, AFTER = 13, 8, 3
# transformers 5.25 can record a linear-attention layer's intermediate recurrent states, which makes its own crop
# exact; before, crop rewinds only the conv window.
RECORDS_RECURRENT_STATES = (
    "recurrent_states_to_keep" in inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
)


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def target(request):
    model = tiny_target(request.param, seed=1)
    with ready(model):
        yield model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, PREFIX + BLOCK + AFTER), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _ours(target, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Prefill, verify a block of 8, keep `keep`, then feed what the cache lacks plus AFTER more tokens."""
    cache = rollback.new_cache(target)
    target(ids[:, :PREFIX], use_cache=True, **cache_kwargs(cache))
    snap = rollback.take_snapshot(cache)
    target(ids[:, PREFIX : PREFIX + BLOCK], use_cache=True, **cache_kwargs(cache))
    committed = PREFIX + rollback.rollback(cache, snap, keep)
    assert rollback.kv_length(cache) == committed
    return target(ids[:, committed : PREFIX + keep + AFTER], use_cache=True, **cache_kwargs(cache)).logits[:, -AFTER:]


@torch.inference_mode()
def _transformers_crop(target, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """The same with transformers' activate_past_recording() + crop()."""
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording(**({"recurrent_states_to_keep": BLOCK} if RECORDS_RECURRENT_STATES else {}))
    target(ids[:, :PREFIX], use_cache=True, **cache_kwargs(cache))
    cache.crop(0)
    target(ids[:, PREFIX : PREFIX + BLOCK], use_cache=True, **cache_kwargs(cache))
    cache.crop(keep - BLOCK)
    return target(ids[:, PREFIX + keep : PREFIX + keep + AFTER], use_cache=True, **cache_kwargs(cache)).logits[
        :, -AFTER:
    ]


@torch.inference_mode()
def _no_cache(target, ids: torch.Tensor, keep: int) -> torch.Tensor:
    return target(ids[:, : PREFIX + keep + AFTER]).logits[:, -AFTER:]


def test_rollback_equals_a_forward_without_cache(target):
    family = target.config.model_type
    hybrid = any(t == "linear_attention" for t in getattr(target.config, "layer_types", []) or [])
    ids = _ids()
    ours_err, crop_err = [], []
    for keep in range(BLOCK + 1):
        expected = _no_cache(target, ids, keep)
        ours_err.append((_ours(target, ids, keep) - expected).abs().max().item())
        crop_err.append((_transformers_crop(target, ids, keep) - expected).abs().max().item())
    print(f"\n{family}: max |logit error| per kept k=0..8")
    print("  ours:            " + " ".join(f"{e:.1e}" for e in ours_err))
    print("  transformers crop: " + " ".join(f"{e:.1e}" for e in crop_err))
    assert max(ours_err) <= 1e-10
    if hybrid and not RECORDS_RECURRENT_STATES:
        # crop leaves the recurrent state advanced over the rejected tokens: wrong unless all 8 are kept.
        assert min(crop_err[:BLOCK]) > 1e-6 and min(crop_err[:BLOCK]) > 1e4 * max(ours_err)
        assert crop_err[BLOCK] <= 1e-10
    else:  # plain caches, and 5.25's recorded recurrent states (a copy per verified token and layer)
        assert max(crop_err) <= 1e-10


def test_rollback_reports_what_the_cache_kept(target):
    hybrid = rollback.is_hybrid(rollback.new_cache(target))
    ids = _ids(1)
    with torch.inference_mode():
        cache = rollback.new_cache(target)
        target(ids[:, :PREFIX], use_cache=True, **cache_kwargs(cache))
        snap = rollback.take_snapshot(cache)
        target(ids[:, PREFIX : PREFIX + 4], use_cache=True, **cache_kwargs(cache))
        assert rollback.rollback(cache, snap, 2) == (0 if hybrid else 2)
        assert rollback.kv_length(cache) == PREFIX + (0 if hybrid else 2)
        with pytest.raises(ValueError, match="keep must be in"):
            rollback.rollback(cache, snap, 99)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_rollback_puts_back_the_length_the_model_reads(family):
    """The model takes the positions of new tokens from `cache.get_seq_length()`: a rollback must restore it."""
    model = tiny_target(family, seed=3)
    ids = _ids(3)
    with ready(model), torch.inference_mode():
        cache = rollback.new_cache(model)
        model(ids[:, :PREFIX], use_cache=True, **cache_kwargs(cache))
        snap = rollback.take_snapshot(cache)
        model(ids[:, PREFIX : PREFIX + 4], use_cache=True, **cache_kwargs(cache))
        rollback.rollback(cache, snap, 2)
        assert int(cache.get_seq_length()) == rollback.kv_length(cache) == PREFIX


@pytest.mark.parametrize("family", HYBRID_FAMILIES[:1])
def test_snapshot_buffers_are_reused_and_independent_of_in_place_updates(family):
    """The single-token decode path updates the conv state in place; a snapshot must not alias it."""
    model = tiny_target(family, seed=2)
    ids = _ids(2)
    with ready(model), torch.inference_mode():
        cache = rollback.new_cache(model)
        model(ids[:, :PREFIX], use_cache=True, **cache_kwargs(cache))
        snap = rollback.take_snapshot(cache)
        buffers = {key: t.data_ptr() for key, t in snap.conv.items()}
        model(ids[:, PREFIX : PREFIX + 1], use_cache=True, **cache_kwargs(cache))
        rollback.rollback(cache, snap, 0)
        expected = model(ids[:, : PREFIX + 1]).logits[:, -1]
        got = model(ids[:, PREFIX : PREFIX + 1], use_cache=True, **cache_kwargs(cache)).logits[:, -1]
        assert (got - expected).abs().max().item() <= 1e-10
        again = rollback.take_snapshot(cache, reuse=snap)
        assert again is snap and {key: t.data_ptr() for key, t in snap.conv.items()} == buffers


def test_unsupported_cache_layers_are_refused():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        rollback.take_snapshot(cache)
