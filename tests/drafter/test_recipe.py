"""The DFlash recipe: anchors, packed blocks, the block mask (dense == flex), the chunked loss, and the known
failure signatures on tiny qwen3 and qwen3_5 targets (mask leaks, feature/position off-by-one, train/serve mismatch).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from flashdraft.drafter import DFlashDraftModel
from flashdraft.drafter.recipe import (
    IGNORE_INDEX,
    PAD_ANCHOR,
    anchor_generator,
    block_mask_mod,
    build_blocks,
    dense_block_mask,
    dflash_loss,
    expected_accepted,
    flex_block_mask,
    gamma_for,
    layer_mask_rules,
    sample_anchors,
    simulated_tau,
)
from flashdraft.target import FrozenTarget
from flashdraft.tiny_configs import build_tiny_target

M = 5  # mask token id of the tiny drafters
BS = 4

# ---- anchors -----------------------------------------------------------------------------------------------------


def test_gamma_for():
    assert (gamma_for(16), gamma_for(10), gamma_for(8)) == (7.0, 5.0, 4.0)
    assert gamma_for(12) == pytest.approx(5 + 2 / 3) and gamma_for(32) == pytest.approx(7 + 16 / 3)
    assert (gamma_for(4), gamma_for(2)) == (2.0, 1.0)


def test_sample_anchors_rule():
    # Anchor p: response token, next token a response token too, p >= 1, p + bs - 1 <= T - 1 (T = 12 → p <= 8).
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    assert sample_anchors(mask, 10, BS).tolist() == [2, 3, 6, 7, 8]
    few = sample_anchors(mask, 3, BS, anchor_generator(0, 0, 0))
    assert len(few) == 3 and set(few.tolist()) <= {2, 3, 6, 7, 8} and few.tolist() == sorted(set(few.tolist()))
    assert sample_anchors(mask, 0, BS).numel() == 0
    assert sample_anchors(torch.zeros(12), 4, BS).numel() == 0
    assert sample_anchors(torch.ones(3), 4, BS).numel() == 0  # no room for a block
    assert sample_anchors(torch.ones(5), 4, BS).tolist() == [1]
    assert sample_anchors(mask, 4, BS).dtype == torch.long


def test_anchor_generator_per_epoch_and_sample():
    mask = torch.ones(600)
    draw = lambda seed, epoch, index: sample_anchors(mask, 16, 16, anchor_generator(seed, epoch, index)).tolist()
    assert draw(0, 1, 7) == draw(0, 1, 7)
    assert draw(0, 1, 7) != draw(0, 2, 7)
    assert draw(0, 1, 7) != draw(0, 1, 8)
    assert draw(0, 1, 7) != draw(1, 1, 7)


# ---- blocks: labels and weights line up with positions -------------------------------------------------------


def test_build_blocks_hand_made():
    ids = torch.tensor([list(range(10, 20)), list(range(20, 30))])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    anchors = [torch.tensor([3, 6]), torch.tensor([7])]
    batch = build_blocks(ids, loss_mask, anchors, BS, M, gamma=2.0)
    x, e1, e2 = IGNORE_INDEX, math.exp(-1 / 2), math.exp(-2 / 2)

    assert batch.anchors.tolist() == [[3, 6], [7, PAD_ANCHOR]]
    assert batch.block_valid.tolist() == [[True, True], [True, False]]
    assert batch.block_ids.tolist() == [[13, M, M, M, 16, M, M, M], [27, M, M, M, M, M, M, M]]
    assert batch.position_ids[:, :10].tolist() == [list(range(10))] * 2
    assert batch.position_ids[:, 10:].tolist() == [[3, 4, 5, 6, 6, 7, 8, 9], [7, 8, 9, 10, 0, 1, 2, 3]]
    # Row 0, block 1: 18 and 19 are not response tokens. Row 1: position 10 is past the end; then padding.
    assert batch.labels.tolist() == [[x, 14, 15, 16, x, 17, x, x], [x, 28, 29, x, x, x, x, x]]
    torch.testing.assert_close(
        batch.weights,
        torch.tensor([[0, 1, e1, e2, 0, 1, 0, 0], [0, 1, e1, 0, 0, 0, 0, 0]], dtype=torch.float32),
    )
    assert batch.ctx_len == 10
    # Default γ follows the block size; no anchors at all still gives one (padding) block.
    assert build_blocks(ids, loss_mask, [torch.tensor([3]), torch.tensor([3])], 16, M).weights[0, 2].item() == (
        pytest.approx(math.exp(-1 / 7))
    )
    empty = build_blocks(ids, loss_mask, [torch.empty(0, dtype=torch.long)] * 2, BS, M)
    assert empty.anchors.tolist() == [[PAD_ANCHOR]] * 2 and (empty.labels == x).all()
    with pytest.raises(ValueError, match="anchors must lie in"):
        build_blocks(ids, loss_mask, [torch.tensor([10]), torch.tensor([1])], BS, M)


# ---- the block mask ------------------------------------------------------------------------------------------


def brute_force_mask(batch, window=None, causal=False):
    """The block-mask rules of flashdraft/drafter/recipe.py written out key by key, positions as at inference (key
    index = position)."""
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
    from torch.nn.attention.flex_attention import create_mask

    batch = small_batch()
    dense = dense_block_mask(batch, window=window, causal=causal)
    B, _, Q, K = dense.shape
    predicate = create_mask(block_mask_mod(batch, window=window, causal=causal), B, 1, Q, K, device="cpu")
    assert torch.equal(predicate, dense)
    block_mask = flex_block_mask(batch, window=window, causal=causal)
    assert torch.equal(create_mask(block_mask.mask_mod, B, 1, Q, K, device="cpu"), dense)


def test_flex_attention_matches_sdpa_with_dense_mask_on_cpu():
    from torch.nn.attention.flex_attention import flex_attention

    batch = small_batch()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 12, 8, generator=g)
    k, v = (torch.randn(2, 2, 23, 8, generator=g) for _ in range(2))
    flex = flex_attention(q, k, v, block_mask=flex_block_mask(batch))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(batch))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_layer_mask_rules():
    drafter = DFlashDraftModel.from_target(
        build_tiny_target("qwen3", 4).config,
        num_layers=2,
        block_size=BS,
        target_layer_ids=[1, 2],
        mask_token_id=M,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    assert layer_mask_rules(drafter.config) == [{"window": 3, "causal": True}, {"window": None, "causal": False}]


# ---- the loss ------------------------------------------------------------------------------------------------


def reference_loss(hidden, weight, labels, weights):
    """Full float64 logits and plain cross-entropy: Σ w·CE / Σ w over labelled positions."""
    logits = hidden.double() @ weight.double().t()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    labelled = labels.flatten() != IGNORE_INDEX
    w = weights.double().flatten() * labelled
    return (w * ce).sum() / w.sum(), logits.argmax(-1)


def random_loss_inputs(dtype=torch.float64, seed=0, bs=5, blocks=3, vocab=97, width=12):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, blocks * bs, width, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, blocks * bs), generator=g)
    # Plant correct predictions on some rows so that accuracy and accepted runs are not trivially 0.
    argmax = (hidden @ weight.t()).argmax(-1)
    plant = torch.rand(2, blocks * bs, generator=g) < 0.6
    labels = torch.where(plant, argmax, labels)
    labels[:, ::bs] = IGNORE_INDEX  # k = 0 is never labelled
    labels[1, -2:] = IGNORE_INDEX
    weights = torch.rand(2, blocks * bs, generator=g, dtype=torch.float64) * (labels != IGNORE_INDEX)
    return hidden.to(dtype).requires_grad_(), weight.to(dtype), labels, weights


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_loss_and_grad_match_full_logits_reference(chunk_size):
    hidden, weight, labels, weights = random_loss_inputs()
    loss, stats = dflash_loss(hidden, weight, labels, weights, block_size=5, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().clone().requires_grad_()
    ref, argmax = reference_loss(ref_hidden, weight, labels, weights)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)  # every element

    labelled = labels != IGNORE_INDEX
    hits = (argmax == labels) & labelled
    by_k = lambda t: t.view(2, 3, 5).sum(dim=(0, 1))
    assert torch.equal(stats.correct, by_k(hits)) and torch.equal(stats.valid, by_k(labelled))
    assert stats.correct.sum() > 0 and stats.correct[0] == 0 and stats.valid[0] == 0
    runs = 0
    for block in hits.view(6, 5)[:, 1:].tolist():
        for hit in block:
            if not hit:
                break
            runs += 1
    assert stats.accepted.item() == runs and stats.blocks.item() == 6
    torch.testing.assert_close(stats.weight_sum.double(), weights.sum(), rtol=1e-6, atol=0)


def test_loss_low_precision_and_no_grad():
    hidden, weight, labels, weights = random_loss_inputs(dtype=torch.bfloat16, vocab=301, width=32)
    loss, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, chunk_size=4)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    ref_hidden = hidden.detach().double().requires_grad_()
    ref, _ = reference_loss(ref_hidden, weight.double(), labels, weights)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=2e-3)
    with torch.no_grad():
        again, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, chunk_size=4)
    assert torch.equal(again, loss.detach())


def test_loss_denominator_and_nothing_labelled():
    hidden, weight, labels, weights = random_loss_inputs()
    loss, stats = dflash_loss(hidden, weight, labels, weights, block_size=5)
    total, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, denominator=10.0)
    torch.testing.assert_close(total, stats.loss_sum.double() / 10, rtol=1e-6, atol=0)
    torch.testing.assert_close(total * 10 / stats.weight_sum, loss, rtol=1e-6, atol=0)

    none = torch.full_like(labels, IGNORE_INDEX)
    loss, stats = dflash_loss(hidden, weight, none, torch.zeros_like(weights), block_size=5)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert loss.item() == 0 and not grad.any() and stats.blocks.item() == 0
    assert stats.tau().item() == 1.0 and stats.block_tau().item() == 1.0


def test_tau_definitions():
    assert expected_accepted(torch.tensor([0.5, 0.5])).item() == 0.75
    assert simulated_tau(torch.tensor([0.5, 0.5])).item() == 1.75
    assert simulated_tau(torch.ones(15)).item() == 16.0  # bs 16, all accepted: 15 drafted + the bonus token
    assert simulated_tau(torch.zeros(15)).item() == 1.0


# ---- failure signatures on tiny targets ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def setup(request):
    """A float64 tiny target (features of layers 1, 3, 5), a 2-layer drafter and a packed batch with padding."""
    target = FrozenTarget.from_model(
        build_tiny_target(request.param, num_layers=8, dtype=torch.float64), [1, 3, 5], strict=False
    )
    torch.manual_seed(1)
    drafter = DFlashDraftModel.from_target(
        target.config, num_layers=2, block_size=BS, target_layer_ids=target.target_layer_ids, mask_token_id=M
    )
    drafter = drafter.double().eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(6, 256, (2, 23), generator=g)
    loss_mask = torch.ones(2, 23, dtype=torch.long)
    loss_mask[:, :5] = 0
    loss_mask[1, 19:] = 0  # right padding
    attention_mask = torch.ones(2, 23, dtype=torch.long)
    attention_mask[1, 19:] = 0
    batch = build_blocks(ids, loss_mask, [torch.tensor([5, 9, 14, 19]), torch.tensor([6, 12])], BS, M)
    features = target.capture(ids, attention_mask)
    return target, drafter, ids, batch, features


def train_forward(drafter, batch, features, noise, **mask_rule):
    return drafter(
        position_ids=batch.position_ids,
        attention_mask=dense_block_mask(batch, **mask_rule),
        noise_embedding=noise,
        target_hidden=features,
    )


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


def test_features_come_from_the_same_position(setup):
    target, _, ids, _, features = setup
    i = 11
    prefix = target.capture(ids[:1, : i + 1])
    torch.testing.assert_close(prefix[0, i], features[0, i], rtol=1e-6, atol=1e-6)
    # Same batch shape and kernels as the reference below, so "unchanged" can be exact.
    single = target.capture(ids[:1])
    nxt = ids[:1].clone()
    nxt[0, i + 1] = (nxt[0, i + 1] + 1) % 256
    assert torch.equal(target.capture(nxt)[0, : i + 1], single[0, : i + 1])  # causal: i + 1 never leaks back
    cur = ids[:1].clone()
    cur[0, i] = (cur[0, i] + 1) % 256
    assert not torch.isclose(target.capture(cur)[0, i], single[0, i]).all()  # token i itself is in feature i


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


def test_loss_on_drafter_output_trains_the_drafter(setup):
    target, drafter, _, batch, features = setup
    drafter.zero_grad()
    hidden = train_forward(drafter, batch, features, target.embed(batch.block_ids))
    loss, stats = dflash_loss(hidden, target.lm_head_weight, batch.labels, batch.weights, block_size=BS, chunk_size=3)
    logits = drafter.compute_logits(hidden, target.lm_head_weight)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    weights = batch.weights.double()
    torch.testing.assert_close(loss, (ce * weights.flatten()).sum() / weights.sum(), rtol=1e-10, atol=0)
    loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0 and drafter.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert not target.lm_head_weight.requires_grad and target.lm_head_weight.grad is None
    assert stats.valid.tolist() == [0, 6, 6, 6]


# ---- the GPU path (the H200; skipped elsewhere) --------------------------------------------------------------

CUDA = torch.cuda.is_available()


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
    block_mask = flex_block_mask(batch, compile=True)
    out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(batch))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_loss_bf16_on_gpu_never_holds_all_logits():
    g = torch.Generator(device="cuda").manual_seed(6)
    # 16 chunks of 1024 rows: all fp32 logits would be 2 GB, one chunk's 125 MiB. A chunked loss holds a few
    # chunk-sized temporaries (logits, their gradient; 351 MiB measured on the H200 at 4096 rows), independent of rows.
    rows, vocab, width, bs, chunk = 16384, 32000, 256, 16, 1024
    hidden = torch.randn(1, rows, width, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda", generator=g) / 16).bfloat16()
    labels = torch.randint(0, vocab, (1, rows), device="cuda", generator=g)
    labels[:, ::bs] = IGNORE_INDEX
    weights = torch.rand(1, rows, device="cuda", generator=g) * (labels != IGNORE_INDEX)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss, _ = dflash_loss(hidden, weight, labels, weights, block_size=bs, chunk_size=chunk)
    (grad,) = torch.autograd.grad(loss, hidden)
    peak = torch.cuda.max_memory_allocated() - before
    chunk_logits = chunk * vocab * 4
    assert peak < 4 * chunk_logits, f"peak {peak / 2**20:.0f} MiB: more than 4 chunks of logits at once"
    ref_hidden = hidden.detach().double().requires_grad_()
    ref, _ = reference_loss(ref_hidden, weight.double(), labels, weights)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_compiled_chunk_math_equals_eager_on_gpu():
    from flashdraft.drafter.recipe import _chunk_ce, _compiled_chunk_ce

    g = torch.Generator(device="cuda").manual_seed(7)
    for rows in (1000, 37):  # a full chunk and a short last one (dynamic shapes)
        logits = torch.randn(rows, 50_000, device="cuda", generator=g) * 4
        target = torch.randint(0, 50_000, (rows, 1), device="cuda", generator=g)
        w = torch.rand(rows, 1, device="cuda", generator=g)
        got = _compiled_chunk_ce()(logits, target, w, torch.bfloat16)
        want = _chunk_ce(logits, target, w, torch.bfloat16)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2].float(), want[2].float(), rtol=1e-2, atol=1e-6)
