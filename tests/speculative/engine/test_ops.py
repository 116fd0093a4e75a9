"""The engine's attention against a float64 softmax attention: over a static cache (short and chunked caches) and a
prefill's causal attention."""

import pytest
import torch

from flashdraft.speculative.engine import ops


def _reference(query, keys, values, visible, scale):
    heads, length, dim = query.shape
    groups = heads // keys.shape[0]
    k, v = (t.double().repeat_interleave(groups, dim=0) for t in (keys, values))
    scores = torch.einsum("htd,hsd->hts", query.double(), k) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hts,hsd->htd", probs, v).transpose(0, 1).reshape(length, heads * dim)


# Error relative to the largest output: float32 to rounding; bfloat16 (scores, probabilities and partial sums
# rounded to 8 bits) measured 2e-3 to 7e-3 on these inputs.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("slots", [37, ops.CHUNKED_FROM, ops.CHUNKED_FROM + 3 * ops.ATTENTION_CHUNK])
@pytest.mark.parametrize("length", [1, 5])
def test_cached_attention_matches_float64(slots, length, dtype):
    g = torch.Generator().manual_seed(slots + length)
    heads, kv_heads, dim = 6, 2, 8
    query = torch.randn(heads, length, dim, generator=g).to(dtype)
    keys, values = (torch.randn(kv_heads, slots, dim, generator=g).to(dtype) for _ in range(2))
    # Each query sees a prefix of the slots ending at a random place (as `slot <= position` does).
    ends = torch.randint(1, slots + 1, (length,), generator=g)
    visible = torch.arange(slots)[None] < ends[:, None]
    got = ops.cached_attention(query, keys, values, visible, 0.3)
    want = _reference(query, keys, values, visible, 0.3)
    assert got.shape == want.shape == (length, heads * dim) and got.dtype == dtype
    assert (got.double() - want).abs().max() < TOLERANCE[dtype] * want.abs().max()


def test_attention_slots_are_chunk_multiples_only_when_chunked():
    assert ops.attention_slots(100) == 100
    assert ops.attention_slots(ops.CHUNKED_FROM + 1) % ops.ATTENTION_CHUNK == 0
    assert (
        ops.CHUNKED_FROM + 1 <= ops.attention_slots(ops.CHUNKED_FROM + 1) < ops.CHUNKED_FROM + 1 + ops.ATTENTION_CHUNK
    )


def test_prefill_attention_is_causal_and_never_takes_cudnn(monkeypatch):
    """A prefill's attention (grouped heads) equals a float64 causal softmax attention, and runs with cuDNN's
    attention switched off: cuDNN builds a plan per sequence length, which every prompt of a new length paid."""
    seen = []
    sdpa = ops.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", recording)
    g = torch.Generator().manual_seed(11)
    query = torch.randn(6, 9, 8, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = ops.causal_attention(query, keys, values, 0.3)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(got, _reference(query, keys, values, causal, 0.3), rtol=1e-12, atol=1e-12)
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
