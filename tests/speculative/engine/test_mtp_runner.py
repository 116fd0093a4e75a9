"""MTP decoding on the engine is exact: greedy output equals the target's own greedy decoding, and on the CPU
(float64) every round's drafts — hence every acceptance length — equal the plain loop's; sampling keeps the
target's distribution. On a CUDA device the same runs in float32 with the CUDA graphs on (skipped without one)."""

import pytest
import torch

from flashdraft.speculative.baselines import autoregressive_generate, mtp_generate
from flashdraft.speculative.engine import session
from flashdraft.target.mtp import MTPHead

from .. import one_thread, ready, reference_greedy, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from ..test_mtp import train_head
from ..test_sampling import P_MIN, PROMPT, VOCAB8, _exact_joint_of_tokens_2_and_3, chi_square_pvalue
from . import CONFIGS, HostReads

NEW = 30


@pytest.fixture(
    scope="module",
    params=[(f, c) for f in ("qwen3_5", "qwen3") for c in CONFIGS],
    ids=lambda p: f"{p[0]}-{p[1].id}",
)
def setup(request):
    """(target, a briefly trained MTP head, prompts with the target's greedy continuations, device, graphs)."""
    family, config = request.param
    (device, dtype, graphs), marks = config.values[0], config.marks
    for mark in marks:
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
    target = tiny_target(family, seed=11)
    g = torch.Generator().manual_seed(13)
    with ready(target):
        # Trained on the continuations of 8 prompts; decoded: 3 of them (long accepted chains) and 4 others of
        # lengths 1 .. 23 (mostly short ones).
        train = [torch.randint(0, 256, (1, 8), generator=g) for _ in range(8)]
        sequences = torch.cat([torch.cat([p[0], torch.tensor(reference_greedy(target, p, 36))])[None] for p in train])
        head = train_head(MTPHead.for_target(target), target, sequences)
        lengths = torch.randint(1, 24, (4,), generator=g).tolist()
        prompts = train[:3] + [torch.randint(0, 256, (1, n), generator=g) for n in lengths]
        cases = [(p, reference_greedy(target, p, NEW)) for p in prompts]
    target, head = target.to(device, dtype), head.to(device, dtype)
    cases = [(p.to(device), c if dtype == torch.float64 else None) for p, c in cases]
    with ready(target):
        if dtype != torch.float64:  # the reference in the device's own precision, one token per forward
            cases = [(p, reference_greedy(target, p, NEW)) for p, _ in cases]
    yield target, head, cases, device, graphs
    session.drop_session(target)


def test_greedy_equals_target_greedy_and_the_plain_loop(setup):
    target, head, cases, device, graphs = setup
    accepted = []
    with ready(target):
        for i, (prompt, expected) in enumerate(cases):
            for num_drafts, block_size in ((3, 16), (1, 4), (5, 8)):
                result = mtp_generate(
                    target, head, prompt, len(expected), num_drafts=num_drafts, engine=True, block_size=block_size
                )
                assert result.backend == ("engine+graphs" if graphs else "engine")
                assert result.tokens == expected, f"prompt {i} (length {prompt.shape[1]}), {num_drafts} drafts"
                assert result.num_target_forwards == 1 + result.num_rounds
                accepted += [a - 1 for a in result.acceptance_lengths[:-1]]
                if device == "cpu":  # float64: the same drafts, so the same acceptance, as transformers' forwards
                    plain = mtp_generate(target, head, prompt, len(expected), num_drafts=num_drafts, engine=False)
                    assert result.acceptance_lengths == plain.acceptance_lengths, f"prompt {i}, {num_drafts} drafts"
                    assert result.position_accepted == plain.position_accepted
    assert {0, 1, 3, 5} <= set(accepted)  # rejected, partly and fully accepted chains


def test_max_new_tokens_and_stop_tokens(setup):
    target, head, cases, _, _ = setup
    prompt, expected = cases[4]
    with ready(target):
        for n in (1, 2, 3, 4, 5, 9):
            assert mtp_generate(target, head, prompt, n, engine=True).tokens == expected[:n]
        stop = expected[len(expected) // 2]
        cut = expected[: expected.index(stop) + 1]
        result = mtp_generate(target, head, prompt, len(expected), stop_token_ids=[stop], engine=True)
        assert result.tokens == cut and result.stopped


@pytest.mark.distribution
@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_mtp_sampling_on_the_engine_equals_target_distribution(config):
    """As test_mtp.py's sampling test, through the engine: drafts drawn inside the step (Gumbel noise), device-side
    rejection sampling and commits."""
    device, dtype, graphs = config
    target = tiny_target("qwen3_5", num_layers=4, vocab_size=VOCAB8, seed=3, dtype=torch.float32).to(device)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(30)
    torch.manual_seed(4)
    head = MTPHead.for_target(target)
    trials = 1500
    g = torch.Generator(device=device).manual_seed(5)
    counts = torch.zeros(VOCAB8, VOCAB8)
    accepted_any = 0
    prompt = PROMPT.to(device)
    with ready(target):
        expected = _exact_joint_of_tokens_2_and_3(target, 1.0, 1.0, 0).cpu()
        for _ in range(trials):
            r = mtp_generate(
                target, head, prompt, 4, temperature=1.0, num_drafts=2, generator=g, engine=True, block_size=4
            )
            counts[r.tokens[1], r.tokens[2]] += 1
            accepted_any += any(a > 1 for a in r.acceptance_lengths)
    session.drop_session(target)
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > P_MIN, f"p-value {pvalue:.3g}"  # a false alarm once in 1000 runs of a correct sampler
    assert 0.05 * trials < accepted_any < 0.95 * trials


def test_bad_arguments():
    target = tiny_target("qwen3", seed=0, dtype=torch.float32)
    head = MTPHead.for_target(target)
    prompt = torch.tensor([[1, 2, 3]])
    with ready(target):
        with pytest.raises(ValueError, match="num_drafts must be in"):
            session.engine_decode(target, prompt, 4, mtp=head, num_drafts=4, block_size=4)
        with pytest.raises(ValueError, match="one of a drafter"):
            session.engine_decode(target, prompt, 4, mtp=head, lookup=object())
        with pytest.raises(ValueError, match="torch.float64 and the target torch.float32"):
            mtp_generate(target, head.double(), prompt, 4, engine=True)
    session.drop_session(target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mtp_on_the_engine_at_27b_width_equals_greedy_in_float32():
    """A 4-layer slice of a Qwen3.5-27B-shaped random target (hidden 5120, 248320-token vocabulary, gated attention
    with partial rotary, untied embeddings) with a random MTP layer of its shapes, in float32: MTP decoding on the
    engine with CUDA graphs equals the engine's greedy decoding and transformers' `generate`, token for token."""
    from transformers import AutoModelForCausalLM

    from bench.target_forward import qwen35_27b_config
    from flashdraft import fastpath

    config = qwen35_27b_config(4)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    with torch.device("cuda"):
        target = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
        head = MTPHead.for_target(target)
        head.apply(target._init_weights)
    fastpath.enable(target, strict=True)
    prompt = torch.randint(0, config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1)).cuda()
    try:
        result = mtp_generate(target, head.eval(), prompt, 40, num_drafts=3, engine=True)
        assert result.backend == "engine+graphs"
        assert result.tokens == autoregressive_generate(target, prompt, 40, engine=True).tokens
        expected = target.generate(
            prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, prompt.shape[1] :].tolist()
        assert result.tokens == expected
    finally:
        session.drop_session(target)
        fastpath.disable(target)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_the_captured_step_reads_nothing_on_the_host(temperature):
    """The MTP chain's step, which a GPU captures in a CUDA graph, reads no device value on the host: its eager run on
    the CPU, under `HostReads`, finds none."""
    from flashdraft.speculative.engine.mtp_runner import MTPRunner
    from flashdraft.speculative.engine.target_runner import TargetEngine

    target = tiny_target("qwen3_5", seed=11).float()
    engine = TargetEngine(target, max_len=64, block_size=5)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))
    engine.prefill(prompt)
    runner = MTPRunner(MTPHead.for_target(target), engine, 3, sampling=(temperature, 1.0, 0))
    runner.prefill(prompt, 7)
    if runner.noise is not None:
        runner.noise.exponential_().log_().neg_()  # Gumbel noise, as `draft` draws it before the step
    with HostReads() as reads:
        runner.step.fn()
    assert reads.found == []
    assert runner.drafts.shape == (3,)
