"""The block mask: the dense mask against the rule written out key by key, FlexAttention's predicate and BlockMask
against the dense mask, train.attention resolved per device, the drafter's layer rule, and on tiny targets the
failure signatures of a wrong mask (a leak into forbidden inputs, a train/serve mismatch)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask

from flashdraft.drafter import DFlashDraftModel
from flashdraft.drafter.attention import FLEX_BLOCK
from flashdraft.target.tiny import random_tiny_model, tiny_config
from flashdraft.train.blocks import build_blocks, sample_anchors
from flashdraft.train.masks import (
    attention_kind,
    block_mask_mod,
    dense_block_mask,
    drafter_mask,
    flex_block_mask,
    layer_mask_rules,
    mask_rule,
    visible_block_counts,
)
from tests.train import tiny_recipe
from tests.train.tiny_recipe import BS, M, train_forward

CPU, CUDA_DEVICE = torch.device("cpu"), torch.device("cuda")
CUDA = torch.cuda.is_available()


def brute_force_mask(batch, window=None, causal=False):
    """The mask rule written out key by key, positions as at inference (key index = position)."""
    B, A = batch.anchors.shape
    T, bs = batch.ctx_len, batch.block_size
    out = torch.zeros(B, 1, A * bs, T + A * bs, dtype=torch.bool)
    for b in range(B):
        for a in range(A):
            p = int(batch.anchors[b, a])
            for k in range(bs):
                q_pos = p + k
                for j in range(T):  # context key at position j
                    ok = p >= 0 and j < p
                    if window is not None:
                        ok = ok and q_pos - j < window
                    out[b, 0, a * bs + k, j] = ok
                for a2 in range(A):
                    for k2 in range(bs):
                        ok = a2 == a  # own block only (padding blocks too: never an empty row)
                        if causal:
                            ok = ok and k2 <= k
                        if window is not None:
                            ok = ok and k - k2 < window and (causal or k2 - k < window)
                        out[b, 0, a * bs + k, T + a2 * bs + k2] = ok
    return out


def small_batch():
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(2, 11, dtype=torch.long)
    loss_mask[:, :2] = 0
    return build_blocks(ids, loss_mask, [torch.tensor([2, 4, 7]), torch.tensor([5])], BS, M)


@pytest.mark.parametrize("window,causal", [(None, False), (3, True), (2, False)])
def test_dense_mask_is_the_design_rule(window, causal):
    batch = small_batch()
    dense = dense_block_mask(batch, window=window, causal=causal)
    assert dense.shape == (2, 1, 12, 11 + 12) and dense.dtype == torch.bool
    assert torch.equal(dense, brute_force_mask(batch, window, causal))
    assert dense.any(-1).all()  # no empty row (SDPA would give NaN)


@pytest.mark.parametrize("window,causal", [(None, False), (3, True)])
def test_flex_predicate_equals_dense_mask(window, causal):
    batch = small_batch()
    dense = dense_block_mask(batch, window=window, causal=causal)
    B, _, Q, K = dense.shape
    predicate = create_mask(block_mask_mod(batch, window=window, causal=causal), B, 1, Q, K, device="cpu")
    assert torch.equal(predicate, dense)
    block_mask = flex_block_mask(batch, window=window, causal=causal)
    assert torch.equal(create_mask(block_mask.mask_mod, B, 1, Q, K, device="cpu"), dense)


def random_batch(length, anchors_per_row, bs, seed):
    """Two rows of `length` tokens with a prompt, sampled anchors (the second row's padded) and Q > 128 queries."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (2, length), generator=g)
    loss_mask = torch.ones(2, length, dtype=torch.long)
    loss_mask[:, : length // 7] = 0
    anchors = [sample_anchors(loss_mask[0], anchors_per_row, bs, g), sample_anchors(loss_mask[1], 5, bs, g)]
    return build_blocks(ids, loss_mask, anchors, bs, M)


def kv_blocks(block_mask):
    """Per row of tiles, the (partial, full) tiles in both directions as sets: what FlexAttention reads of a mask."""
    out = []
    for num, idx in (
        (block_mask.kv_num_blocks, block_mask.kv_indices),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
        (block_mask.q_num_blocks, block_mask.q_indices),
        (block_mask.full_q_num_blocks, block_mask.full_q_indices),
    ):
        rows = idx.flatten(0, -2).tolist()
        out.append([sorted(row[:n]) for row, n in zip(rows, num.flatten().tolist(), strict=True)])
    return out


@pytest.mark.parametrize(
    "length,anchors,window,causal",
    [
        (301, 24, None, False),
        (517, 40, None, False),
        (301, 24, 40, True),
        (517, 40, 100, False),
        (128, 8, 16, True),
    ],  # the last: Q and T + Q whole tiles
)
def test_block_mask_from_intervals_equals_create_block_mask(length, anchors, window, causal):
    from torch.nn.attention.flex_attention import create_block_mask

    bs = 16
    batch = random_batch(length, anchors, bs, seed=length + anchors)
    B, Q = batch.anchors.shape[0], batch.block_ids.shape[1]
    rule = dict(window=window, causal=causal)
    ours = flex_block_mask(batch, **rule)
    theirs = create_block_mask(block_mask_mod(batch, **rule), B, None, Q, length + Q, device="cpu")
    assert ours.shape == theirs.shape and Q >= 128
    assert kv_blocks(ours) == kv_blocks(theirs)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    # Both kinds of tile occur: partial ones, and full ones wherever a window (< 128 here) does not rule them out.
    assert (ours.kv_num_blocks > 0).any() and bool((ours.full_kv_num_blocks > 0).any()) == (window is None)


@pytest.mark.parametrize("window,causal", [(None, False), (40, True), (100, False), (3, False)])
def test_visible_block_counts_are_the_dense_masks_tile_sums(window, causal):
    batch = random_batch(517, 40, 16, seed=7)
    dense = dense_block_mask(batch, window=window, causal=causal)  # (B, 1, Q, T + Q)
    counts = visible_block_counts(batch, batch.ctx_len, window=window, causal=causal)
    B, _, Q, K = dense.shape
    pad = F.pad(dense.long(), (0, -K % FLEX_BLOCK, 0, -Q % FLEX_BLOCK))
    tiles = pad.view(B, 1, pad.shape[2] // FLEX_BLOCK, FLEX_BLOCK, pad.shape[3] // FLEX_BLOCK, FLEX_BLOCK)
    assert torch.equal(counts, tiles.sum((3, 5)))


def test_flex_attention_matches_sdpa_with_dense_mask_on_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    batch = small_batch()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 12, 8, generator=g)
    k, v = (torch.randn(2, 2, 23, 8, generator=g) for _ in range(2))
    flex = flex_attention(q, k, v, block_mask=flex_block_mask(batch))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(batch))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


# ---- train.attention and the drafter's layer rule ----------------------------------------------------------------


def test_attention_kind_per_device():
    assert attention_kind("auto", CPU) == "sdpa" and attention_kind("auto", CUDA_DEVICE) == "flex"
    assert attention_kind("sdpa", CUDA_DEVICE) == "sdpa" and attention_kind("flex", CUDA_DEVICE) == "flex"
    with pytest.raises(ValueError, match="train.attention = flex needs a CUDA device"):
        attention_kind("flex", CPU)
    with pytest.raises(ValueError, match="train.attention = 'dense'"):
        attention_kind("dense", CPU)


def test_layer_mask_rules():
    drafter = DFlashDraftModel.from_target(
        random_tiny_model("qwen3", 4).config,
        num_layers=2,
        block_size=BS,
        target_layer_ids=[1, 2],
        mask_token_id=M,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    assert layer_mask_rules(drafter.config) == [{"window": 3, "causal": True}, {"window": None, "causal": False}]


def _drafter(**overrides):
    torch.manual_seed(0)
    return DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=8), num_layers=2, block_size=4, mask_token_id=5, **overrides
    )


def _batch():
    ids = torch.arange(30).view(2, 15) % 11 + 6
    loss_mask = torch.ones_like(ids)
    return build_blocks(ids, loss_mask, [torch.tensor([2, 5, 9]), torch.tensor([4])], 4, mask_token_id=5)


def test_mask_follows_the_layers_rule():
    full, sliding = _drafter(), _drafter(layer_types=["sliding_attention"] * 2, sliding_window=3)
    batch = _batch()
    assert mask_rule(full.config) == {"window": None, "causal": False}
    assert mask_rule(sliding.config) == {"window": 3, "causal": True}
    assert torch.equal(drafter_mask(batch, full.config, "sdpa"), dense_block_mask(batch))
    dense = drafter_mask(batch, sliding.config, "sdpa")
    assert torch.equal(dense, dense_block_mask(batch, window=3, causal=True))
    assert not torch.equal(dense, dense_block_mask(batch))
    block = drafter_mask(batch, sliding.config, "flex")
    assert isinstance(block, BlockMask)
    B, _, Q, K = dense.shape
    assert torch.equal(create_mask(block.mask_mod, B, 1, Q, K, device="cpu"), dense)


def test_mixed_layer_rules_are_a_clear_error():
    mixed = _drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    with pytest.raises(ValueError, match="drafter.overrides.layer_types"):
        mask_rule(mixed.config)


# ---- failure signatures on tiny targets ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=tiny_recipe.FAMILIES)
def setup(request):
    return tiny_recipe.build(request.param)


def rows(a):
    return slice(a * BS, (a + 1) * BS)


def check_one_block(drafter, batch, features, noise, base, b, a):
    """Perturb one input at a time; block a of sequence b must change exactly when the mask lets it see it."""
    p = int(batch.anchors[b, a])

    def changed(features=features, noise=noise):
        out = train_forward(drafter, batch, features, noise)
        return not torch.equal(out[b, rows(a)], base[b, rows(a)])

    def bump_feature(pos):
        bumped = features.clone()
        bumped[b, pos] += 1.0
        return bumped

    def bump_noise(index):
        bumped = noise.clone()
        bumped[b, index] += 1.0
        return bumped

    # Forbidden: the anchor's own target state, anything later, any other block (padding included).
    assert not changed(features=bump_feature(p)), "block sees the target state at its anchor"
    assert not changed(features=bump_feature(slice(p, None))), "block sees later context"
    for other in range(batch.anchors.shape[1]):
        if other != a:
            assert not changed(noise=bump_noise(rows(other))), f"block {a} sees block {other}"
    # Allowed: the context right before the anchor; its own block, both ways (last token → every position).
    assert changed(features=bump_feature(p - 1))
    out = train_forward(drafter, batch, features, bump_noise(a * BS + BS - 1))
    assert not torch.isclose(out[b, a * BS], base[b, a * BS]).all()


def test_mask_blocks_every_leak_and_keeps_every_allowed_input(setup):
    target, drafter, _, batch, features = setup
    noise = target.embed(batch.block_ids)
    with torch.no_grad():
        base = train_forward(drafter, batch, features, noise)
        for b, a in [(0, 0), (0, 2), (1, 1)]:
            check_one_block(drafter, batch, features, noise, base, b, a)


def inference_forward(drafter, target, batch, features, b, a):
    """The drafter as the speculative-decoding loop calls it: context = features[:p], block at p..p+bs-1, no mask."""
    p = int(batch.anchors[b, a])
    return drafter(
        position_ids=torch.arange(p + BS)[None],
        noise_embedding=target.embed(batch.block_ids[b : b + 1, rows(a)]),
        target_hidden=features[b : b + 1, :p],
    )[0]


def test_train_output_equals_inference_output(setup):
    target, drafter, _, batch, features = setup
    with torch.no_grad():
        train = train_forward(drafter, batch, features, target.embed(batch.block_ids))
        assert torch.isfinite(train).all()  # padding blocks included
        for b, a in [(0, 0), (0, 1), (0, 3), (1, 0), (1, 1)]:
            serve = inference_forward(drafter, target, batch, features, b, a)
            torch.testing.assert_close(train[b, rows(a)], serve, rtol=1e-10, atol=1e-10)


def test_train_output_equals_inference_output_sliding_drafter(setup):
    target, _, _, batch, features = setup
    torch.manual_seed(4)
    drafter = DFlashDraftModel.from_target(
        target.config,
        num_layers=2,
        block_size=BS,
        target_layer_ids=target.target_layer_ids,
        mask_token_id=M,
        layer_types=["sliding_attention"] * 2,
        sliding_window=3,
    ).double()
    (rule,) = {tuple(r.items()) for r in layer_mask_rules(drafter.config)}
    with torch.no_grad():
        noise = target.embed(batch.block_ids)
        train = train_forward(drafter, batch, features, noise, **dict(rule))
        full = train_forward(drafter, batch, features, noise)
        for b, a in [(0, 2), (1, 1)]:
            serve = inference_forward(drafter, target, batch, features, b, a)
            torch.testing.assert_close(train[b, rows(a)], serve, rtol=1e-10, atol=1e-10)
            assert not torch.allclose(full[b, rows(a)], serve)  # the full-attention mask would be a mismatch


# ---- the GPU path (the H200; skipped elsewhere) --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_flex_attention_matches_dense_sdpa_on_gpu():
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(5)
    length, bs = 301, 16
    ids = torch.randint(0, 1000, (2, length), generator=g)
    loss_mask = torch.ones(2, length, dtype=torch.long)
    loss_mask[:, :40] = 0
    anchors = [sample_anchors(loss_mask[0], 24, bs, g), sample_anchors(loss_mask[1], 9, bs, g)]
    batch = build_blocks(ids, loss_mask, anchors, bs, M).to("cuda")
    q = torch.randn(2, 4, 24 * bs, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, 4, length + 24 * bs, 64, device="cuda", requires_grad=True) for _ in range(2))
    block_mask = flex_block_mask(batch)
    out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(batch))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
