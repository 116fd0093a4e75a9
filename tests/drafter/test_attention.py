"""The drafter's FlexAttention path (a `BlockMask`) against its SDPA path (the dense boolean mask) and a float64
reference: forward on the CPU (FlexAttention runs forward eagerly there), forward and every gradient on the GPU."""

import pytest
import torch

from flashdraft.drafter import DFlashDraftModel
from flashdraft.target.tiny import tiny_config
from flashdraft.train.blocks import build_blocks
from flashdraft.train.masks import dense_block_mask, flex_block_mask, layer_mask_rules

HIDDEN = 64  # tiny_config's hidden size
CUDA = torch.cuda.is_available()
# Eager FlexAttention on the CPU is the unfused reference implementation: expected here, and what it warns about.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def drafter(seed=0, sliding=False, **kwargs) -> DFlashDraftModel:
    if sliding:
        kwargs |= {"layer_types": ["sliding_attention"] * 2, "sliding_window": 7}
    torch.manual_seed(seed)
    model = DFlashDraftModel.from_target(
        tiny_config("qwen3", num_layers=8), num_layers=2, block_size=4, mask_token_id=5, **kwargs
    )
    # Non-trivial norm weights, so that a wrong dtype path through q/k norms would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def packed_batch(seed=1, length=37, anchors=(7, 4), block_size=4, features=2):
    """Two sequences of odd length, different anchor counts (so one has padding blocks), a prompt part."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 200, (len(anchors), length), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :5] = 0
    picks = [torch.randperm(length - block_size - 5, generator=g)[:n].sort().values + 5 for n in anchors]
    batch = build_blocks(ids, loss_mask, picks, block_size, mask_token_id=5)
    ctx = torch.randn(len(anchors), length, features * HIDDEN, generator=g)
    noise = torch.randn(len(anchors), batch.block_ids.shape[1], HIDDEN, generator=g)
    return batch, ctx, noise


def masks(model, batch):
    (rule,) = {tuple(sorted(r.items())) for r in layer_mask_rules(model.config)}
    rule = dict(rule)
    return dense_block_mask(batch, **rule), flex_block_mask(batch, **rule)


def forward(model, batch, ctx, noise, mask, dtype):
    model = model.to(dtype)
    return model(
        position_ids=batch.position_ids,
        attention_mask=mask,
        noise_embedding=noise.to(dtype),
        target_hidden=ctx.to(dtype),
    )


@pytest.mark.parametrize("sliding", [False, True])
def test_flex_forward_equals_sdpa_forward_on_cpu(sliding):
    model = drafter(sliding=sliding)
    batch, ctx, noise = packed_batch()
    dense, block = masks(model, batch)
    assert batch.anchors.min() == -1  # the second sequence has padding blocks
    with torch.no_grad():
        ref = forward(model, batch, ctx, noise, dense, torch.float64)
        flex64 = forward(model, batch, ctx, noise, block, torch.float64)
        flex32 = forward(model, batch, ctx, noise, block, torch.float32)
        sdpa32 = forward(model, batch, ctx, noise, dense, torch.float32)
    assert ref.shape == (2, 7 * 4, HIDDEN)
    torch.testing.assert_close(flex64, ref, rtol=1e-12, atol=1e-12)
    # Every element, in float32: the FlexAttention path is as close to float64 as the SDPA path is.
    torch.testing.assert_close(flex32.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sdpa32.double(), ref, rtol=1e-5, atol=1e-5)


def test_flex_mask_is_not_the_unmasked_forward():
    # Guard against a test that passes because the mask is ignored: without it, the outputs differ.
    model = drafter()
    batch, ctx, noise = packed_batch()
    _, block = masks(model, batch)
    with torch.no_grad():
        masked = forward(model, batch, ctx, noise, block, torch.float64)
        unmasked = forward(model, batch, ctx, noise, None, torch.float64)
    assert (masked - unmasked).abs().max() > 1e-3


def test_flex_refuses_attention_dropout():
    model = drafter(attention_dropout=0.1).train()
    batch, ctx, noise = packed_batch()
    _, block = masks(model, batch)
    with pytest.raises(ValueError, match="attention_dropout"):
        forward(model, batch, ctx, noise, block, torch.float32)


# ---- the GPU path: compiled FlexAttention, forward and backward ----------------------------------------------------


def _grads(model, batch, ctx, noise, mask, dtype, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = forward(model, batch, ctx, noise, mask, dtype)
    weight = torch.linspace(-1, 1, out.numel(), device="cuda", dtype=torch.float64).view_as(out)
    (out.double() * weight).sum().backward()
    return out.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


def _max_err(got, want):
    return max((got[k] - want[k]).abs().max().item() / want[k].abs().max().clamp(min=1e-30).item() for k in want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("sliding", [False, True])
def test_flex_forward_and_gradients_equal_sdpa_on_gpu(sliding):
    model = drafter(sliding=sliding).train().cuda()
    batch, ctx, noise = packed_batch(length=301, anchors=(24, 9))
    batch, ctx, noise = batch.to("cuda"), ctx.cuda(), noise.cuda()
    dense, block = masks(model, batch)
    ref_out, ref_grads = _grads(model, batch, ctx, noise, dense, torch.float64)
    for dtype, tol in ((torch.float32, 1e-4),):
        out, grads = _grads(model, batch, ctx, noise, block, dtype)
        sdpa_out, sdpa_grads = _grads(model, batch, ctx, noise, dense, dtype)
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
        assert _max_err(grads, ref_grads) < tol, _max_err(grads, ref_grads)
        assert _max_err(sdpa_grads, ref_grads) < tol
    # What training runs: float32 master weights under bf16 autocast. Both paths round alike; neither may be
    # much further from float64 than the other.
    out, grads = _grads(model, batch, ctx, noise, block, torch.float32, autocast=True)
    sdpa_out, sdpa_grads = _grads(model, batch, ctx, noise, dense, torch.float32, autocast=True)
    flex_err, sdpa_err = _max_err(grads, ref_grads), _max_err(sdpa_grads, ref_grads)
    assert flex_err < 2 * sdpa_err + 1e-3, (flex_err, sdpa_err)
    assert (out - ref_out).abs().max() < 2 * (sdpa_out - ref_out).abs().max() + 1e-3
