"""The fused linear cross-entropy (`dflash_loss`) against the plain full-logits reference: loss, gradient wrt the
hidden states and the step's counts, in float64 on odd shapes with ignored positions, for every objective (CE or
LK, exp or D-PACE weights), in bfloat16, with a step-wide denominator, with nothing labelled, on a real drafter's
output, and on the GPU (memory, the compiled chunk math)."""

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.blocks import IGNORE_INDEX
from flashdraft.train.loss import Objective, dflash_loss
from flashdraft.train.loss.reference import reference_loss
from tests.train import tiny_recipe
from tests.train.tiny_recipe import BS, train_forward

CUDA = torch.cuda.is_available()


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


# (block size, blocks per sequence, vocabulary, hidden width): the usual case, then odd and degenerate ones (a
# two-token vocabulary, a width of 1, a single block whose last two positions are ignored).
SHAPES = [(5, 3, 97, 12), (3, 7, 31, 5), (4, 1, 2, 1)]
OBJECTIVES = [
    pytest.param(Objective(), id="ce-exp"),
    pytest.param(Objective(loss="lk", lk_eta=2.5), id="lk-exp"),
    pytest.param(Objective(weighting="dpace", dpace_alpha=0.3), id="ce-dpace"),
    pytest.param(Objective(loss="lk", weighting="dpace"), id="lk-dpace"),
]


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("bs, blocks, vocab, width", SHAPES)
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_loss_and_grad_match_full_logits_reference(chunk_size, bs, blocks, vocab, width, objective):
    hidden, weight, labels, weights = random_loss_inputs(bs=bs, blocks=blocks, vocab=vocab, width=width)
    loss, stats = dflash_loss(
        hidden, weight, labels, weights, block_size=bs, chunk_size=chunk_size, objective=objective
    )
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().clone().requires_grad_()
    ref, ref_stats = reference_loss(ref_hidden, weight, labels, weights, block_size=bs, objective=objective)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)  # every element
    assert not grad[labels == IGNORE_INDEX].any(), "an ignored position got a gradient"
    if objective != Objective():  # the option is honoured, not silently the default
        default, _ = dflash_loss(hidden, weight, labels, weights, block_size=bs, chunk_size=chunk_size)
        assert (loss - default).abs() > 1e-6

    # The counts, by hand from the full logits' argmax, and equal to the reference's.
    labelled = labels != IGNORE_INDEX
    hits = ((hidden.detach() @ weight.t()).argmax(-1) == labels) & labelled
    by_k = lambda t: t.view(2, blocks, bs).sum(dim=(0, 1))
    assert torch.equal(stats.correct, by_k(hits)) and torch.equal(stats.valid, by_k(labelled))
    assert stats.correct.sum() > 0 and stats.correct[0] == 0 and stats.valid[0] == 0
    runs = 0
    for block in hits.view(-1, bs)[:, 1:].tolist():
        for hit in block:
            if not hit:
                break
            runs += 1
    assert stats.accepted.item() == runs
    assert stats.blocks.item() == labelled.view(-1, bs)[:, 1:].any(-1).sum().item()
    normaliser = weights.sum() if objective.weighting == "exp" else labelled.view(-1, bs).any(-1).sum().double()
    torch.testing.assert_close(stats.weight_sum.double(), normaliser, rtol=1e-6, atol=0)
    for name in ("correct", "valid", "accepted", "blocks"):
        assert torch.equal(getattr(stats, name), getattr(ref_stats, name)), name
    torch.testing.assert_close(stats.loss_sum, ref_stats.loss_sum, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats.weight_sum, ref_stats.weight_sum, rtol=1e-12, atol=0)


@pytest.mark.parametrize("objective", [OBJECTIVES[0], OBJECTIVES[3]])
def test_loss_low_precision_and_no_grad(objective):
    hidden, weight, labels, weights = random_loss_inputs(dtype=torch.bfloat16, vocab=301, width=32)
    loss, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, chunk_size=4, objective=objective)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    ref_hidden = hidden.detach().double().requires_grad_()
    ref, _ = reference_loss(ref_hidden, weight.double(), labels, weights, block_size=5, objective=objective)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref, rtol=2e-2, atol=2e-2)
    # bf16 logits: about 1% of the largest gradient element (D-PACE's weights make gradients larger than exp's).
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=1e-2 * float(ref_grad.abs().max()))
    with torch.no_grad():
        again, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, chunk_size=4, objective=objective)
    assert torch.equal(again, loss.detach())


def random_teacher(like: torch.Tensor, seed: int = 11, scale: float = 1.0) -> torch.Tensor:
    """(B, Q, D) float64 hidden states standing in for the target's final ones before each label."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("bs, blocks, vocab, width", SHAPES)
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_target_distribution_loss_and_grad_match_reference(chunk_size, bs, blocks, vocab, width, objective):
    """recipe.labels = target: KL (or LK) against the target's distribution, every element of the loss and its
    gradient against the reference's autograd of torch's KL divergence and Σ min(p, q)."""
    hidden, weight, labels, weights = random_loss_inputs(bs=bs, blocks=blocks, vocab=vocab, width=width)
    teacher = random_teacher(hidden, scale=2.0)
    loss, stats = dflash_loss(
        hidden,
        weight,
        labels,
        weights,
        block_size=bs,
        chunk_size=chunk_size,
        objective=objective,
        teacher_hidden=teacher,
    )
    (grad,) = torch.autograd.grad(loss, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref, ref_stats = reference_loss(
        ref_hidden, weight, labels, weights, block_size=bs, objective=objective, teacher_hidden=teacher
    )
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)  # every element
    assert not grad[labels == IGNORE_INDEX].any(), "an ignored position got a gradient"
    assert grad[labels != IGNORE_INDEX].abs().sum() > 0
    # Trained against the distribution, counted against the tokens: the hits are the label tokens' own.
    token_loss, token_stats = dflash_loss(
        hidden, weight, labels, weights, block_size=bs, chunk_size=chunk_size, objective=objective
    )
    assert (loss - token_loss).abs() > 1e-6
    for name in ("correct", "valid", "accepted", "blocks"):
        assert torch.equal(getattr(stats, name), getattr(token_stats, name)), name
        assert torch.equal(getattr(stats, name), getattr(ref_stats, name)), name
    torch.testing.assert_close(stats.loss_sum, ref_stats.loss_sum, rtol=1e-6, atol=0)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_target_distribution_of_one_token_is_the_token_loss(objective):
    """A target sure of the label token (p one-hot) makes KL the cross-entropy and Σ min(p, q) the label's q: the
    distribution path then equals the token path, loss and gradient, for every objective. The head is the identity
    (width = vocabulary), so the teacher's logits can be set directly."""
    bs, blocks, vocab = 5, 3, 23
    hidden, _, labels, weights = random_loss_inputs(bs=bs, blocks=blocks, vocab=vocab, width=vocab)
    head = torch.eye(vocab, dtype=torch.float64)
    teacher = 1e4 * F.one_hot(labels.clamp(min=0), vocab).double()  # exp(-1e4) = 0 in float64: p is one-hot
    soft, soft_stats = dflash_loss(
        hidden, head, labels, weights, block_size=bs, chunk_size=4, objective=objective, teacher_hidden=teacher
    )
    (soft_grad,) = torch.autograd.grad(soft, hidden)
    hard, hard_stats = dflash_loss(hidden, head, labels, weights, block_size=bs, chunk_size=4, objective=objective)
    (hard_grad,) = torch.autograd.grad(hard, hidden)
    torch.testing.assert_close(soft, hard, rtol=1e-12, atol=0)
    torch.testing.assert_close(soft_grad, hard_grad, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(soft_stats.loss_sum, hard_stats.loss_sum, rtol=1e-6, atol=0)


def test_target_distribution_shape_error():
    hidden, weight, labels, weights = random_loss_inputs()
    for loss_fn in (dflash_loss, reference_loss):
        with pytest.raises(ValueError, match="teacher_hidden must be shaped like hidden"):
            loss_fn(hidden, weight, labels, weights, block_size=5, teacher_hidden=hidden[:, :-5].detach())


def test_loss_denominator_and_nothing_labelled():
    hidden, weight, labels, weights = random_loss_inputs()
    loss, stats = dflash_loss(hidden, weight, labels, weights, block_size=5)
    total, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, denominator=10.0)
    torch.testing.assert_close(total, stats.loss_sum.double() / 10, rtol=1e-6, atol=0)
    torch.testing.assert_close(total * 10 / stats.weight_sum, loss, rtol=1e-6, atol=0)
    ref_total, _ = reference_loss(hidden, weight, labels, weights, block_size=5, denominator=10.0)
    torch.testing.assert_close(total, ref_total, rtol=1e-12, atol=0)

    none = torch.full_like(labels, IGNORE_INDEX)
    loss, stats = dflash_loss(hidden, weight, none, torch.zeros_like(weights), block_size=5)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert loss.item() == 0 and not grad.any() and stats.blocks.item() == 0
    assert stats.tau().item() == 1.0 and stats.block_tau().item() == 1.0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h, w, lab, wt: (h[:, :-1], w, lab, wt), "expected hidden"),
        (lambda h, w, lab, wt: (h, w[:, :-1], lab, wt), "LM head input size"),
        (lambda h, w, lab, wt: (h[:, :-1], w, lab[:, :-1], wt[:, :-1]), "not a multiple of block_size"),
    ],
    ids=["labels-shape", "head-width", "block-size"],
)
def test_loss_shape_errors(change, match):
    hidden, weight, labels, weights = change(*random_loss_inputs())
    for loss_fn in (dflash_loss, reference_loss):
        with pytest.raises(ValueError, match=match):
            loss_fn(hidden, weight, labels, weights, block_size=5)
    with pytest.raises(ValueError, match="chunk_size"):
        dflash_loss(*random_loss_inputs(), block_size=5, chunk_size=0)


# ---- on a real drafter's output ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=tiny_recipe.FAMILIES)
def setup(request):
    return tiny_recipe.build(request.param)


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
    ref, _ = reference_loss(ref_hidden, weight.double(), labels, weights, block_size=bs)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=2e-2, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_compiled_chunk_math_equals_eager_on_gpu():
    from flashdraft.train.loss.chunks import compiled as _compiled
    from flashdraft.train.loss.fused import _chunk_ce, _chunk_soft

    g = torch.Generator(device="cuda").manual_seed(7)
    for rows in (1000, 37):  # a full chunk and a short last one (dynamic shapes)
        logits = torch.randn(rows, 50_000, device="cuda", generator=g) * 4
        teacher = torch.randn(rows, 50_000, device="cuda", generator=g) * 4
        target = torch.randint(0, 50_000, (rows, 1), device="cuda", generator=g)
        for eta in (None, 3.0):  # cross-entropy / KL, LK
            for fn, inputs in ((_chunk_ce, (logits,)), (_chunk_soft, (logits, teacher))):
                got = _compiled(fn)(*inputs, target, eta, torch.bfloat16)
                want = fn(*inputs, target, eta, torch.bfloat16)
                torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
                assert torch.equal(got[2], want[2])
                torch.testing.assert_close(got[3].float(), want[3].float(), rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("compile_chunks, compiles", [(True, True), (False, False), (None, False)])
def test_compile_chunks_decides_whether_the_chunk_math_is_compiled(monkeypatch, compile_chunks, compiles):
    """On this CPU, None means eager (compiling is for CUDA); True compiles, False never does. The stand-in for
    torch.compile records its calls and returns the function itself, so the loss must equal the reference too."""
    from flashdraft.train.loss import fused

    calls = []
    monkeypatch.setattr(fused, "compiled", lambda fn: calls.append(fn.__name__) or fn)
    hidden, weight, labels, weights = random_loss_inputs()
    loss, _ = dflash_loss(hidden, weight, labels, weights, block_size=5, chunk_size=7, compile_chunks=compile_chunks)
    assert calls == (["_chunk_ce"] if compiles else [])
    ref, _ = reference_loss(hidden.detach(), weight, labels, weights, block_size=5)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-12, atol=0)
